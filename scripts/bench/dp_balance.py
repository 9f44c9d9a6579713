"""How long a GRPO step's update waits on its slowest DP replica, with the prompt groups as rolled out (each
replica trains the groups it generated) and re-dealt by tokens (`trainer.balance_batch`,
engine/step/balance.py), computed over many seeds of a workload's lengths (scripts/bench/workload.py: a
prompt's n responses share one length). No model runs: the figure is `slowest_over_mean`, the sum over
mini-batches of the most tokens one replica holds over the replicas' mean, the update's time relative to an
even split where time follows tokens. Prints one JSON object: per DP size and mini-batch count, the medians
and the worst of both layouts.

    python scripts/bench/dp_balance.py --lengths long_tail --response-len 4096 --dp 2 4 8 --mini-batches 1 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from workload import add_step_args, response_lengths  # noqa: E402

from engine.step.balance import balanced_slices, imbalance_metrics, rolled_out_slices  # noqa: E402


def layouts(tokens: list[int], dp: int, minis: int) -> tuple[float, float]:
    """(rolled out, re-dealt) `slowest_over_mean` of groups of `tokens` over `dp` replicas."""
    slices = balanced_slices(tokens, dp, minis)
    metrics = imbalance_metrics(tokens, rolled_out_slices(len(tokens), dp, minis), slices, minis)
    return metrics["perf/dp_imbalance_rolled_out"], metrics["perf/dp_imbalance"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_args(ap)
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--mini-batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--seeds", type=int, default=50, help="workloads drawn (seeds seed .. seed + seeds - 1)")
    args = ap.parse_args()
    rows = []
    for dp in args.dp:
        for minis in args.mini_batches:
            if args.prompts % (dp * minis):
                continue
            pairs = []
            for seed in range(args.seed, args.seed + args.seeds):
                lengths = response_lengths(args.lengths, args.prompts, args.response_len, seed=seed)
                pairs.append(layouts([args.n * (args.prompt_len + length) for length in lengths], dp, minis))
            rolled, dealt = zip(*pairs)
            rows.append(
                {
                    "dp": dp,
                    "mini_batches": minis,
                    "rolled_out_median": round(statistics.median(rolled), 4),
                    "rolled_out_worst": round(max(rolled), 4),
                    "balanced_median": round(statistics.median(dealt), 4),
                    "balanced_worst": round(max(dealt), 4),
                    "update_time_ratio_median": round(statistics.median(d / r for r, d in pairs), 4),
                }
            )
    print(json.dumps({"workload": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
