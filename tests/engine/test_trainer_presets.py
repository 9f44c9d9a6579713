"""Every algorithm preset trains in this process (world size 1) through the code `python -m engine.train`
runs, for 2 steps (PPO: 3, with validation), with finite metrics; plus checks on what the trainer wired.

In-process (tests/engine/trainer_jobs.py: compose, validate, init, build, fit, tear down) rather
than one interpreter per preset: a job here takes ~1 s after the first.
"""

from __future__ import annotations

import os

import pytest
import torch
from trainer_jobs import CRITIC_KEYS, built_job, check_finite, read_metrics, run_job

from algorithms.advantages import get_advantage_estimator

BASE = (
    "reward/mean",
    "actor/pg_loss",
    "actor/adv_mean",
    "actor/adv_std",
    "timing/gen",
    "timing/update_actor",
)
KL_REWARD = ("actor/reward_kl_penalty", "actor/reward_kl_coef")
JOBS = {
    # name: (overrides, steps, keys every row must have)
    "ppo": (
        ["algorithm=ppo", "trainer.total_steps=3", "trainer.test_freq=3"],
        3,
        (*BASE, *CRITIC_KEYS, *KL_REWARD),
    ),
    "grpo": (["algorithm=grpo"], 2, (*BASE, "actor/kl_loss", "timing/ref")),
    "dr_grpo": (["algorithm=dr_grpo"], 2, BASE),
    "dapo": (
        # its overlong buffer (a fraction of rollout.max_new_tokens) after the 5-token answer: one more token
        ["algorithm=dapo", "rollout.max_new_tokens=6"],
        2,
        (*BASE, "dynamic_sampling/dropped_groups", "dynamic_sampling/rounds", "reward/overlong_penalty_mean"),
    ),
    "rloo": (["algorithm=rloo"], 2, (*BASE, *KL_REWARD)),
    "reinforce_pp": (["algorithm=reinforce_pp"], 2, (*BASE, *KL_REWARD)),
    "remax": (["algorithm=remax"], 2, (*BASE, *KL_REWARD)),
    "gspo": (["algorithm=gspo"], 2, BASE),
    # variants: several optimizer steps per batch (old-log-prob forward), adaptive KL, token-budget batches
    "grpo_epochs2_minibatches2": (
        ["algorithm=grpo", "algorithm.ppo_epochs=2", "algorithm.num_mini_batches=2"],
        2,
        (*BASE, "timing/old_log_prob"),
    ),
    "rloo_adaptive_kl": (
        ["algorithm=rloo", "algorithm.kl_ctrl=adaptive", "algorithm.kl_horizon=10"],
        2,
        KL_REWARD,
    ),
    "ppo_token_budget": (["algorithm=ppo", "trainer.max_tokens_per_micro_batch=90"], 2, CRITIC_KEYS),
    # no rollout log-probs: GRPO (KL loss), and a KL in the reward fed by the old-log-prob forward
    "grpo_no_rollout_log_probs": (["algorithm=grpo", "rollout.log_probs=false"], 2, BASE),
    "rloo_no_rollout_log_probs": (
        ["algorithm=rloo", "rollout.log_probs=false"],
        2,
        (*BASE, *KL_REWARD, "timing/old_log_prob"),
    ),
}
# GRPO with an entropy bonus and a user reward returning a dict (tests/engine/dict_reward.py), validated
# after its last step
JOBS["grpo_entropy_dict_reward"] = (
    [
        "algorithm=grpo",
        "algorithm.entropy_coef=0.01",
        f"reward.fn={os.path.join(os.path.dirname(__file__), 'dict_reward.py')}:score",
        "trainer.test_freq=2",
    ],
    2,
    (*BASE, "actor/loss", "actor/entropy_loss", "actor/kl_loss", "reward/extra/acc"),
)
# validation with k sampled responses per prompt: per data source mean@k, best@k, maj@k
VAL_AT_K = tuple(f"val/embedded/copy/{name}" for name in ("reward", "mean@3", "best@3", "maj@3"))
JOBS["grpo_val_at_k"] = (
    ["algorithm=grpo", "trainer.total_steps=1", "trainer.test_freq=1", "rollout.val_n=3"],
    1,
    (*BASE, "val/reward_mean", *VAL_AT_K),
)
# a mixture-of-experts actor (4 experts, top-2) with the native rollout, exported as Qwen3-MoE at the end
JOBS["grpo_tiny_moe"] = (["model=tiny_moe", "trainer.export_hf=true"], 2, (*BASE, "actor/moe_load_imbalance"))
ROLLOUT_LOG_PROB_KEYS = ("actor/rollout_kl", "rollout/logprob_mean")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run each job once (module-scoped: the checks below share them)."""
    done = {}

    def get(name):
        if name not in done:
            out = str(tmp_path_factory.mktemp(name))
            overrides, steps, required = JOBS[name]
            trainer = run_job(overrides, out)
            rows = read_metrics(out)
            check_finite(rows, steps, required)
            done[name] = (trainer, rows)
        return done[name]

    return get


@pytest.mark.parametrize("name", list(JOBS))
def test_job_trains_with_finite_metrics(runs, name):
    runs(name)


def test_tiny_moe_exports_a_checkpoint_transformers_loads_as_qwen3_moe(runs):
    from transformers import AutoModelForCausalLM

    trainer, rows = runs("grpo_tiny_moe")
    assert all(1.0 <= row["actor/moe_load_imbalance"] <= 4 / 2 for row in rows)
    out = os.path.join(trainer.c.cfg.trainer.output_dir, "hf_actor")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and hf.config.num_experts_per_tok == 2
    assert torch.isfinite(hf(torch.tensor([[1, 2, 3]])).logits).all()


def test_on_policy_single_step_skips_old_forward_and_ratio_is_one(runs):
    for row in runs("grpo")[1]:
        assert "timing/old_log_prob" not in row
        assert row["actor/ppo_kl"] == 0.0 and row["actor/pg_clipfrac"] == 0.0
        assert abs(row["actor/rollout_kl"]) < 1e-4  # rollout engine vs training forward, float32
    rows = runs("grpo_epochs2_minibatches2")[1]
    assert all("timing/old_log_prob" in row for row in rows)


def test_rollout_log_probs_off_trains_the_same_and_logs_no_rollout_log_prob_metrics(runs):
    with_lp, without = runs("grpo")[1], runs("grpo_no_rollout_log_probs")[1]
    for row in with_lp:
        assert all(key in row for key in ROLLOUT_LOG_PROB_KEYS), row
    for row in without:
        assert not any(key in row for key in ROLLOUT_LOG_PROB_KEYS), row
    # the loss never read them: same seeds, same responses (native engine), same update
    for a, b in zip(with_lp, without):
        for key in (
            "reward/mean",
            "response_length/mean",
            "actor/pg_loss",
            "actor/grad_norm",
            "actor/kl_loss",
        ):
            assert a[key] == b[key], (key, a[key], b[key])
    # a KL in the reward with one optimizer step: the old-log-prob forward stands in for the rollout's
    # log-probs (same weights: float32 numerics apart, the same KL penalty and the same update)
    trainer, rows = runs("rloo_no_rollout_log_probs")
    assert not any(key in row for row in rows for key in ROLLOUT_LOG_PROB_KEYS)
    exp = trainer.last_experience
    assert "rollout_log_probs" not in exp.tensors and "old_log_probs" in exp.tensors
    for a, b in zip(runs("rloo")[1], rows):
        assert a["reward/mean"] == b["reward/mean"]
        assert abs(a["actor/reward_kl_penalty"] - b["actor/reward_kl_penalty"]) < 1e-5
        assert abs(a["actor/pg_loss"] - b["actor/pg_loss"]) < 1e-5 and b["actor/ppo_kl"] < 1e-6
    assert "rollout_log_probs" not in runs("grpo_no_rollout_log_probs")[0].last_experience.tensors


def test_grpo_groups_are_rows_of_one_prompt_and_advantages_match_the_estimator(runs):
    exp = runs("grpo")[0].last_experience
    n = 4
    assert exp.num_rows == 4 * n
    for r in range(exp.num_rows):
        first = r // n * n
        assert exp.group_index[r] == exp.group_index[first]
        p = int(exp.prompt_lens[r])
        assert torch.equal(exp.tokens[r, :p], exp.tokens[first, :p])
    assert len(set(exp.group_index.tolist())) == 4
    expected, _ = get_advantage_estimator("grpo")(
        mask_bt=exp.response_mask, scores_b=exp.tensors["scores"], group_index_b=exp.group_index
    )
    torch.testing.assert_close(exp.tensors["advantages"], expected, rtol=0, atol=0)


def test_ppo_critic_values_feed_gae(runs):
    trainer, rows = runs("ppo")
    exp = trainer.last_experience
    expected, returns = get_advantage_estimator("gae")(
        mask_bt=exp.response_mask,
        token_rewards_bt=exp.tensors["token_rewards"],
        values_bt=exp.tensors["values"],
        gamma=1.0,
        lam=0.95,
    )
    torch.testing.assert_close(exp.tensors["advantages"], expected, rtol=0, atol=0)
    torch.testing.assert_close(exp.tensors["returns"], returns, rtol=0, atol=0)
    assert "val/reward_mean" in rows[-1]  # validation (greedy) runs with the critic built
    # the value head starts at zero; after an update the critic predicts something
    assert rows[0]["critic/values_mean"] == 0.0 and rows[-1]["critic/values_mean"] != 0.0


def test_remax_baseline_is_the_greedy_score(runs):
    exp = runs("remax")[0].last_experience
    mask = exp.response_mask
    # the preset has a KL in the reward: verl's form, each token's reward-to-go minus the baseline
    to_go = (exp.tensors["token_rewards"] * mask).flip(-1).cumsum(-1).flip(-1)
    expected = (to_go - exp.tensors["baseline_scores"][:, None]) * mask
    torch.testing.assert_close(exp.tensors["advantages"], expected, rtol=1e-6, atol=1e-7)
    n = 4  # one greedy baseline per prompt
    assert torch.equal(
        exp.tensors["baseline_scores"], exp.tensors["baseline_scores"][::n].repeat_interleave(n)
    )


def test_dapo_keeps_informative_groups_unless_filled(runs):
    trainer, rows = runs("dapo")
    exp = trainer.last_experience
    shaped = (exp.tensors["scores"] + exp.tensors["overlong_penalty"]).view(-1, 4)
    constant = (shaped == shaped[:, :1]).all(-1)
    assert int(constant.sum()) == rows[-1]["dynamic_sampling/filler_groups"]


def test_adaptive_kl_coefficient_moves(runs):
    rows = runs("rloo_adaptive_kl")[1]
    assert rows[0]["actor/reward_kl_coef"] == 0.001
    assert rows[1]["actor/reward_kl_coef"] != rows[0]["actor/reward_kl_coef"]


def test_critic_loads_its_backbone_from_the_checkpoint_with_a_zero_head(tmp_path):
    import hf_tiny

    from engine.tasks.embedded import build_embedded_tokenizer
    from engine.trainer import Trainer

    actor_dir = hf_tiny.save_tiny("qwen2", str(tmp_path / "actor"), seed=0)
    build_embedded_tokenizer(actor_dir)  # the embedded task tokenises with model.path's tokenizer
    critic_dir = hf_tiny.save_tiny("qwen2", str(tmp_path / "critic"), seed=7, head="token")

    def params(role):
        return {n.removeprefix("module."): p.detach().clone() for n, p in role.chunks[0].named_parameters()}

    with built_job(["algorithm=ppo", f"model.path={actor_dir}"], str(tmp_path / "a")) as c:
        actor, critic = params(c.actor), params(c.critic)
        assert critic.pop("output_layer.weight").abs().max() == 0  # a fresh value head
        for name, value in critic.items():
            assert torch.equal(value, actor[name]), name
        metrics = Trainer(c).train_step()  # the checkpoint's model trains with its critic
        assert metrics["critic/vpred_mean"] == 0.0 and metrics["critic/grad_norm"] > 0
    with built_job(
        ["algorithm=ppo", f"model.path={actor_dir}", f"critic.path={critic_dir}"], str(tmp_path / "b")
    ) as c:
        critic = params(c.critic)
        assert critic["output_layer.weight"].abs().max() > 0  # score.weight of the token classifier
        assert not torch.equal(
            critic["decoder.layers.0.mlp.linear_fc1.weight"],
            params(c.actor)["decoder.layers.0.mlp.linear_fc1.weight"],
        )


def test_actor_loss_is_its_logged_terms_and_dict_reward_extras_are_logged(runs):
    """actor/loss = pg_loss - entropy_coef * entropy_loss + kl_loss_coef * kl_loss (each a mean per optimizer
    step); a dict reward's numeric extra `acc` (2 x score) is logged as reward/extra/acc and in validation as
    val/<source>/extra/acc, its string `note` not."""
    trainer, rows = runs("grpo_entropy_dict_reward")
    for row in rows:
        total = row["actor/pg_loss"] - 0.01 * row["actor/entropy_loss"] + 0.001 * row["actor/kl_loss"]
        assert row["actor/loss"] == pytest.approx(total, rel=1e-6, abs=1e-9)
        assert row["actor/entropy_loss"] > 0 and row["actor/loss"] != row["actor/pg_loss"]
        assert row["reward/extra/acc"] == pytest.approx(2 * row["reward/mean"], abs=1e-6)
        assert not any(key.startswith("reward/extra/") and key != "reward/extra/acc" for key in row)
    exp = trainer.last_experience
    assert torch.equal(exp.tensors["reward_extra/acc"], 2 * exp.tensors["scores"])
    # response_length/clip_ratio is verl's (responses of rollout.max_new_tokens tokens), truncated_ratio
    # those without a stop token
    lengths = exp.response_mask.sum(-1)
    at_max = (lengths == trainer.cfg.rollout.max_new_tokens).float().mean()
    assert rows[-1]["response_length/clip_ratio"] == pytest.approx(float(at_max))
    truncated = 1.0 - exp.tensors["finished"].mean()
    assert rows[-1]["response_length/truncated_ratio"] == pytest.approx(float(truncated))
    val = rows[-1]["val/embedded/copy/extra/acc"]
    assert val == pytest.approx(2 * rows[-1]["val/embedded/copy/reward"], abs=1e-6)
    assert not any("/extra/note" in key for key in rows[-1])


def test_validation_at_k_per_data_source(runs):
    (row,) = runs("grpo_val_at_k")[1]
    reward, mean, best, maj = (row[key] for key in VAL_AT_K)
    assert reward == row["val/reward_mean"]  # one data source: its greedy reward is the overall one
    assert 0.0 <= mean <= best <= 1.0 and 0.0 <= maj <= best


def test_rollout_kl_is_the_first_mini_batch_before_any_update(tmp_path):
    """2 epochs x 2 mini-batches: actor/rollout_kl is the k1 gap between the rollout's log-probs and the
    training forward on the first mini-batch's rows before any optimizer step (the old-log-prob forward of
    the same weights), not an average over updates that includes their own drift."""
    from engine.trainer import Trainer

    overrides = ["algorithm=grpo", "algorithm.ppo_epochs=2", "algorithm.num_mini_batches=2", "optim.lr=0.05"]
    with built_job(overrides, str(tmp_path)) as c:
        trainer = Trainer(c)
        metrics = trainer.train_step()
        exp = trainer.last_experience
    mask = exp.response_mask
    gap_bt = (exp.tensors["rollout_log_probs"] - exp.tensors["old_log_probs"]) * mask  # before any update
    rows_per_mini = exp.num_rows // 2
    first = torch.randperm(2, generator=torch.Generator().manual_seed(trainer.cfg.trainer.seed)).tolist()[0]
    rows = slice(first * rows_per_mini, (first + 1) * rows_per_mini)
    expected = float(gap_bt[rows].sum() / mask[rows].sum())
    # float32, the same weights in different micro-batches: summation order only (the gap itself is ~1e-8 on
    # CPU, where rollout and training compute the same log-probs)
    assert abs(metrics["actor/rollout_kl"] - expected) <= 1e-8 + 1e-5 * abs(expected), (metrics, expected)
    # the updates did move the policy: an average over them would include that drift
    assert metrics["actor/ppo_kl"] > 1e-3, metrics


def test_val_before_train_validates_the_starting_model_as_step_0(tmp_path):
    """trainer.val_before_train: a step-0 line with the validation of the starting model. With a learning rate
    far below float32's resolution the weights do not move, so the greedy validation after step 1 (the path
    every run takes) must score exactly as step 0's."""
    out = str(tmp_path / "run")
    flags = [
        "trainer.total_steps=1",
        "trainer.test_freq=1",
        "trainer.val_before_train=true",
        "optim.lr=1e-30",
    ]
    run_job(["algorithm=grpo", *flags], out)
    rows = read_metrics(out)
    assert [row["step"] for row in rows] == [0, 1]
    assert "reward/mean" not in rows[0] and "val/reward_mean" in rows[0], rows[0]
    assert rows[0]["val/embedded/copy/reward"] == rows[1]["val/embedded/copy/reward"]
    assert rows[0]["val/reward_std"] == rows[1]["val/reward_std"]
