"""Run under torchrun by tests/engine/test_trainer_multirank.py (world size 4), with the output root as its one
argument: every rank runs the same sequence of short jobs (tests/engine/trainer_jobs.py), each checked for
finite metrics, then the checks of tests/engine/trainer_parity.py: the forward-only paths with a short last
micro-batch at PP=2 (and VPP=2) against PP=1, the dynamic-batching gradient parity at TP=2 x PP=2 (fixed vs
token-budget micro-batches), packed vs padded micro-batches at TP=2 x PP=2 with sequence parallelism off and
on, the advantages of the same rows at DP=1 and DP=2, a step at DP=4 with and without the groups re-dealt
over the replicas (trainer.balance_batch), an MoE step at EP=1 vs EP=2. Rank 0 prints the results.
"""

from __future__ import annotations

import json
import os
import sys
import time

from trainer_jobs import CRITIC_KEYS, check_finite, read_metrics, run_job
from trainer_parity import (
    MOE_PP2,
    balance_invariance,
    dp_advantage_invariance,
    dynamic_batch_parity,
    moe_expert_parallel_invariance,
    packing_parity,
    pipeline_remainder_parity,
)

from parallel.state import destroy_distributed


def main(out_root: str) -> None:
    """World size 4: the jobs below in sequence (the last scored by a reward model at TP=2 x PP=2), then the
    dynamic-batching parity and the packing parity (SP off, on; no budget) at TP=2 x PP=2, then the DP=1 vs DP=2
    advantages, then a DP=4 step balanced and not, then an MoE step at EP=1 vs EP=2 (TP=2, then PP=2 rolled out at rollout.tp=1)."""
    rank = int(os.environ.get("RANK", "0"))
    jobs = {
        "ppo_tp2_pp2": (
            3,
            ["algorithm=ppo", "parallel.tp=2", "parallel.pp=2", "rollout.tp=2", "trainer.total_steps=3"],
        ),
        "dapo_tp2_dp2_budget": (
            2,
            [
                "algorithm=dapo",
                "algorithm.overlong_buffer_len=2",
                "rollout.max_new_tokens=7",  # the buffer after the embedded task's 5-token answer
                "parallel.tp=2",
                "rollout.tp=2",
                "trainer.max_tokens_per_micro_batch=80",
            ],
        ),
        "remax_pp2_dp2_budget": (
            2,
            [
                "algorithm=remax",
                "parallel.pp=2",
                "algorithm.num_mini_batches=2",
                "trainer.max_tokens_per_micro_batch=80",
            ],
        ),
    }
    reward_model = os.path.join(out_root, "reward_model")  # saved by the test before the launch
    jobs["grpo_reward_model_tp2_pp2"] = (
        2,
        [
            "parallel.tp=2",
            "parallel.pp=2",
            "rollout.tp=2",
            f"reward.model_path={reward_model}",
            "trainer.pack_sequences=false",  # the padded layout through the trainer (ppo: packed)
        ],
    )
    for name, (steps, overrides) in jobs.items():
        out = os.path.join(out_root, name)
        start = time.perf_counter()
        trainer = run_job([*overrides, f"trainer.test_freq={steps}"], out, keep_process_group=True)
        if rank == 0:
            check_finite(read_metrics(out), steps, CRITIC_KEYS if name.startswith("ppo") else ())
            print(f"job {name} ok in {time.perf_counter() - start:.1f} s", flush=True)
        if rank == 0 and name.startswith("grpo_reward_model"):
            import hf_tiny

            exp = trainer.last_experience
            diff = (exp.tensors["scores"] - hf_tiny.hf_reward_scores(reward_model, exp)).abs().max()
            print(f"reward_model_max_abs_diff {float(diff)}", flush=True)
    remainder = pipeline_remainder_parity(out_root, True)
    if rank == 0:
        print("pp_remainder " + json.dumps(remainder), flush=True)
    parity = dynamic_batch_parity(
        ["parallel.tp=2", "parallel.pp=2"], os.path.join(out_root, "parity"), 64, True
    )
    if rank == 0:
        print("parity " + json.dumps(parity), flush=True)
    for sp in ("false", "true"):
        packing = packing_parity(
            ["parallel.tp=2", "parallel.pp=2", f"parallel.sp={sp}"],
            os.path.join(out_root, f"packing_sp_{sp}"),
            64,
            True,
        )
        if rank == 0:
            print(f"packing_sp_{sp} " + json.dumps(packing), flush=True)
    packing = packing_parity(  # each group's prompt once (trainer.share_prompts) vs packed rows, TP x PP x SP
        ["parallel.tp=2", "parallel.pp=2", "parallel.sp=true"],
        os.path.join(out_root, "packing_shared"),
        40,
        True,
        shared=True,
    )
    if rank == 0:
        print("packing_shared " + json.dumps(packing), flush=True)
    packing = packing_parity(  # no budget (the default): 4 rows padded vs packed up to 4 x the batch's width
        ["parallel.tp=2", "parallel.pp=2"], os.path.join(out_root, "packing_by_width"), 0, True
    )
    if rank == 0:
        print("packing_by_width " + json.dumps(packing), flush=True)
    packing = packing_parity(  # 4 rows per micro-batch; packed: one length per call (interleaved schedule)
        ["parallel.pp=2", "parallel.vpp=2", "model.num_layers=4"],
        os.path.join(out_root, "packing_vpp2"),
        0,
        True,
    )
    if rank == 0:
        print("packing_vpp2 " + json.dumps(packing), flush=True)
    dp_invariance = dp_advantage_invariance()
    if rank == 0:
        print("dp_invariance " + json.dumps(dp_invariance), flush=True)
    balanced = balance_invariance(out_root)
    if rank == 0:
        print("balance_batch " + json.dumps(balanced), flush=True)
    moe_ep = moe_expert_parallel_invariance(out_root)
    if rank == 0:
        print("moe_ep " + json.dumps(moe_ep), flush=True)
    moe_ep_pp2 = moe_expert_parallel_invariance(out_root, MOE_PP2)
    if rank == 0:
        print("moe_ep_pp2 " + json.dumps(moe_ep_pp2), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
