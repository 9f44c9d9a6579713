"""The Megatron reward model (reward.model_path), world size 1 in this process: a tiny random
Qwen2ForSequenceClassification scores each response as transformers does at the last valid token of
prompt + response, through 2 training steps; `combine=sum` adds the rule score; bad keys fail validation.
"""

from __future__ import annotations

import hf_tiny
import pytest
import torch
from trainer_jobs import check_finite, compose_config, read_metrics, run_job

from engine.config import ConfigError
from engine.tasks.embedded import EMBEDDED_VOCAB
from engine.validate import validate


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("rm"))
    # the embedded tokenizer's vocabulary, so the reward model reads the actor's token ids
    return hf_tiny.save_tiny("qwen2", out, seed=3, head="sequence", vocab_size=len(EMBEDDED_VOCAB))


def test_reward_is_the_hf_score_at_the_last_token_through_two_steps(reward_dir, tmp_path):
    out = str(tmp_path / "model")
    trainer = run_job([f"reward.model_path={reward_dir}"], out)
    check_finite(read_metrics(out), 2, ("reward/mean", "timing/reward"))
    exp = trainer.last_experience
    expected = hf_tiny.hf_reward_scores(reward_dir, exp)
    assert expected.std() > 0  # a random classifier tells responses apart
    # float32 on both sides; differences are summation order only
    torch.testing.assert_close(exp.tensors["scores"], expected, atol=1e-4, rtol=1e-4)

    out_sum = str(tmp_path / "sum")
    trainer = run_job([f"reward.model_path={reward_dir}", "reward.combine=sum"], out_sum)
    exp = trainer.last_experience
    rule = exp.tensors["scores"] - hf_tiny.hf_reward_scores(
        reward_dir, exp
    )  # the embedded rule's score: 0..1
    assert float(rule.min()) >= -1e-4 and float(rule.max()) <= 1 + 1e-4, rule


def test_reward_model_keys_are_validated(reward_dir, tmp_path):
    def check(overrides, match):
        with pytest.raises(ConfigError, match=match):
            validate(compose_config(overrides), 1)

    check([f"reward.model_path={tmp_path}"], "reward.model_path=.*has no config.json")
    causal = hf_tiny.save_tiny("qwen2", str(tmp_path / "causal"))
    check([f"reward.model_path={causal}"], "is not a \\*ForSequenceClassification")
    check([f"reward.model_path={reward_dir}", "reward.fn=x:y"], "reward.fn=.*would be ignored")
    check(["reward.combine=mean"], "reward.combine")
    # split placement: the reward model scores on the training ranks, which never see ReMax's greedy rollout
    split = ["placement.mode=split", "placement.rollout_ranks=1", "trainer.test_freq=0"]
    with pytest.raises(ConfigError, match="algorithm.adv_estimator=remax is not supported.*greedy baseline"):
        validate(compose_config([*split, "algorithm=remax", f"reward.model_path={reward_dir}"]), 2)
    assert validate(compose_config([*split, f"reward.model_path={reward_dir}"]), 2).dp == 1
