"""float16 and bfloat16 training (world size 1): gradients equal float32's from the same init and batch,
float16's dynamic loss scale is applied to the loss and removed from the gradients, overflowing steps are
skipped and counted, and the loss scale is logged for the actor and the critic.

Tolerances (grad norm, relative to float32's): 2e-3 for float16 (2 x its machine epsilon 9.8e-4), 1.6e-2 for
bfloat16 (2 x 7.8e-3). The same checks run on one CUDA GPU (NCCL, fused Adam, cuBLAS/SDPA kernels), marked
`gpu`.
"""

from __future__ import annotations

import pytest
import torch
from trainer_jobs import built_job, read_metrics, run_job
from trainer_parity import skewed_experience

from algorithms.losses import loss_normalizer
from engine.roles.dynamic_batch import MicroBatcher
from engine.step.losses import make_actor_loss, make_critic_loss

TOL = {"float16": 2e-3, "bfloat16": 1.6e-2}
OVERFLOW = 2.0**100  # a loss scale that overflows float16 gradients whatever the batch
PPO = ["algorithm=ppo", "data.max_prompt_len=24", "rollout.max_new_tokens=12"]


GPU = ("cluster=single_gpu",)


def _one_step(dtype: str, out: str, extra: tuple[str, ...] = ()) -> dict:
    """One actor and one critic optimizer step on the same seeded batch; their StepStats and whether the
    parameters changed."""
    with built_job([*PPO, f"model.dtype={dtype}", *extra], out) as c:
        device = c.groups.device
        exp = skewed_experience(7, 16, 12, c.shape.vocab_size, c.tokenizer.pad_token_id)
        gen = torch.Generator().manual_seed(8)
        exp.tensors["values"] = torch.randn(exp.response_mask.shape, generator=gen) * exp.response_mask
        exp.tensors["returns"] = torch.randn(exp.response_mask.shape, generator=gen) * exp.response_mask
        alg = c.cfg.algorithm
        norm = float(loss_normalizer(exp.response_mask, alg.loss_agg_mode, max_len=12))
        batcher = MicroBatcher(4, 0, 1, device)
        rows = torch.arange(exp.num_rows)
        stats = {}
        for name, role, loss, keys in (
            ("actor", c.actor, make_actor_loss(alg, norm, kl_ref=False), ("advantages", "rollout_log_probs")),
            ("critic", c.critic, make_critic_loss(alg, norm), ("values", "returns")),
        ):
            before = [p.detach().float().clone() for ch in role.chunks for p in ch.parameters()]
            role.run(batcher(exp, rows, keys), loss, forward_only=False)
            step = role.optimizer_step()
            after = [p.detach().float() for ch in role.chunks for p in ch.parameters()]
            changed = any(not torch.equal(a, b) for a, b in zip(before, after))
            stats[name] = (step, changed, role.scheduler.num_steps)
        return stats


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_float16_and_bfloat16_gradients_equal_float32s(tmp_path, where):
    extra = GPU if where == "cuda" else ()
    ref = _one_step("float32", str(tmp_path / "fp32"), extra)
    for dtype in ("float16", "bfloat16"):
        got = _one_step(dtype, str(tmp_path / dtype), extra)
        for role in ("actor", "critic"):
            (want, _, _), (step, changed, _) = ref[role], got[role]
            assert not step.skipped and changed, (dtype, role, step)
            ratio = step.grad_norm / want.grad_norm
            assert abs(ratio - 1) <= TOL[dtype], (dtype, role, step.grad_norm, want.grad_norm)
            assert step.loss_scale == (65536.0 if dtype == "float16" else 1.0), (dtype, role, step)


def test_float16_overflow_skips_the_step(tmp_path):
    # no update, the LR schedule stays put
    got = _one_step("float16", str(tmp_path / "fp16"), (f"optim.initial_loss_scale={OVERFLOW!r}",))
    for role in ("actor", "critic"):
        step, changed, scheduler_steps = got[role]
        assert step.skipped and not changed and scheduler_steps == 0, (role, step)
        assert step.grad_norm == 0.0


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("scale, skipped", [(65536, [0, 0]), (OVERFLOW, [1, 1])])
def test_float16_run_logs_loss_scale_and_skipped_steps(tmp_path, scale, skipped, where):
    """A 2-step PPO run: the loss scale and skipped optimizer steps of each step, actor and critic (the
    dynamic scaler halves after its second overflow in a row). Both steps need a nonzero gradient to overflow:
    a seed whose rollouts score above 0 in both (at seed 1 step 2 scored 0 everywhere, and only float16 noise
    between the rollout's and the trainer's log-probs, in the KL penalty, left a gradient; with each group's
    prompt laid out once the two agree exactly on the CPU)."""
    extra = GPU if where == "cuda" else ()
    overrides = [*PPO, "model.dtype=float16", f"optim.initial_loss_scale={scale}", "trainer.seed=2"]
    run_job([*overrides, *extra], str(tmp_path))
    rows = read_metrics(str(tmp_path))
    assert all(r["reward/mean"] > 0 for r in rows), rows  # the premise: a gradient in every step
    scales = [float(scale), float(scale) / 2] if skipped[0] else [float(scale)] * 2
    for role in ("actor", "critic"):
        assert [r[f"{role}/skipped_steps"] for r in rows] == skipped, rows
        assert [r[f"{role}/loss_scale"] for r in rows] == scales, rows
        assert all((r[f"{role}/grad_norm"] > 0) == (not s) for r, s in zip(rows, skipped)), rows
