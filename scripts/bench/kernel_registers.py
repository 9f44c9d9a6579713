"""Registers, spills and shared memory of the native engine's decode attention kernel, compiled ahead of time for
an NVIDIA GPU on any machine (no GPU needed: Triton's own ptxas and cuobjdump); prints one JSON object.

    python scripts/bench/kernel_registers.py --presets qwen2_5_0_5b,qwen2_5_1_5b       # CPU or GPU machine
    PYTHONPATH=/path/to/triton-3.6:$PYTHONPATH python scripts/bench/kernel_registers.py  # another Triton

Why: a decode step's attention is latency-bound (scripts/bench/README.md, "Rollout"): how many programs an SM
holds at once bounds the loads in flight, and registers bound that first here. `_decode_partials` is compiled
as the engine launches it (engine/rollout/triton_decode.py `decode_attention`): the preset's heads per group and
head dim, bf16 K/V, int64 pad/cur/source/end, int32 page table, the raw QKV projection's strides with RoPE;
pointers and integers divisible by 16 marked so (Triton's launch-time specialisation) and integers equal to 1
made constants, as a launch does. Variants: the layout (contiguous cache or pages of `--page` positions), the
prompt read from the group's first row (`sourced`, GRPO's samples) or each row's own, one key split (the
output written directly) or several, RoPE inside or not; each at every `--tiles` (key block, warps, stages and
optionally a register cap: the `maxnreg` launch option, `DecodeKernels.attention_tiles`' fourth element).

Per variant: `regs` (per thread), `spill_bytes` (the stack frame ptxas reports: registers spilled to local
memory), `shared_bytes`, and `programs_per_sm` = the fewest the SM's registers (65,536, allocated per warp in
units of 256), shared memory (`--smem-kb`) and warps (64) allow. The GPU's own figures need no GPU here, but
the Triton version matters: the GPU image's (3.6, ../shared/device/README.md) differs from this machine's.
`--occupancy`: per uncapped tile also `occupancy_ladder`, the caps `DecodeKernels.attention_occupancy` chooses
its launches' caps from (engine/rollout/occupancy.py, from these same counts), each rung's registers, spills
and programs per SM; with `--plan-widths 24,64,512` also `plans`: per decode width, the key splits
`num_splits` gives at `--sms` and `--cache-len`, and the cap the launch would take (`launch_cap`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from presets import attention_dims  # noqa: E402

from engine.rollout import triton_decode  # noqa: E402
from engine.rollout.occupancy import SmLimits, launch_cap, occupancy_ladder, programs_per_sm  # noqa: E402

POINTERS = {  # the dtypes the engine passes
    **dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "out_ptr", "cos_ptr", "sin_ptr"), "*bf16"),
    **dict.fromkeys(("pad_ptr", "cur_ptr", "end_ptr", "source_ptr"), "*i64"),
    **dict.fromkeys(("acc_ptr", "max_ptr", "sum_ptr"), "*fp32"),
    "table_ptr": "*i32",
}


def launch_ints(
    groups: int, per_group: int, dim: int, paged: bool, splits: int, direct: bool
) -> dict[str, int]:
    """The integer arguments of one launch as decode_attention passes them (cache of 4,352 positions, 64-position
    pages: 68 per row; the out strides are 0 when the splits' states are written instead)."""
    positions, pages_per_row = 4352, 68
    out = (groups * per_group * dim, per_group * dim, dim) if direct else (0, 0, 0)
    q = (groups * (per_group + 2) * dim, (per_group + 2) * dim, dim)  # the raw projection (RoPE inside)
    kb = 0 if paged else positions * groups * dim
    return dict(
        stride_cur=1,
        stride_tb=pages_per_row if paged else 0,
        stride_ob=out[0],
        stride_og=out[1],
        stride_oh=out[2],
        stride_qb=q[0],
        stride_qg=q[1],
        stride_qh=q[2],
        stride_kb=kb,
        stride_kl=groups * dim,
        stride_kg=dim,
        stride_vb=kb,
        stride_vl=groups * dim,
        stride_vg=dim,
        stride_cb=dim,
        groups=groups,
        splits=splits,
    )


def compile_variant(dims: tuple[int, int], variant: dict, tiles: tuple[int, int, int], arch: int, page: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = triton_decode._decode_partials
    per_group, dim = dims
    block_n, warps, stages, *cap = tiles
    direct = variant["splits"] == 1
    constexprs = dict(
        PER_GROUP=per_group,
        BLOCK_H=max(16, triton.next_power_of_2(per_group)),
        HEAD_DIM=dim,
        BLOCK_N=block_n,
        MIN_SPAN=4 * block_n,
        PAGE=page if variant["paged"] else 0,
        DIRECT=direct,
        SOURCED=variant["sourced"],
        ROPE=variant["rope"],
    )
    ints = launch_ints(variant["groups"], per_group, dim, variant["paged"], variant["splits"], direct)
    constexprs.update({k: 1 for k, v in ints.items() if v == 1})  # Triton specialises ints equal to 1
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name], attrs[(i,)] = POINTERS[name], [["tt.divisibility", 16]]
        elif name == "scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(
        source,
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=warps, num_stages=stages, **({"maxnreg": cap[0]} if cap else {})),
    )
    return kernel, resource_usage(kernel.asm["cubin"])


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG and STACK of a cubin, as cuobjdump (shipped with Triton) reports them."""
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if found is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no REG/STACK line:\n{text}")
    return {"regs": int(found.group(1)), "spill_bytes": int(found.group(2))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="qwen2_5_0_5b,qwen2_5_1_5b,qwen2_5_7b")
    ap.add_argument(
        "--tiles",
        default="64,4,2",
        help="key block,warps,stages[,register cap (maxnreg)]; several separated by ';'",
    )
    ap.add_argument("--layouts", default="contiguous,paged")
    ap.add_argument("--sourced", default="own,sourced", help="own and/or sourced (the group's first row)")
    ap.add_argument("--splits", default="1,4", help="key splits per (row, group): 1 writes the output itself")
    ap.add_argument(
        "--rope", default="inside,separate", help="RoPE and the K/V writes inside the kernel or not"
    )
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--smem-kb", type=int, default=228, help="shared memory per SM (H100/H200: 228)")
    ap.add_argument(
        "--occupancy",
        action="store_true",
        help="also each uncapped tile's ladder of register caps (`DecodeKernels.attention_occupancy`)",
    )
    ap.add_argument(
        "--plan-widths",
        default="",
        help="with --occupancy: decode widths (rows) to plan: each one's key splits and the cap it would take",
    )
    ap.add_argument(
        "--cache-len", type=int, default=4352, help="cache positions per row, for the plan's splits"
    )
    ap.add_argument("--sms", type=int, default=132, help="the GPU's SMs, for the plan (H100/H200 SXM: 132)")
    args = ap.parse_args()
    if args.plan_widths and not args.occupancy:
        ap.error("--plan-widths needs --occupancy (the plan reads the ladders)")
    sm = SmLimits(shared_bytes=args.smem_kb * 1024)
    import triton

    tiles = [tuple(int(x) for x in t.split(",")) for t in args.tiles.split(";")]
    rows = []
    for preset in args.presets.split(","):
        heads, groups, dim, _ = attention_dims(preset)
        grid = itertools.product(
            args.layouts.split(","),
            args.sourced.split(","),
            args.splits.split(","),
            args.rope.split(","),
            tiles,
        )
        for layout, sourced, splits, rope, tile in grid:
            variant = dict(
                groups=groups,
                paged=layout == "paged",
                sourced=sourced == "sourced",
                splits=int(splits),
                rope=rope == "inside",
            )

            @functools.cache  # (the ladder's rungs are read again below)
            def compile_with(cap, tile=tile, variant=variant, dims=(heads // groups, dim)):
                kernel, usage = compile_variant(
                    dims, variant, tile + ((cap,) if cap else ()), args.arch, args.page
                )
                return usage["regs"], usage["spill_bytes"], kernel.metadata.shared

            regs, spills, shared = compile_with(None)
            row = dict(preset=preset, layout=layout, prompt=sourced, splits=int(splits), rope=rope)
            row.update(tiles=list(tile), regs=regs, spill_bytes=spills, shared_bytes=shared)
            row.update(programs_per_sm=programs_per_sm(regs, tile[1], shared, sm))
            if args.occupancy and len(tile) == 3:
                rungs = []
                for per_sm, cap in occupancy_ladder(compile_with, tile[1], sm):
                    r, spilled, _ = compile_with(cap)
                    rungs.append(dict(cap=cap, regs=r, spill_bytes=spilled, programs_per_sm=per_sm))
                row["occupancy_ladder"] = rungs
            rows.append(row)
    report = {"triton": triton.__version__, "arch": args.arch, "kernels": rows}
    if args.plan_widths:
        report["plans"] = plan(rows, [int(w) for w in args.plan_widths.split(",")], args.cache_len, args.sms)
    print(json.dumps(report))


def plan(rows: list[dict], widths: list[int], cache_len: int, sms: int) -> list[dict]:
    """Per preset, layout, prompt read, RoPE choice and tile: each decode width's key splits (`num_splits` at
    `sms` SMs and a cache of `cache_len` positions) and the register cap `attention_occupancy` would launch it
    with (`launch_cap` on the one-split or the split variant's ladder; None: uncapped)."""
    plans = {}
    for row in rows:
        if "occupancy_ladder" in row:
            at = (row["preset"], row["layout"], row["prompt"], row["rope"], tuple(row["tiles"]))
            ladder = [(r["programs_per_sm"], r["cap"]) for r in row["occupancy_ladder"]]
            plans.setdefault(at, {})[row["splits"] == 1] = ladder
    out = []
    for (preset, layout, prompt, rope, tiles), ladders in plans.items():
        groups = attention_dims(preset)[1]
        steps = []
        for width in widths:
            splits = triton_decode.splits_for(width * groups, cache_len, tiles[0], sms)
            if (splits == 1) in ladders:
                programs = width * groups * splits
                steps.append([width, splits, launch_cap(ladders[splits == 1], programs, sms)])
        out.append(
            dict(preset=preset, layout=layout, prompt=prompt, rope=rope, tiles=list(tiles), widths=steps)
        )
    return out


if __name__ == "__main__":
    main()
