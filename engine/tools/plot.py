"""A picture of a run: `python -m engine.plot OUTPUT_DIR [--out FILE]` writes `OUTPUT_DIR/metrics.png` from
`OUTPUT_DIR/metrics.jsonl`.

Four panels over steps: training reward (mean, with min/max as a band) and every validation reward
(`val/...reward...` keys, and `val/<data_source>/mean@k`, `best@k`, `maj@k`); response length (mean, max); `actor/entropy` and, on a second scale, the KLs
(`actor/kl_loss`, `actor/rollout_kl`, `actor/reward_kl_penalty`, `actor/ppo_kl`, whichever the run logged); and the step's time stacked by phase
(`timing/<phase>`, without the totals `timing/step` and `timing/testing`). A step logged twice (a resumed run
repeats nothing, but an interrupted line may be followed by its rerun) keeps its last record.

Needs matplotlib (`pip install matplotlib`); the trainer calls `write_plot` at the end of a run when
`trainer.plot=true` and says in one line when matplotlib is missing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

_TOTALS = ("timing/step", "timing/testing")
_KL_KEYS = ("actor/kl_loss", "actor/rollout_kl", "actor/reward_kl_penalty", "actor/ppo_kl")


def read_metrics(path: str) -> list[dict]:
    """The records of metrics.jsonl, one per step (the last line of a step wins), sorted by step."""
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill: the rest of the file is still good
                print(f"plot: skipping line {number} of {path} (not JSON)", file=sys.stderr)
                continue
            if isinstance(record.get("step"), int):
                by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in records:
        value = r.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            steps.append(r["step"])
            values.append(float(value))
    return steps, values


def _line(ax, records: list[dict], key: str, **style) -> None:
    steps, values = _series(records, key)
    if steps:  # keys the run did not log get no line and no legend entry
        ax.plot(steps, values, label=key, **style)


_AT_K = re.compile(r"/(mean|best|maj)@\d+$")  # rollout.val_n = k > 1: val/<data_source>/mean@k, ...


def _val_keys(records: list[dict]) -> list[str]:
    keys = {
        k
        for r in records
        for k in r
        if k.startswith("val/") and ("reward" in k or _AT_K.search(k)) and not k.endswith("_std")
    }
    return sorted(keys)


def _phase_keys(records: list[dict]) -> list[str]:
    keys = {k for r in records for k in r if k.startswith("timing/") and k not in _TOTALS}
    return sorted(keys, key=lambda k: -sum(r.get(k, 0.0) for r in records))


def write_plot(output_dir: str, out_file: str = "") -> str:
    """Draw `output_dir/metrics.jsonl` into `out_file` (default `output_dir/metrics.png`); returns its path.
    Raises FileNotFoundError without metrics.jsonl, ValueError when it holds no step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: give the run's trainer.output_dir")
    records = read_metrics(path)
    if not records:
        raise ValueError(f"{path} holds no step to plot")
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    ax = axes[0][0]
    steps, mean = _series(records, "reward/mean")
    ax.plot(steps, mean, label="train reward/mean")
    lo, hi = _series(records, "reward/min")[1], _series(records, "reward/max")[1]
    if len(lo) == len(hi) == len(steps):
        ax.fill_between(steps, lo, hi, alpha=0.15, label="train min..max")
    for key in _val_keys(records):
        _line(ax, records, key, marker="o")
    ax.set_title("reward")
    ax = axes[0][1]
    for key in ("response_length/mean", "response_length/max"):
        _line(ax, records, key)
    ax.set_title("response length (tokens)")
    ax = axes[1][0]
    _line(ax, records, "actor/entropy", color="black")
    kl_ax = ax.twinx()  # KLs are orders of magnitude below the entropy: their own scale, on the right
    for i, key in enumerate(_KL_KEYS):
        _line(kl_ax, records, key, color=f"C{i}")
    kl_ax.set_ylabel("KL")
    handles = [h for a in (ax, kl_ax) for h in a.get_legend_handles_labels()[0]]
    if handles:
        ax.legend(handles=handles, fontsize="small")
    ax.set_title("entropy (left) and KL (right)")
    ax = axes[1][1]
    phases = _phase_keys(records)
    steps = [r["step"] for r in records]
    ax.stackplot(
        steps,
        [[float(r.get(k, 0.0)) for r in records] for k in phases],
        labels=[k.removeprefix("timing/") for k in phases],
    )
    ax.set_title("seconds per step by phase")
    for ax in (a for row in axes for a in row):
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0] and ax.get_legend() is None:
            ax.legend(fontsize="small")
    fig.suptitle(os.path.abspath(output_dir), fontsize="small")
    out_file = out_file or os.path.join(output_dir, "metrics.png")
    fig.savefig(out_file, dpi=100)
    plt.close(fig)
    return out_file


def plot_at_end(output_dir: str) -> str:
    """What the trainer prints after its last step: the PNG written, or why there is none."""
    try:
        return f"plot: {write_plot(output_dir)}"
    except ImportError:
        return "plot: skipped, matplotlib is not installed (pip install matplotlib, or trainer.plot=false)"
    except (FileNotFoundError, ValueError) as exc:
        return f"plot: skipped, {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", help="a run's trainer.output_dir (holding metrics.jsonl)")
    parser.add_argument("--out", default="", help="PNG to write (default OUTPUT_DIR/metrics.png)")
    args = parser.parse_args(argv)
    try:
        print(write_plot(args.output_dir, args.out))
    except ImportError:
        print("engine.plot needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as exc:
        print(f"engine.plot: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
