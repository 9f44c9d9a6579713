"""Config validation of the parallel layout: expert and pipeline parallelism, uneven and interleaved stages,
split placement, micro-batches and sequence packing (no processes, no models)."""

from __future__ import annotations

import pytest
from config_compose import composed

from engine.config import ConfigError
from engine.validate import validate


def test_expert_parallel_accepts_pipeline_stages_and_a_narrower_rollout_tp():
    """parallel.ep=2 with parallel.pp=2, and with parallel.tp=2 rolled out at rollout.tp=1 (world 4): the
    3D-HybridEngine regroups the experts too (parallel/expert_gather.py)."""
    moe = ("model=tiny_moe", "data.max_prompt_len=32", "parallel.ep=2")
    assert validate(composed(*moe, "parallel.pp=2"), world_size=4).pp == 2
    dims = validate(composed(*moe, "parallel.tp=2", "parallel.sp=true", "rollout.tp=1"), world_size=4)
    assert (dims.tp, dims.ep) == (2, 2)


def test_split_placement_validates_the_training_layout_on_the_training_ranks():
    """placement.mode=split: the returned layout covers the ranks before the rollout ranks; rollout.tp is
    the rollout side's own (it need not divide parallel.tp)."""
    base = ["placement.mode=split", "trainer.test_freq=0"]
    dims = validate(composed(*base, "placement.rollout_ranks=1"), world_size=3)
    assert (dims.world_size, dims.dp) == (2, 2)
    dims = validate(
        composed(*base, "placement.rollout_ranks=2", "parallel.tp=2", "rollout.tp=2"), world_size=4
    )
    assert (dims.world_size, dims.tp, dims.dp) == (2, 2, 1)
    dims = validate(composed(*base, "placement.rollout_ranks=2", "rollout.tp=2"), world_size=3)
    assert (dims.world_size, dims.tp) == (1, 1)
    assert validate(composed(), world_size=4).world_size == 4  # colocated (the default): every rank trains
    off_policy = ["trainer.off_policy_steps=1", "algorithm.tis_cap=2", "algorithm.tis_mode=mask"]
    assert validate(composed(*base, "placement.rollout_ranks=1", *off_policy), world_size=3).dp == 2
    served = ["trainer.test_freq=5", "algorithm.dynamic_sampling=true"]  # the rollout ranks run these too
    assert validate(composed(*base, "placement.rollout_ranks=1", *served), world_size=3).dp == 2
    with pytest.raises(ConfigError, match=r"trainer.val_before_train=True: .*colocated placement only.*Fix:"):
        validate(composed(*base, "placement.rollout_ranks=1", "trainer.val_before_train=true"), world_size=3)


def test_uneven_pipeline_stages_are_accepted():
    """Layer counts that parallel.pp does not divide take megatron's uneven first/last stages."""
    dims = validate(composed("model.num_layers=3", "parallel.pp=2"), world_size=2)
    assert dims.stage_layer_counts(3) == (2, 1)
    cfg = composed("model.num_layers=5", "parallel.pp=2", "parallel.first_stage_layers=1")
    assert validate(cfg, world_size=2).stage_layer_counts(5) == (1, 4)


def test_stage_split_of_a_checkpoint_names_its_config_file(tmp_path):
    """A checkpoint's layer count is checked against the pipeline before any process group exists."""
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 3}')
    cfg = composed("model.num_layers=6", "parallel.pp=2", "parallel.vpp=3", f"critic.path={tmp_path}")
    with pytest.raises(ConfigError, match="Fix:") as err:
        validate(cfg, world_size=2)
    assert f"{tmp_path}/config.json: num_hidden_layers=3" in str(err.value)


def test_interleaved_pipeline_needs_a_multiple_of_pp_micro_batches_per_update():
    """parallel.vpp > 1: megatron's interleaved schedule takes a positive multiple of pp micro-batches per
    call; the update's count (sequences per mini-batch / trainer.micro_batch_size) is checked up front."""
    two = ("parallel.pp=2", "parallel.vpp=2", "model.num_layers=4")  # 16 prompts x 8 = 128 sequences
    validate(composed(*two, "trainer.micro_batch_size=32"), world_size=2)  # 4 micro-batches
    with pytest.raises(
        ConfigError, match=r"trainer.micro_batch_size=128: gives 1 micro-batches.*parallel.pp=2"
    ):
        validate(composed(*two, "trainer.micro_batch_size=128"), world_size=2)
    four = ("parallel.pp=4", "parallel.vpp=2", "model.num_layers=8")
    with pytest.raises(ConfigError, match=r"Fix: use trainer.micro_batch_size in \[1, 2, 4, 8, 16, 32\]"):
        validate(composed(*four, "trainer.micro_batch_size=64"), world_size=4)
    with pytest.raises(ConfigError, match="make the sequences per mini-batch a multiple of 4"):
        validate(
            composed(*four, "data.batch_size=2", "rollout.n=3", "trainer.micro_batch_size=1"), world_size=4
        )
    # a token budget varies the count at run time: refused with vpp > 1
    with pytest.raises(ConfigError, match="trainer.max_tokens_per_micro_batch=.*interleaved"):
        validate(composed(*two, "trainer.max_tokens_per_micro_batch=4096"), world_size=2)


def test_pack_sequences_defaults_on_with_or_without_a_token_budget():
    from engine.micro_batch_sizing import packs_sequences
    from engine.roles.dynamic_batch import micro_batch_shapes_vary

    for overrides in ((), ("trainer.max_tokens_per_micro_batch=4096",), ("trainer.pack_sequences=true",)):
        cfg = composed(*overrides)
        validate(cfg, world_size=1)
        assert packs_sequences(cfg.trainer) and micro_batch_shapes_vary(cfg.trainer, 1), overrides
        assert (
            not micro_batch_shapes_vary(cfg.trainer, 2) or cfg.trainer.max_tokens_per_micro_batch
        )  # one_shape
    padded = composed("trainer.pack_sequences=false")
    assert not packs_sequences(padded.trainer) and not micro_batch_shapes_vary(padded.trainer, 1)
    budget = composed("trainer.max_tokens_per_micro_batch=4096", "trainer.pack_sequences=false")
    validate(budget, world_size=1)
    assert not packs_sequences(budget.trainer) and micro_batch_shapes_vary(budget.trainer, 1)
