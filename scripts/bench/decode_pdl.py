"""A narrow decode layer's kernels outside the attention: cuBLAS and compiled norms against
engine/rollout/triton_narrow.py's Triton projections and norms, with and without programmatic dependent launch
(PDL); prints JSON (GPU only, Hopper for PDL).

    python scripts/bench/decode_pdl.py --preset qwen2_5_1_5b --widths 1,8,32,64    # bash run.sh decode_pdl
    python scripts/bench/decode_pdl.py --probe     # does PDL overlap two kernels here (eager, CUDA graph)?

Per width, over every layer's own weights (random, bf16), in a CUDA graph (gpu_timing.graph_ms), microseconds
per layer of the chain QKV (+ bias) -> output projection (of a fixed attention output: no attention here) ->
residual add + RMSNorm -> fc1 + SwiGLU -> fc2 -> residual add + RMSNorm, with the MLP as triton_mlp's kernels in
all three:
- `cublas`: cuBLAS projections, compiled add + norm (the engine with `DecodeKernels(narrow=False, pdl=False)`);
- `triton`: triton_narrow's projections and norms (`pdl=False`);
- `triton_pdl`: the same and the MLP launched with PDL (the engine's default on Hopper).
`--probe`: a kernel spinning 20 us on every SM, then one that stamps its start before `gdc_wait`; a negative
start - spin end means the second started while the first ran.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gpu_timing import graph_ms  # scripts/bench/ is on sys.path
from presets import hf_config_for

from engine.models.compiled import cuda_kernel
from engine.models.triton_support import sm_count
from engine.rollout import triton_mlp, triton_narrow
from engine.rollout.model import add_partials_rms_norm, add_rms_norm

COMPILE = "ENGINE_COMPILE_ROLLOUT"


@triton.jit
def _globaltimer(like):
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [like], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _spin(t_ptr, ns, TRIGGER: tl.constexpr):
    """Runs `ns` nanoseconds, then stores its end time; lets the next kernel launch first with TRIGGER."""
    pid = tl.program_id(0)
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    t0 = _globaltimer(pid)
    t = t0
    while t - t0 < ns:
        t = _globaltimer(pid)
    tl.store(t_ptr + pid, t)


@triton.jit
def _probe(t_ptr):
    """Stores its start time, waits for the kernel before it, stores the time again."""
    pid = tl.program_id(0)
    tl.store(t_ptr + 2 * pid, _globaltimer(pid))
    tl.extra.cuda.gdc_wait()
    tl.store(t_ptr + 2 * pid + 1, _globaltimer(pid))


def bench_width(width: int, w: dict, iters: int) -> dict:
    n_layers = len(w["qkv"])
    hidden, ffn = w["fc2"][0].shape
    dev, dt, eps = w["norm"].device, w["norm"].dtype, 1e-6
    add_norm = cuda_kernel(add_rms_norm, dev, COMPILE)
    add_parts = cuda_kernel(add_partials_rms_norm, dev, COMPILE)
    x = torch.randn(width, hidden, device=dev, dtype=dt)
    h0 = add_norm(x, torch.randn_like(x), w["norm"], eps)[1]
    attn = torch.randn(width, w["proj"][0].shape[1], device=dev, dtype=dt)
    tiles = triton_mlp.default_tiles(width, hidden, ffn, dev)

    def cublas(i: int, h: torch.Tensor) -> torch.Tensor:
        F.linear(h, w["qkv"][i], w["qkv_b"][i])
        s, h = add_norm(x, F.linear(attn, w["proj"][i]), w["norm"], eps)
        out = triton_mlp.dense_mlp(h, w["fc1"][i], w["fc2"][i], tiles)
        return (add_parts if out.dim() > s.dim() else add_norm)(s, out, w["norm"], eps)[1]

    def narrow(pdl: bool):
        def one(i: int, h: torch.Tensor) -> torch.Tensor:
            triton_narrow.linear(h, w["qkv"][i], w["qkv_b"][i], pdl=pdl)
            proj = triton_narrow.linear(attn, w["proj"][i], split=split, pdl=pdl)
            s, h = triton_narrow.add_norm(x, proj, w["norm"], eps, pdl)
            out = triton_mlp.dense_mlp(h, w["fc1"][i], w["fc2"][i], tiles, pdl)
            return triton_narrow.add_norm(s, out, w["norm"], eps, pdl)[1]

        return one

    split = triton_mlp.split_for(hidden, attn.shape[1], width, dev)
    variants = {"cublas": cublas, "triton": narrow(False), "triton_pdl": narrow(True)}

    def run(fn):
        h = h0
        for i in range(n_layers):
            h = fn(i, h)
        return h

    row: dict = {"width": width, "split": tiles.split}
    ref = run(cublas).float()
    for name, fn in variants.items():
        try:
            row[name + "_us"] = round(1e3 * graph_ms(lambda f=fn: run(f), iters, reps=3) / n_layers, 2)
            row[name + "_max_abs_diff"] = float((run(fn).float() - ref).abs().max())
        except Exception as e:  # noqa: BLE001 (report, go on: PDL may not capture on this stack)
            row[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def probe_pdl() -> dict:
    """Whether PDL overlaps here: a kernel that spins 20 us on every SM, then one launched after it that
    stamps its start before `gdc_wait`; eager and in a CUDA graph, per (the spinner lets dependents launch
    early, the second kernel launched with PDL). start - spin end < 0: it started while the spinner ran."""
    sms = sm_count(torch.device("cuda"))
    t_spin = torch.zeros(sms, dtype=torch.int64, device="cuda")
    t_probe = torch.zeros(2 * sms, dtype=torch.int64, device="cuda")
    out = {}
    for trigger, pdl in ((0, 0), (1, 0), (0, 1), (1, 1)):

        def run(trigger=trigger, pdl=pdl):
            _spin[(sms,)](t_spin, 20000, TRIGGER=bool(trigger))
            _probe[(sms,)](t_probe, launch_pdl=bool(pdl))

        for mode in ("eager", "graph"):
            try:
                run()
                if mode == "graph":
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        run()
                    g.replay()
                torch.cuda.synchronize()
                end = int(t_spin.max())
                out[f"trigger{trigger}_pdl{pdl}_{mode}"] = {
                    "start_minus_spin_end_ns": int(t_probe[0::2].min()) - end,
                    "released_minus_spin_end_ns": int(t_probe[1::2].min()) - end,
                }
            except Exception as e:  # noqa: BLE001
                out[f"trigger{trigger}_pdl{pdl}_{mode}"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2_5_1_5b")
    ap.add_argument("--widths", default="1,8,32,64")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--probe", action="store_true", help="only probe_pdl()")
    args = ap.parse_args()
    if args.probe:
        print(json.dumps({"device": torch.cuda.get_device_name(), "probe": probe_pdl()}, indent=1))
        return
    cfg = hf_config_for(args.preset)
    hidden, ffn, n_layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = hidden // heads
    dev, dt = torch.device("cuda"), torch.bfloat16

    def rand(*shape):
        return [torch.randn(*shape, device=dev, dtype=dt) * 0.02 for _ in range(n_layers)]

    qkv_out = (heads + 2 * groups) * dim
    w = {
        "qkv": rand(qkv_out, hidden), "qkv_b": rand(qkv_out), "proj": rand(hidden, heads * dim),
        "fc1": rand(2 * ffn, hidden), "fc2": rand(hidden, ffn),
        "norm": 1 + 0.1 * torch.randn(hidden, device=dev, dtype=dt),
    }  # fmt: skip
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    result.update(preset=args.preset, hidden=hidden, ffn=ffn, layers=n_layers, widths=[])
    for width in [int(x) for x in args.widths.split(",")]:
        row = bench_width(width, w, args.iters)
        print(json.dumps(row), file=sys.stderr)
        result["widths"].append(row)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
