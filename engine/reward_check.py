"""Check a reward function on real rows before spending compute on training.

    python -m engine.reward_check data.train_files=[train.parquet] [reward.fn=my_reward.py:score]
        [reward_check.responses=["#### 42","I don't know"]] [reward_check.num_rows=5]
        [model.tokenizer_path=DIR | model.path=DIR] [data.max_prompt_len=512] [data.bad_rows=error]

For each of the first rows it scores the "oracle" response (the ground truth written the way the
built-in rule expects: "#### 42" for gsm8k, "\\boxed{x}" for math, the digits for the embedded tasks; the
raw ground truth for other data sources) and every given response, and prints a table. With a tokenizer
it also shows each prompt's length after the chat template. Exit status 1 if any score failed.
Arguments are `key=value` (OmegaConf dotlist), independent of the trainer's Hydra config.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from omegaconf import OmegaConf

DEFAULTS = {
    "reward": {"fn": "", "gsm8k_method": "strict"},
    "data": {"train_files": [], "max_prompt_len": 512, "bad_rows": "error"},
    "model": {"path": "", "tokenizer_path": ""},
    "reward_check": {"responses": [], "num_rows": 5},
}


def _flat_keys(tree: dict, prefix: str = "") -> list[str]:
    return [
        k
        for key, v in tree.items()
        for k in (_flat_keys(v, f"{prefix}{key}.") if isinstance(v, dict) else [prefix + key])
    ]


def parse_args(argv: Sequence[str]) -> dict:
    """`key=value` overrides on DEFAULTS; an unknown key raises ValueError listing the known ones."""
    overrides = [arg.lstrip("+") for arg in argv]
    known = _flat_keys(DEFAULTS)
    for arg in overrides:
        key = arg.split("=", 1)[0]
        if "=" not in arg or key not in known:
            raise ValueError(f"reward_check: bad argument {arg!r}; expected key=value with key in {known}")
    cfg = OmegaConf.to_container(
        OmegaConf.merge(OmegaConf.create(DEFAULTS), OmegaConf.from_dotlist(overrides))
    )
    for section, key in (("data", "train_files"), ("reward_check", "responses")):
        value = cfg[section][key]
        cfg[section][key] = [str(v) for v in (value if isinstance(value, list) else [value])]
    return cfg


def _snippet(text: str, width: int = 48) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 3] + "..."


def _print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    for line in (header, ["-" * w for w in widths], *rows):
        print("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip())


def run(cfg: dict) -> int:
    from engine.data import chat_prompt_ids, load_tokenizer, read_prompt_rows
    from engine.rewards import build_reward_fn, find_rule

    rows, counts = read_prompt_rows(cfg["data"]["train_files"], cfg["data"]["bad_rows"])
    rows = rows[: cfg["reward_check"]["num_rows"]]
    reward_fn = build_reward_fn(cfg["reward"]["fn"], cfg["reward"]["gsm8k_method"])
    print(f"reward: {reward_fn.name}; {counts['rows']} rows read, {counts['bad']} bad rows skipped")

    tokenizer_path = cfg["model"]["tokenizer_path"] or cfg["model"]["path"]
    if tokenizer_path:
        key = "model.tokenizer_path" if cfg["model"]["tokenizer_path"] else "model.path"
        prompt_ids = chat_prompt_ids(load_tokenizer(tokenizer_path, key), [row.messages for row in rows])
    max_len = cfg["data"]["max_prompt_len"]
    for i, row in enumerate(rows):
        length = ""
        if tokenizer_path:
            too_long = len(prompt_ids[i]) > max_len
            length = f" ({len(prompt_ids[i])} tokens{'; longer than data.max_prompt_len, dropped' if too_long else ''})"
        print(f"row {row.index}: {_snippet(row.messages[-1]['content'], 100)}{length}")

    failed, table = False, []
    for row in rows:
        rule = find_rule(row.data_source)
        oracle = rule.oracle(row.ground_truth) if rule else row.ground_truth
        for label, response in [
            ("oracle", oracle),
            *(("given", r) for r in cfg["reward_check"]["responses"]),
        ]:
            try:
                score = f"{reward_fn([row.data_source], [response], [row.ground_truth], [row.extra_info]).item():.4f}"
            except Exception as exc:
                failed, score = True, f"ERROR {type(exc).__name__}: {exc}"
            table.append([str(row.index), row.data_source, label, _snippet(response), score])
    print()
    _print_table(["row", "data_source", "kind", "response", "score"], table)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__)
        return 0
    try:
        cfg = parse_args(argv)
        if not cfg["data"]["train_files"]:
            raise ValueError(
                "reward_check: data.train_files is empty; e.g. data.train_files=[/data/train.parquet]"
            )
        return run(cfg)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
