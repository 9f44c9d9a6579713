"""What the GPU did in each phase of a profiled training step: a trace of `trainer.profile_steps`
(engine/step_profiler.py; `e2e.py --gpu-busy` prints its directory as `profile_dir`) summarised per phase.

    python scripts/bench/trace_phases.py OUTPUT_DIR/profile/step_7_rank0.json [--top 12]

Prints one JSON object, per phase (the trace's `phase/<name>` annotations; `step` spans them all, a phase that
ran twice counts both): wall ms; the GPU's busy ms and share (the union of kernels, copies and memsets:
`perf/gpu_busy/<phase>`); the idle ms between them by the gap's length (under 10 us: launch spacing, as
inside a CUDA graph; 10 to 100 us; 100 us and over: the GPU waiting on the host, e.g. a synchronising read or
Python between launches) with the count of long gaps; device ms by kernel kind (`profiling.KERNEL_KINDS`;
summed per kernel, so overlapping streams count twice here); and the top kernels by device ms. A kernel
belongs to the phase it starts in.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from profiling import KERNEL_KINDS  # noqa: E402

from engine.step_profiler import DEVICE_WORK, device_work, phase_windows, work_inside  # noqa: E402

GAP_BUCKETS_US = (
    (0.0, 10.0, "under_10us"),
    (10.0, 100.0, "10_to_100us"),
    (100.0, float("inf"), "100us_and_over"),
)


def kind_of(name: str) -> str:
    return next((k for k, pattern in KERNEL_KINDS if re.search(pattern, name)), "other")


def summarise(events: list[dict], top: int = 12) -> dict:
    """The per-phase summary (module docstring) of a Chrome trace's `traceEvents`."""
    starts, ends = device_work(events)
    work = sorted(
        (e["ts"], e["dur"], e.get("name", "")) for e in events if e.get("cat") in DEVICE_WORK and "dur" in e
    )
    first = [w[0] for w in work]
    out = {}
    for phase, windows in phase_windows(events).items():
        wall = sum(b - a for a, b in windows)
        busy = 0.0
        gaps = {name: 0.0 for _, _, name in GAP_BUCKETS_US}
        long_gaps = 0
        by_name: dict[str, list[float]] = {}
        for a, b in windows:
            inside = work_inside(starts, ends, a, b)
            busy += sum(e - s for s, e in inside)
            edges = [a] + [x for s, e in inside for x in (s, e)] + [b]
            for idle in (edges[k + 1] - edges[k] for k in range(0, len(edges), 2)):
                if idle <= 0:
                    continue
                low, high, name = next(bucket for bucket in GAP_BUCKETS_US if bucket[0] <= idle < bucket[1])
                gaps[name] += idle / 1e3
                long_gaps += int(low >= 100.0)
            lo, hi = bisect.bisect_left(first, a), bisect.bisect_left(first, b)
            for _, dur, name in work[lo:hi]:
                entry = by_name.setdefault(name, [0.0, 0])
                entry[0] += dur / 1e3
                entry[1] += 1
        kinds: dict[str, float] = {}
        for name, (ms, _) in by_name.items():
            kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + ms
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        out[phase] = {
            "wall_ms": round(wall / 1e3, 3),
            "busy_ms": round(busy / 1e3, 3),
            "busy_fraction": round(busy / wall, 4) if wall > 0 else None,
            "idle_ms": {k: round(v, 3) for k, v in gaps.items()},
            "gaps_100us_and_over": long_gaps,
            "kernel_ms_by_kind": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top_kernels": [
                {"name": name[:160], "ms": round(ms, 3), "calls": calls} for name, (ms, calls) in ranked
            ],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a trainer.profile_steps trace: OUTPUT_DIR/profile/step_N_rankR.json")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per phase")
    args = ap.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    print(json.dumps({"trace": args.trace, "phases": summarise(events, args.top)}))


if __name__ == "__main__":
    main()
