"""Does a wide decode step get faster as two half-batches on two CUDA streams? Prints one JSON object (GPU only).

    python scripts/bench/decode_overlap.py --preset qwen2_5_1_5b --cases 512x640,256x1400,128x2400

A wide decode step runs its bandwidth-bound attention and its compute-bound GEMMs one after the other
(scripts/bench/README.md, "where a generate's time goes"). Decode rows never interact, so two halves of the
batch can run the whole forward on two streams, and the GPU may run one half's attention beside the other's
GEMMs (NanoFlow's nano-batches, without its SM partitioning). Per case `W`x`C` (W rows, each attending over
~C positions: left pads of 0-31, the rest real), the native engine's decode forward (engine/rollout/model.py
`RolloutModel.decode`, random weights, bf16, the engine's default kernels, logits in bf16 as the Triton draw
takes them) timed in CUDA graphs (gpu_timing.graph_ms, median of replays, ms per step):
- `full_ms`: the W rows in one forward (the engine today);
- `halves_serial_ms`: two forwards of W/2 rows one after the other on one stream (what halving costs);
- `halves_two_streams_ms`: the same two forwards forked onto two streams and joined (what overlap gains).
`two_streams_over_full` < 1 is a gain. The halves' logits equal the serial halves' bit for bit (checked) and
the full forward's within bf16 GEMM rounding (`max_abs_diff_vs_full`).
"""

from __future__ import annotations

import argparse
import json

import torch
from gpu_timing import graph_ms  # scripts/bench/ is on sys.path
from rollout_models import model_shape, random_rollout_weights

from engine.rollout.kv_cache import KVCachePool
from engine.rollout.model import RolloutModel
from engine.rollout.rope import rope_tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2_5_1_5b")
    ap.add_argument("--cases", default="512x640,256x1400,128x2400")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    shape = model_shape(args.preset)
    weights = random_rollout_weights(shape, dev, 0)
    model = RolloutModel(shape, weights, rope_tables(shape, dev, dt))
    result = {"preset": args.preset, "device": torch.cuda.get_device_name(), "attention": model.attention}
    rows_out = []
    for case in args.cases.split(","):
        width, ctx = (int(x) for x in case.split("x"))
        rows_out.append(time_case(model, shape, width, ctx, args))
        torch.cuda.empty_cache()
    result["cases"] = rows_out
    print(json.dumps(result, indent=1))


def time_case(model: RolloutModel, shape, width: int, ctx: int, args) -> dict:
    """One `width`x`ctx` case: the full forward, the serial halves and the two-stream halves."""
    dev, dt = model.embed_w.device, model.dtype
    g = torch.Generator(device=dev).manual_seed(width)
    pool = KVCachePool(shape.num_layers, model.groups, model.head_dim, dt, dev, budget_bytes=1 << 36)
    k, v = pool.views(width, ctx + 1)
    for t in k + v:
        t.normal_(0, 1, generator=g)
    tokens = torch.randint(0, shape.vocab_size, (width,), device=dev, generator=g)
    pad = torch.randint(0, 32, (width,), device=dev, generator=g)
    cur = torch.full((width,), ctx, device=dev)
    h = width // 2
    parts = [(slice(0, h), torch.cuda.Stream()), (slice(h, width), torch.cuda.Stream())]

    def forward(rows: slice) -> torch.Tensor:
        kk, vv = [x[rows] for x in k], [x[rows] for x in v]
        return model.decode(tokens[rows], pad[rows], cur[rows], kk, vv, ctx + 1, upcast=False)

    def full():
        return forward(slice(0, width))

    def halves_serial():
        return [forward(rows) for rows, _ in parts]

    def halves_two_streams():
        main_stream, out = torch.cuda.current_stream(), []
        for rows, stream in parts:
            stream.wait_stream(main_stream)
            with torch.cuda.stream(stream):
                out.append(forward(rows))
        for _, stream in parts:
            main_stream.wait_stream(stream)
        return out

    ref, serial, overlapped = full(), halves_serial(), halves_two_streams()
    torch.cuda.synchronize()
    row = {"width": width, "context": ctx}
    row["halves_equal_bitwise"] = all(torch.equal(a, b) for a, b in zip(serial, overlapped))
    row["max_abs_diff_vs_full"] = float((torch.cat(overlapped).float() - ref.float()).abs().max())
    for name, fn in (
        ("full", full),
        ("halves_serial", halves_serial),
        ("halves_two_streams", halves_two_streams),
    ):
        row[name + "_ms"] = round(graph_ms(fn, args.iters, args.reps), 4)
    row["two_streams_over_full"] = round(row["halves_two_streams_ms"] / row["full_ms"], 4)
    row["serial_over_full"] = round(row["halves_serial_ms"] / row["full_ms"], 4)
    return row


if __name__ == "__main__":
    main()
