"""Config composition: the presets, unknown keys, the command line, ignored-key warnings, data files, reward
functions, checkpoint files and registered estimators (no processes, no models). Bad values per area:
test_config_bad_values.py, test_config_parallel.py, test_config_rollout.py."""

from __future__ import annotations

import os
import subprocess
import sys

import hf_tiny
import pytest
from config_compose import CONF, composed

from engine.config import ConfigError
from engine.validate import validate
from engine.validate.ignored import ignored_key_warnings


def test_default_config_is_valid():
    cfg = composed()
    dims = validate(cfg, world_size=1)
    assert (dims.tp, dims.pp, dims.dp) == (1, 1, 1)
    assert cfg.algorithm.name == "grpo" and cfg.model.name == "tiny" and cfg.cluster.name == "cpu"


@pytest.mark.parametrize(
    "algorithm", sorted(name[:-5] for name in os.listdir(os.path.join(CONF, "algorithm")))
)
def test_presets_compose_and_validate(algorithm):
    """Every conf/algorithm preset validates with the default job as is (no other override), except DAPO's:
    its overlong buffer (the last 20% of rollout.max_new_tokens=5) would penalize every complete 5-token answer
    of the embedded task, which the message says, with the fix, which validates."""
    if algorithm == "dapo":
        with pytest.raises(ConfigError, match="every complete answer would be penalized"):
            validate(composed("algorithm=dapo"), world_size=1)
        validate(composed("algorithm=dapo", "rollout.max_new_tokens=6"), world_size=1)
        return
    validate(composed(f"algorithm={algorithm}"), world_size=1)


@pytest.mark.parametrize("preset", ["tiny_moe", "qwen3_30b_a3b", "qwen1_5_moe_a2_7b"])
def test_moe_presets_compose_validate_and_resolve(preset):
    """The MoE presets validate at a layout that splits their experts, and resolve to the router that
    their Hugging Face family uses (softmax, renormalised over the top-k for Qwen3-MoE, not for Qwen2-MoE)."""
    from engine.models.builder import resolve_shape

    cfg = composed(f"model={preset}", "data.max_prompt_len=32")
    assert validate(cfg, world_size=2).dp == 2
    assert (
        validate(composed(f"model={preset}", "data.max_prompt_len=32", "parallel.ep=2"), world_size=2).ep == 2
    )
    moe = resolve_shape(cfg.model, 100, 1).moe
    assert moe.num_experts == cfg.model.moe.num_experts > moe.top_k
    assert moe.norm_topk_prob == (preset != "qwen1_5_moe_a2_7b")
    assert (moe.shared_ffn_hidden_size > 0) == moe.shared_gate == (preset == "qwen1_5_moe_a2_7b")
    assert resolve_shape(composed().model, 100, 1).moe is None  # the default model stays dense


def test_unknown_key_fails_at_compose():
    with pytest.raises(Exception, match="trainer.totl_steps|totl_steps"):
        composed("trainer.totl_steps=3")


@pytest.mark.parametrize(
    "override,hint",
    [
        ("+trainer.totl_steps=3", "did you mean trainer.total_steps=3?"),
        ("+rollout.max_tokens=16", "did you mean rollout.max_new_tokens=16?"),
        ("+foo=1", "foo=1: not a key"),
    ],
)
def test_appended_unknown_key_is_refused_with_the_closest_key(override, hint):
    """Hydra's `+key=value` (its own fix for an unknown key) appends to the composed config; the schema is
    closed, so the key is refused instead of silently ignored."""
    with pytest.raises(ConfigError, match="not a key of the configuration") as err:
        composed(override)
    assert hint in str(err.value)


def test_reward_fn_is_imported_during_validation():
    stall_reward = os.path.join(os.path.dirname(__file__), "stall_reward.py")
    validate(composed(f"reward.fn={stall_reward}:score"), world_size=1)
    validate(composed("reward.fn=engine.rewards.registry:rule_reward"), world_size=1)


def test_cli_prints_composed_config():
    out = subprocess.run(
        [sys.executable, "-m", "engine.train", "--cfg", "job", "algorithm=rloo", "rollout.n=4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "adv_estimator: rloo" in out.stdout and "'n': 4" in out.stdout


def test_cli_rejects_bad_config_before_distributed_start():
    out = subprocess.run(
        [sys.executable, "-m", "engine.train", "rollout.n=1"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert "rollout.n=1" in out.stderr


@pytest.mark.parametrize(
    "preset", ["grpo", "dr_grpo", "dapo", "gspo", "ppo", "reinforce_pp", "remax", "rloo"]
)
def test_presets_set_no_ignored_keys(preset):
    assert ignored_key_warnings(composed(f"algorithm={preset}")) == []


def test_keys_a_combination_ignores_get_one_warning_each():
    """A key counts as set when it differs from the schema default; one line per ignored key, naming it, its
    value and why."""
    cfg = composed(
        "algorithm=rloo",
        "critic.lr=1e-5",
        "critic.path=/ckpt",
        "algorithm.norm_adv_by_std=false",
        "algorithm.lam=0.9",
    )
    lines = ignored_key_warnings(cfg)
    assert lines == [
        "warning: critic.path='/ckpt' is ignored: only algorithm.adv_estimator=gae (PPO) has a critic",
        "warning: critic.lr=1e-05 is ignored: only algorithm.adv_estimator=gae (PPO) has a critic",
        "warning: algorithm.lam=0.9 is ignored: GAE's lambda: only algorithm.adv_estimator=gae reads it",
        "warning: algorithm.norm_adv_by_std=False is ignored: only algorithm.adv_estimator=grpo divides by the "
        "group std",
    ]
    # the same keys where the combination reads them: no warning
    assert ignored_key_warnings(composed("algorithm=ppo", "critic.lr=1e-5", "algorithm.lam=0.9")) == []
    assert ignored_key_warnings(composed("algorithm=grpo", "algorithm.norm_adv_by_std=false")) == []
    split = composed("placement.mode=split", "placement.rollout_ranks=1", "rollout.weight_sync=naive")
    assert ignored_key_warnings(split) == [
        "warning: rollout.weight_sync='naive' is ignored: placement.mode=split: the rollout ranks keep their own "
        "weights, sent by parallel/split_transfer.py"
    ]
    assert ignored_key_warnings(composed("optim.min_lr=1e-5")) == [
        "warning: optim.min_lr=1e-05 is ignored: optim.lr_decay=constant never decays to it"
    ]
    # DAPO's buffer is a fraction of the response budget: its penalty is read (no warning); none at all: warned
    assert ignored_key_warnings(composed("algorithm=dapo", "algorithm.overlong_penalty=0.5")) == []
    assert ignored_key_warnings(composed("algorithm.overlong_penalty=0.5")) == [
        "warning: algorithm.overlong_penalty=0.5 is ignored: no overlong buffer (algorithm.overlong_buffer_len=0, "
        "overlong_buffer_frac=0)"
    ]
    # own training files without validation files: trainer.test_freq validates nothing
    assert ignored_key_warnings(composed("data.train_files=[/d/t.parquet]", "trainer.test_freq=5")) == [
        "warning: trainer.test_freq=5 is ignored: data.val_files is empty (the embedded validation set goes with "
        "the embedded task only)"
    ]


def test_settings_read_only_in_some_runs_are_warned_about_elsewhere():
    """Each of these used to be ignored without a word; each is read (no warning) where the combination uses it."""
    off_validation = "trainer.test_freq=0 and trainer.val_before_train=false: no validation"
    budget = "trainer.max_tokens_per_micro_batch=256"
    cases = [
        (
            ["algorithm.kl_loss_coef=0", "trainer.offload_reference=true"],
            "trainer.offload_reference=True is ignored: no reference policy is built (algorithm.kl_loss_coef=0, "
            "algorithm.kl_in_reward=false)",
            ["trainer.offload_reference=true"],  # grpo's KL loss builds the reference
        ),
        (
            ["placement.critic_tp=2"],
            "placement.critic_tp=2 is ignored: only a critic on ranks of its own (placement.mode=split, "
            "placement.critic_ranks > 0) has its own layout; otherwise it trains in the actor's (parallel.tp, "
            "parallel.pp)",
            ["placement.critic_tp=2", "placement.mode=split", "placement.critic_ranks=2", "algorithm=ppo"],
        ),
        (
            ["rollout.val_n=4", "trainer.test_freq=0"],
            f"rollout.val_n=4 is ignored: {off_validation}",
            ["rollout.val_n=4", "trainer.test_freq=0", "trainer.val_before_train=true"],
        ),
        (
            [budget, "trainer.micro_batch_size=4"],
            "trainer.micro_batch_size=4 is ignored: trainer.max_tokens_per_micro_batch cuts the micro-batches "
            "by its token budget",
            ["trainer.micro_batch_size=4"],
        ),
        (
            ["algorithm.tis_mode=mask"],
            "algorithm.tis_mode='mask' is ignored: algorithm.tis_cap=0: no importance correction between "
            "rollout and training log-probs",
            ["algorithm.tis_mode=mask", "algorithm.tis_cap=2"],
        ),
    ]
    for ignored, line, read in cases:
        assert ignored_key_warnings(composed(*ignored)) == [f"warning: {line}"]
        assert ignored_key_warnings(composed(*read)) == []
    assert (
        f"rollout.val_temperature=0.5 is ignored: {off_validation}"
        in ignored_key_warnings(composed("rollout.val_temperature=0.5", "trainer.test_freq=0"))[0]
    )


def test_multi_turn_keys_are_warned_about_while_multi_turn_is_off():
    """The nested rollout.multi_turn.* keys (three levels deep) are read only with rollout.multi_turn.enable."""
    keys = ["rollout.multi_turn.max_turns=2", "rollout.multi_turn.tools=[python]"]
    assert ignored_key_warnings(composed(*keys)) == [
        "warning: rollout.multi_turn.max_turns=2 is ignored: rollout.multi_turn.enable=false",
        "warning: rollout.multi_turn.tools=['python'] is ignored: rollout.multi_turn.enable=false",
    ]
    assert ignored_key_warnings(composed("rollout.multi_turn.enable=true", *keys)) == []


def test_checkpoint_positions_must_hold_prompt_plus_response(tmp_path):
    """With model.path (and critic.path under GAE, reward.model_path) the checkpoint's config.json gives
    max_position_embeddings; data.max_prompt_len + rollout.max_new_tokens (64 + 5 by default) must fit.
    A missing, unreadable or incomplete config.json is an error naming the file."""
    import json
    import re

    def checkpoint(name: str, text: str | None = None, **config) -> str:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(hf_tiny.config_json(**config)) if text is None else text)
        (path / "tokenizer_config.json").write_text("{}")  # model.path's tokenizer must exist too
        return str(path)

    def refused(overrides: list[str], message: str) -> None:
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate(composed(*overrides), world_size=1)

    short = checkpoint("short", max_position_embeddings=64)
    long = checkpoint("long", max_position_embeddings=128)
    validate(composed(f"model.path={long}"), world_size=1)
    validate(composed(f"model.path={short}", "data.max_prompt_len=59"), world_size=1)  # exactly 64
    rule = "data.max_prompt_len + rollout.max_new_tokens=69: must be <= max_position_embeddings=64 of "
    refused([f"model.path={short}"], f"{rule}model.path='{short}' ({short}/config.json). Fix: lower")
    refused([f"model.path={long}", "algorithm=ppo", f"critic.path={short}"], f"{rule}critic.path='{short}'")
    reward = checkpoint(
        "reward", max_position_embeddings=64, architectures=["Qwen2ForSequenceClassification"]
    )
    refused([f"reward.model_path={reward}"], f"{rule}reward.model_path='{reward}'")

    (tmp_path / "empty").mkdir()
    empty = str(tmp_path / "empty")
    refused(
        [f"model.path={empty}"], f"model.path='{empty}': has no config.json ({empty}/config.json is missing)"
    )
    broken = checkpoint("broken", text="{not json")
    refused([f"model.path={broken}"], f"{broken}/config.json is not a readable JSON config (JSONDecodeError")
    keyless = checkpoint("keyless", text='{"hidden_size": 8}')
    refused([f"model.path={keyless}"], f"{keyless}/config.json has no max_position_embeddings")


def test_data_files_take_one_path_or_a_list_and_expand_home(monkeypatch, tmp_path):
    """verl's `data.train_files=~/data/train.parquet` (one path) and lists; `~` expands (the command line's
    unquoted `~` is expanded by engine.train: tests/engine/test_user_errors.py)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    one = composed('data.train_files="~/data/train.parquet"', "data.val_files=/data/test.parquet").data
    assert one.train_files == [f"{tmp_path}/data/train.parquet"] and one.val_files == ["/data/test.parquet"]
    many = composed('data.train_files=["~/a.parquet",/b.parquet]').data
    assert many.train_files == [f"{tmp_path}/a.parquet", "/b.parquet"] and many.val_files == []
    with pytest.raises(ConfigError, match=r"data.train_files=3: must be a path or a list of paths. Fix:"):
        composed("data.train_files=3")


def test_a_newly_registered_estimator_is_validated_by_its_traits(monkeypatch):
    """Validation takes the names and capabilities from the registry: a new estimator is accepted, and what it
    declares (group-relative, reads gamma) decides the rules and the ignored-key warnings. The registry is
    process-wide: the estimator is registered into copies that monkeypatch puts back, so no later test
    (tests/algorithms/test_advantages.py lists the known names) sees it."""
    from algorithms import advantages
    from algorithms.advantages import AdvantageTraits, get_advantage_estimator, register_advantage

    monkeypatch.setattr(advantages._ESTIMATORS, "_fns", dict(advantages._ESTIMATORS._fns))
    monkeypatch.setattr(advantages, "_TRAITS", dict(advantages._TRAITS))
    name = "test_group_gamma"
    traits = AdvantageTraits(group_relative=True, uses_gamma=True)
    register_advantage(name, traits)(get_advantage_estimator("grpo"))
    validate(composed(f"algorithm.adv_estimator={name}"), world_size=1)
    with pytest.raises(ConfigError, match=f"rollout.n=1: algorithm.adv_estimator={name} compares responses"):
        validate(composed(f"algorithm.adv_estimator={name}", "rollout.n=1"), world_size=1)
    warnings = ignored_key_warnings(composed(f"algorithm.adv_estimator={name}", "algorithm.gamma=0.9"))
    assert not any("algorithm.gamma" in line for line in warnings)


def test_output_dir_data_files_and_interpolations_are_checked_before_any_process_group(tmp_path):
    """What used to fail after the process group started (or as a raw OmegaConf traceback) is refused by
    validation, naming the key."""
    from engine.errors import DataFileNotFoundError

    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match=r"trainer.output_dir='.*afile': is a file, not a directory\. Fix:"):
        validate(composed(f"trainer.output_dir={afile}"), world_size=1)
    with pytest.raises(DataFileNotFoundError, match=r"data.val_files\[0\]=/no/such.parquet: file not found"):
        validate(composed("data.val_files=[/no/such.parquet]"), world_size=1)
    with pytest.raises(ConfigError, match=r"trainer.output_dir: InterpolationKeyError: .*oops.*Fix:"):
        composed("trainer.output_dir=${oops}")


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused_at_startup(tmp_path):
    """model.vocab_size (random init) or model.path's config.json vocab_size below the tokenizer's size used to
    fail at the first rollout or forward (ids past the embedding); now validation refuses it, naming the key,
    both sizes and the tokenizer. The size is counted on the tokenizer as setup loads it: special tokens that
    tokenizer_config.json names past the vocabulary count (transformers adds them only when it loads it)."""
    import json
    import re
    import shutil

    from engine.data import load_tokenizer
    from engine.tasks.embedded import build_embedded_tokenizer
    from engine.validate.model import tokenizer_size

    tok = build_embedded_tokenizer(str(tmp_path / "tok"))
    assert tokenizer_size(tok, "model.tokenizer_path") == len(load_tokenizer(tok)) == 50

    def refused(overrides: list[str], message: str) -> None:
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate(composed(*overrides), world_size=1)

    rule = "is smaller than the vocabulary of the tokenizer of"
    refused(["model.vocab_size=40"], f"model.vocab_size=40: {rule} the embedded character tokenizer")
    refused(
        [f"model.tokenizer_path={tok}", "model.vocab_size=49"], f"{rule} model.tokenizer_path='{tok}': 50 tok"
    )
    validate(composed(f"model.tokenizer_path={tok}", "model.vocab_size=50"), world_size=1)
    validate(composed("model.vocab_size=0"), world_size=1)  # the tokenizer's size

    specials = tmp_path / "specials"  # two special tokens that only tokenizer_config.json names
    shutil.copytree(tok, specials)
    config = json.loads((specials / "tokenizer_config.json").read_text())
    config["additional_special_tokens"] = ["<x>", "<y>"]
    (specials / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_size(str(specials), "model.tokenizer_path") == len(load_tokenizer(str(specials))) == 52
    refused([f"model.tokenizer_path={specials}", "model.vocab_size=51"], f"{specials}': 52 tokens")
    validate(composed(f"model.tokenizer_path={specials}", "model.vocab_size=52"), world_size=1)

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tok, ckpt)
    (ckpt / "config.json").write_text(json.dumps(hf_tiny.config_json(vocab_size=40)))
    refused(
        [f"model.path={ckpt}"], f"{ckpt}/config.json: vocab_size=40: {rule} model.path='{ckpt}': 50 tokens"
    )
    (ckpt / "config.json").write_text(json.dumps(hf_tiny.config_json(vocab_size=64)))
    validate(composed(f"model.path={ckpt}"), world_size=1)
