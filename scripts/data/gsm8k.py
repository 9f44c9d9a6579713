"""Prepare GSM8K as verl does (`examples/data_preprocess/gsm8k.py`): `<out>/train.parquet` and `<out>/test.parquet`.

    python scripts/data/gsm8k.py --out ~/data/gsm8k                   # from the hub (needs `datasets`)
    python scripts/data/gsm8k.py --source DIR --out ~/data/gsm8k      # DIR: a local copy of openai/gsm8k

Each row: data_source "openai/gsm8k", one user message (the question + verl's instruction), ability "math",
reward_model {style "rule", ground_truth: the number after `####` without commas}, extra_info {split, index,
answer, question}. Then: `python -m engine.train task=gsm8k model.path=DIR`.
"""

from __future__ import annotations

import argparse
import re

from rlhf_parquet import prepare

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def ground_truth(answer: str) -> str:
    """The final number of a GSM8K reference answer (`... #### 1,234` -> "1234")."""
    found = re.search("#### (\\-?[0-9\\.\\,]+)", answer)
    if found is None:
        raise ValueError(f"GSM8K answer without '#### <number>': {answer[-80:]!r}")
    return found.group(1).replace(",", "")


def make_row(example: dict, split: str, index: int) -> dict:
    question, answer = example["question"], example["answer"]
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--source", default="", help="local copy of the hub's openai/gsm8k repository")
    parser.add_argument("--out", default="~/data/gsm8k", help="output directory (verl's --local_save_dir)")
    args = parser.parse_args(argv)
    prepare(args.source, args.out, DATA_SOURCE, "main", "main", make_row)


if __name__ == "__main__":
    main()
