"""Where a benchmark makes the host wait for the GPU: run a script (e.g. update.py) under
`torch.cuda.set_sync_debug_mode("warn")` and count every synchronizing call by its call site, the
project's own frames only. A sync inside the micro-batch loop drains the GPU's queue, so the next
micro-batch's first kernels wait for the host to launch them: small micro-batches become launch-bound.

    python scripts/bench/sync_sites.py [--top N] [--out FILE] -- scripts/bench/update.py ARGS...

Prints one JSON object (the script's own stdout comes first): `sites`, each with its count, the warning's
text and the stack (file:line function, innermost last), most frequent first.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import runpy
import sys
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def own_frame(f: traceback.FrameSummary) -> bool:
    """A frame of this repository's code (this script's own excepted)."""
    path = os.path.abspath(f.filename)
    return path.startswith(ROOT + os.sep) and not path.endswith("sync_sites.py")


def label(f: traceback.FrameSummary) -> str:
    """file:line function, the file relative to the repository where it lies inside."""
    path = os.path.abspath(f.filename)
    name = os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else f.filename
    return f"{name}:{f.lineno} {f.name}"


class SiteCounter:
    """A `warnings.showwarning` replacement counting sync warnings by project call stack."""

    def __init__(self, depth: int):
        self.depth = depth
        self.counts: collections.Counter = collections.Counter()
        self.texts: dict[tuple[str, ...], str] = {}

    def __call__(self, message, category, filename, lineno, file=None, line=None) -> None:
        text = str(message)
        if "synchroniz" not in text:
            sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
            return
        frames = [  # without the warnings machinery and runpy
            f
            for f in traceback.extract_stack()[:-1]
            if not f.filename.startswith("<frozen") and os.path.basename(f.filename) != "warnings.py"
        ]
        stack = tuple(label(f) for f in frames if own_frame(f))[-self.depth :]
        if not own_frame(frames[-1]):  # the op's caller, in whatever library it lies
            stack = (*stack, label(frames[-1]))
        self.counts[stack] += 1
        self.texts.setdefault(stack, text.splitlines()[0][:200])

    def report(self, top: int) -> dict:
        return {
            "total_syncs": sum(self.counts.values()),
            "sites": [
                {"count": n, "warning": self.texts[stack], "stack": list(stack)}
                for stack, n in self.counts.most_common(top)
            ],
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=20, help="sites to report")
    ap.add_argument("--depth", type=int, default=6, help="project frames kept per site")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    args = ap.parse_args()
    argv = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not argv:
        ap.error("give the script to run after --")
    import torch

    counter = SiteCounter(args.depth)
    warnings.showwarning = counter
    warnings.simplefilter("always")
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("warn")
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
        report = counter.report(args.top)
        print(json.dumps(report, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
