"""Decode attention kernels of the native rollout engine at RL shapes, same run, same data; prints JSON.

    python scripts/bench/decode_attention.py --preset qwen2_5_7b        # GPU

One decode step's attention for one layer: `--batch` rows, each with one new query per head, over a KV cache
of `--cache-len` positions of which row r uses [pad_r, cur] (left-padded prompts, pads drawn in [0, `--max-pad`), default 32).
- `sdpa_mask`: the engine's path before flash (cache (rows, groups, len, dim), the query heads of a KV group
  folded into the query axis, a boolean mask over all `--cache-len` positions: PyTorch's memory-efficient
  kernel; with CUDA graphs the engine attends over the whole cache length every step);
- `flash_varlen`: FlashAttention-2 varlen (engine/rollout/model.py `flash_varlen_decode`) on a cache laid
  out (rows, len, groups, dim): row r's keys start at r * len + pad_r and `seqused_k` = cur + 1 - pad_r of
  them are read (nothing past `cur`, no mask), query heads folded per group as above.
- `triton`: engine/rollout/triton_decode.py on the flash layout (16-row query tiles, reads [pad_r, cur]),
  at its default settings, and `--sweep` its tuning knobs (key block, warps, pipeline stages, key splits per
  (row, group); None: `num_splits`; the grid from `--sweep-grid`) at the last cur, with `--share` on the
  sourced path (`triton_sourced`), with `--rope` on the engine's call (`triton_rope`).
With `--share N` (GRPO's samples of one prompt) rows come in groups of N with one prompt: the group's pads are
equal and its first row's K/V fill every row's positions before pad + `--prefix`; `triton_sourced` is the
kernel with every row reading its prompt's positions from the group's first row (engine/rollout/
triton_decode.py `sourced`: one copy, which L2 may serve to the group's other rows; its bytes count the prompt
once per group), `triton_sourced_own_row` the same path reading each row's own copy (the path's cost alone).
Reported per `cur`: median milliseconds per call over `--iters` replays of a CUDA graph of 20 calls (CUDA
events), the K/V bytes each variant must read, and the largest difference of each output from `sdpa_mask` (bf16).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from gpu_timing import graph_ms  # noqa: E402
from presets import hf_config_for  # noqa: E402

from engine.rollout import triton_decode  # noqa: E402
from engine.rollout.attention_kernels import flash_varlen_decode  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2_5_7b")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--cache-len", type=int, default=768)
    ap.add_argument("--curs", default="256,512,767")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="also time the Triton kernel's tuning knobs")
    ap.add_argument(
        "--sweep-grid",
        default="32,64,128;4,8;2,3,4;None,1,2,3,4",
        help="with --sweep: key blocks; warps; stages; splits (None: num_splits), at the last --curs",
    )
    ap.add_argument(
        "--rope",
        action="store_true",
        help="also the kernel as the engine calls it: on the raw QKV projection with RoPE and the K/V writes "
        "(`triton_rope`; sourced with --share); --sweep then sweeps that path",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=1,
        help="with --rope: copies of the cache, each call reading the next as a model's layers do, so that "
        "the GPU's L2 holds none of a call's keys (1: one layer's cache called again and again, L2-warm)",
    )
    ap.add_argument("--max-pad", type=int, default=32, help="rows' left padding drawn in [0, this); 0: none")
    ap.add_argument("--share", type=int, default=1, help="rows per prompt (> 1: the shared-prefix rows)")
    ap.add_argument(
        "--prefix", type=int, default=256, help="with --share: the prompt's positions after the pad"
    )
    args = ap.parse_args()
    cfg = hf_config_for(args.preset)
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = cfg["head_dim"]
    pg, b, n = heads // groups, args.batch, args.cache_len
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    k_blgd = torch.randn(b, n, groups, dim, device=dev, dtype=dt, generator=g)
    v_blgd = torch.randn(b, n, groups, dim, device=dev, dtype=dt, generator=g)
    k_bgld, v_bgld = k_blgd.transpose(1, 2).contiguous(), v_blgd.transpose(1, 2).contiguous()
    q = torch.randn(b, groups, pg, dim, device=dev, dtype=dt, generator=g)
    own = torch.arange(b, device=dev)
    pad = torch.randint(0, args.max_pad, (b,), device=dev, generator=g) if args.max_pad else own * 0
    ar = torch.arange(n, device=dev)
    first = own // args.share * args.share  # each row's group's first row
    end = None
    if args.share > 1 and (b % args.share or 32 + args.prefix > min(int(c) for c in args.curs.split(","))):
        raise SystemExit("--share: --batch must be a multiple of it, every --curs >= 32 + --prefix")
    if args.share > 1:  # the group's prompt: its first row's pad and K/V before pad + prefix in every row
        pad = pad[first]
        end = pad + args.prefix
        prompt = (ar[None, :] < end[:, None])[:, :, None, None]
        k_blgd, v_blgd = (torch.where(prompt, t[first], t) for t in (k_blgd, v_blgd))
        k_bgld, v_bgld = k_blgd.transpose(1, 2).contiguous(), v_blgd.transpose(1, 2).contiguous()
    result = {
        "preset": args.preset,
        "batch": b,
        "cache_len": n,
        "groups": groups,
        "per_group": pg,
        "dim": dim,
        "share": args.share,
        "prefix": args.prefix if args.share > 1 else None,
        "layers": args.layers if args.rope else None,
    }
    result["device"] = torch.cuda.get_device_name()
    result["torch"] = torch.__version__
    rows, roped = {}, None
    if args.rope:  # the raw projection, the step's RoPE rows, own caches (the kernel writes K/V at cur)
        qkv = torch.randn(b, groups, pg + 2, dim, device=dev, dtype=dt, generator=g)
        angle = torch.rand(b, dim, device=dev, generator=g) * 6.28
        src = {"sourced": (first, end)} if end is not None else {}
        copies = itertools.cycle([(k_blgd.clone(), v_blgd.clone()) for _ in range(args.layers)])
        roped = (qkv, copies, (angle.cos().to(dt), angle.sin().to(dt)), src)
    for cur in [int(c) for c in args.curs.split(",")]:
        mask = ((ar >= pad[:, None]) & (ar <= cur))[:, None, None]

        def sdpa_mask(mask=mask):
            return F.scaled_dot_product_attention(q, k_bgld, v_bgld, attn_mask=mask)

        cum_q = torch.arange(0, b * pg + 1, pg, device=dev, dtype=torch.int32)
        cum_k = torch.cat((ar[:b] * n + pad, torch.tensor([b * n], device=dev))).to(torch.int32)
        used_k = (cur + 1 - pad).to(torch.int32)

        def flash_varlen(cum_q=cum_q, cum_k=cum_k, used_k=used_k):
            return flash_varlen_decode(q, k_blgd, v_blgd, cum_q, cum_k, used_k)

        cur_t = torch.tensor([cur], device=dev)

        def triton_kernel(cur_t=cur_t, **knobs):
            return triton_decode.decode_attention(q, k_blgd, v_blgd, pad, cur_t, **knobs)

        def roped_kernel(cur_t=cur_t, roped=roped, **knobs):  # the engine's call (--rope)
            qkv, copies, rope, src = roped
            cache_k, cache_v = next(copies)  # (captured calls read the copies in turn)
            return triton_decode.decode_attention(
                qkv, cache_k, cache_v, pad, cur_t, rope=rope, **src, **knobs
            )

        ref = sdpa_mask()
        used_gb = 2 * int(used_k.sum()) * groups * dim * 2 / 1e9
        r = rows[str(cur)] = {}
        variants = [
            ("sdpa_mask", sdpa_mask, 2 * b * n * groups * dim * 2 / 1e9),
            ("flash_varlen", flash_varlen, used_gb),
            ("triton", triton_kernel, used_gb),
        ]
        if end is not None:

            def sourced(triton_kernel=triton_kernel, source=first):
                return triton_kernel(sourced=(source, end))

            def own_row(triton_kernel=triton_kernel, source=own):
                return triton_kernel(sourced=(source, end))

            unique = used_gb - 2 * int((end - pad).sum()) * groups * dim * 2 / 1e9 * (1 - 1 / args.share)
            variants.append(("triton_sourced", sourced, unique))
            variants.append(("triton_sourced_own_row", own_row, used_gb))
        if args.rope:
            variants.append(("triton_rope", roped_kernel, unique if end is not None else used_gb))
        for name, fn, gb in variants:
            r[name + "_ms"] = graph_ms(fn, args.iters)
            r[name + "_tb_per_s"] = gb / r[name + "_ms"]
            if name != "triton_rope":  # (RoPE'd queries: another attention than the reference's)
                r[name + "_max_abs_diff"] = float((fn().float() - ref.float()).abs().max())
    if args.sweep:
        sweep = result["triton_sweep"] = []
        grid = [g.split(",") for g in args.sweep_grid.split(";")]
        swept = {"sourced": (first, end)} if end is not None and not args.rope else {}  # the engine's path
        swept_kernel = roped_kernel if args.rope else triton_kernel
        for block_n, warps, stages, splits in itertools.product(*grid):
            knobs = dict(block_n=int(block_n), num_warps=int(warps), num_stages=int(stages))
            knobs["splits"] = None if splits == "None" else int(splits)
            try:
                ms = graph_ms(lambda knobs=knobs: swept_kernel(**knobs, **swept), args.iters)
            except Exception as err:  # e.g. out of shared memory for the largest tiles
                sweep.append({**knobs, "error": f"{type(err).__name__}"})
                continue
            sweep.append({**knobs, "ms": ms})
        sweep.sort(key=lambda e: e.get("ms", float("inf")))
    result["per_cur"] = rows
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
