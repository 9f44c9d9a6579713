"""Check a reward function on real rows before spending compute on training.

    python -m engine.reward_check data.train_files=[train.parquet] [reward.fn=my_reward.py:score]
        [reward_check.responses=["#### 42","I don't know"]] [reward_check.num_rows=5]
        [model.tokenizer_path=DIR | model.path=DIR] [data.max_prompt_len=512] [data.bad_rows=error]

For each of the first rows it scores the "oracle" response (the ground truth written the way the
built-in rule expects: "#### 42" for gsm8k, "\\boxed{x}" for boxed math, "Answer: x" for math_dapo, the digits
for the embedded tasks; the raw ground truth for other data sources) and every given response, and prints a
table. With a tokenizer it also shows each prompt's length after the chat template. Exit status 1 if any score
failed.
Arguments are `key=value` (OmegaConf dotlist), independent of the trainer's Hydra config.

A dry run that generates (as verl users do with a quick eval), with `reward_check.num_samples=K > 0`:

    python -m engine.reward_check reward_check.num_samples=5 task=gsm8k model.path=DIR
        [reward_check.sample_prompt="..." reward_check.data_source=openai/gsm8k reward_check.ground_truth=72]

Every other argument is then a training override (groups like `task=`, `model=` included): the configured
model (model.path or its random init) generates K responses per prompt with the configured rollout engine
and sampling (`rollout.*`), for `reward_check.sample_prompt` or the first `reward_check.num_rows` rows of
data.train_files (or the embedded task), and each response is printed with its score and the reward
function's extra keys. With `rollout.multi_turn.enable=true` each response is a whole episode: every turn in
order (the assistant's text, the tool calls parsed from it, each tool's result), then the episode's score.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from omegaconf import OmegaConf

DEFAULTS = {
    "reward": {"fn": "", "gsm8k_method": "strict"},
    "data": {"train_files": [], "max_prompt_len": 512, "bad_rows": "error"},
    "model": {"path": "", "tokenizer_path": ""},
    "reward_check": {"responses": [], "num_rows": 5},
}
GENERATE_DEFAULTS = {
    "num_samples": 0,
    "num_rows": 5,
    "sample_prompt": "",
    "data_source": "",
    "ground_truth": "",
}
"""`reward_check.*` keys of the generating dry run (num_samples > 0)."""


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
    from engine.rewards.build import build_reward_fn
    from engine.rewards.registry import find_rule

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


def _split_generate_args(argv: Sequence[str]) -> tuple[dict, list[str]] | None:
    """(reward_check generate settings, training overrides) when the arguments ask for a generating dry run
    (`reward_check.num_samples` > 0), else None."""
    settings, rest = dict(GENERATE_DEFAULTS), []
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        name = key.removeprefix("reward_check.")
        if key.startswith("reward_check.") and name in GENERATE_DEFAULTS and sep:
            settings[name] = int(value) if name in ("num_samples", "num_rows") else value.strip('"')
        else:
            rest.append(arg)
    return (settings, rest) if settings["num_samples"] > 0 else None


def _train_config(overrides: list[str]):
    """The training config composed as `python -m engine.train OVERRIDES` composes it."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from engine.config import register_configs
    from engine.config_load import to_dataclass

    register_configs()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    conf_dir = os.path.join(root, "conf")
    try:
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
            return to_dataclass(compose("train", overrides=overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        raise ValueError(f"reward_check: {exc}") from None


def _as_colocated(cfg):
    """The reward check generates on its own ranks: a split-placement config runs colocated (the same rollout
    and reward; placement only decides which ranks would generate in training)."""
    from dataclasses import replace

    if cfg.placement.mode != "split":
        return cfg
    print("reward_check: placement.mode=split is checked colocated on this launch's ranks", flush=True)
    placement = replace(cfg.placement, mode="colocated", rollout_ranks=0, critic_ranks=0)
    return replace(cfg, placement=placement, trainer=replace(cfg.trainer, off_policy_steps=0))


def generate_and_score(settings: dict, overrides: list[str]) -> int:
    """Build the configured actor and rollout engine, generate `num_samples` responses per prompt, score them."""
    import tempfile
    from dataclasses import replace

    from engine.data import (
        PromptRecord,
        chat_prompt_ids,
        load_prompt_dataset,
        load_tokenizer,
        refuse_row_caps,
    )
    from engine.rewards.build import build_reward_fn
    from engine.setup import (
        _data_files,
        build_episode_tools,
        build_episodes,
        build_policy_chunks,
        build_weight_sync_and_rollout,
        model_shape,
    )
    from engine.step.reward import decode_responses
    from engine.step.rollout import checkpoint_stop_ids, rollout_params, rollout_replica
    from engine.validate import validate
    from parallel.state import destroy_distributed, init_distributed, world_size_from_env

    cfg = _as_colocated(_train_config(overrides))
    dims = validate(cfg, world_size_from_env())
    groups = init_distributed(dims, cfg.cluster.device, cfg.cluster.timeout_s, cfg.trainer.seed)
    try:
        with tempfile.TemporaryDirectory(prefix="reward_check-") as scratch:
            tok_dir, train_files, _ = _data_files(cfg, scratch)
            tokenizer = load_tokenizer(
                tok_dir, key="model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
            )
            tools = build_episode_tools(cfg)
            schemas = [tool.schema for tool in tools.values()] if tools else None
            if settings["sample_prompt"]:
                conversation = [{"role": "user", "content": settings["sample_prompt"]}]
                ids = chat_prompt_ids(tokenizer, [conversation], schemas)[0]
                records = [PromptRecord(ids, settings["data_source"], settings["ground_truth"], {}, 0)]
            else:
                records = load_prompt_dataset(
                    train_files,
                    tokenizer,
                    cfg.data.max_prompt_len,
                    cfg.data.bad_rows,
                    tool_schemas={t.name: t.schema for t in tools.values()} if tools else None,
                    max_new_tokens=cfg.rollout.max_new_tokens,  # a row's cap may not exceed it, as in training
                )[0]
                records = records[: settings["num_rows"]]
                if cfg.rollout.multi_turn.enable:
                    refuse_row_caps(records, "data.train_files")
            shape = model_shape(cfg.model, len(tokenizer), dims.tp)
            chunks = build_policy_chunks(cfg, shape, groups)
            sync, engine = build_weight_sync_and_rollout(cfg, chunks, shape, groups, tokenizer.pad_token_id)
            weights = sync.to_rollout()
            engine.set_weights(weights)
            r, k = cfg.rollout, settings["num_samples"]
            # the training rollout's sampling (rollout.*, each row capped at its max_new_tokens), K per prompt
            stop_ids = checkpoint_stop_ids(cfg, tokenizer)
            trained = rollout_params(cfg, stop_ids, cfg.trainer.seed, records)["sample"]
            sampling = replace(trained, n=k, log_probs=False, routed_experts=False)
            episodes = build_episodes(cfg, tools, tokenizer, shape, records)
            tool_names = [rec.tools for rec in records] if episodes is not None else None
            prompts = [rec.prompt_ids for rec in records]
            out = rollout_replica(engine, weights, prompts, sampling, episodes, tool_names)
            texts = decode_responses(tokenizer, out.response_ids, out.response_mask)
            rows = [records[i // k] for i in range(len(texts))]
            infos = [x.extra_info for x in rows]
            if out.episodes is not None:  # as the trainer scores episodes (engine/step/reward.py)
                infos = [{**info, "turns": e.turns} for info, e in zip(infos, out.episodes)]
            reward_fn = build_reward_fn(cfg.reward.fn, cfg.reward.gsm8k_method)
            result = reward_fn.score(
                [x.data_source for x in rows], texts, [x.ground_truth for x in rows], infos
            )
            if groups.is_logging_rank:
                print(
                    f"reward: {reward_fn.name}; {len(records)} prompt(s) x {k} samples, rollout.backend={r.backend}"
                )
                for i, text in enumerate(texts):
                    if i % k == 0:
                        prompt = tokenizer.decode(records[i // k].prompt_ids, skip_special_tokens=True)
                        print(
                            f"\n=== prompt {i // k} (data_source={rows[i].data_source!r}): {_snippet(prompt, 200)}"
                        )
                    extras = "".join(  # NaN: this response's output lacked the key
                        f"  {key}={float(v[i]):.4g}" for key, v in result.extras.items() if not v[i].isnan()
                    )
                    print(f"\n[prompt {i // k}, sample {i % k}] score={float(result.scores[i]):.4f}{extras}")
                    print(text if out.episodes is None else _episode_text(out.episodes[i]))
    finally:
        destroy_distributed()
    return 0


def _episode_text(episode) -> str:
    """A multi-turn episode turn by turn: each assistant turn, the calls parsed from it, each tool's result."""
    lines = [
        f"episode: {episode.num_assistant_turns} assistant turn(s), {episode.num_tool_calls} tool call(s), "
        f"{episode.num_tool_errors} failed"
    ]
    for turn in episode.turns:
        lines.append(f"  [{turn['role']}] {_snippet(turn['content'], 400)}")
        for call in turn.get("tool_calls", []):
            error = f" (malformed: {call['error']})" if call.get("error") else ""
            lines.append(f"    -> call {call['name'] or '?'}({json.dumps(call['arguments'])}){error}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__)
        return 0
    try:
        generate = _split_generate_args(argv)
        if generate is not None:
            return generate_and_score(*generate)
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
