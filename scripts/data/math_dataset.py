"""Prepare MATH as verl does (`examples/data_preprocess/math_dataset.py`, whose name this file keeps: a
`math.py` here would shadow the standard library's `math`): `<out>/train.parquet`, `<out>/test.parquet`.

    python scripts/data/math_dataset.py --out ~/data/math                    # from the hub (needs `datasets`)
    python scripts/data/math_dataset.py --source DIR --out ~/data/math       # DIR: a local copy of MATH-lighteval

Each row: data_source "DigitalLearningGmbH/MATH-lighteval" (the hub mirror verl reads), one user message (the
problem + verl's instruction), ability "math", reward_model {style "rule", ground_truth: the content of the
solution's last `\\boxed{}`}, extra_info {split, index}. Then: `python -m engine.train task=math model.path=DIR`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rlhf_parquet import prepare  # noqa: E402

from engine.rewards.boxed_math import last_boxed  # noqa: E402

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def make_row(example: dict, split: str, index: int) -> dict:
    answer = last_boxed(example["solution"])
    if answer is None:
        raise ValueError(f"MATH {split} row {index}: solution without a \\boxed{{}} answer")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": example["problem"] + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--source", default="", help="local copy of the hub's DigitalLearningGmbH/MATH-lighteval"
    )
    parser.add_argument("--out", default="~/data/math", help="output directory (verl's --local_save_dir)")
    args = parser.parse_args(argv)
    prepare(args.source, args.out, DATA_SOURCE, None, "data", make_row)


if __name__ == "__main__":
    main()
