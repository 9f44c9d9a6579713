"""GRPO and PPO runs on the embedded `target` task, in one torchrun launch per layout, each printing the mean
training reward of its first and last 10 steps (tests/engine/test_trainer_learning.py asserts it rises).

The settings are the cheapest found to learn within 40 steps from random init on CPU (2-digit answers,
2 epochs x 2 mini-batches per batch, Adam 5e-3; see shared/notes/cpu-grpo-learnability.md).
"""

from __future__ import annotations

import json
import os
import sys
import time

from trainer_jobs import read_metrics, run_job

from parallel.state import destroy_distributed

STEPS = 40
LEARN = [
    "data.embedded_task=target",
    "data.embedded_digits=2",
    "rollout.max_new_tokens=3",
    "data.batch_size=16",
    "rollout.n=8",
    "trainer.micro_batch_size=32",
    "algorithm.ppo_epochs=2",
    "algorithm.num_mini_batches=2",
    "optim.lr=5e-3",
    "critic.lr=5e-3",
    f"trainer.total_steps={STEPS}",
]
LAYOUTS = {
    "tp2_pp2": ["parallel.tp=2", "parallel.pp=2", "rollout.tp=2"],
    "dp2": ["trainer.max_tokens_per_micro_batch=256"],  # packed micro-batches (trainer.pack_sequences)
}


def main(out_root: str, layout: str, seed: int) -> None:
    rank = int(os.environ.get("RANK", "0"))
    for alg in ("grpo", "ppo"):
        out = os.path.join(out_root, f"{alg}_{layout}")
        start = time.perf_counter()
        overrides = [*LEARN, *LAYOUTS[layout], f"algorithm={alg}", f"trainer.seed={seed}"]
        run_job(overrides, out, keep_process_group=True)
        if rank == 0:
            rewards = [row["reward/mean"] for row in read_metrics(out)]
            first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
            record = {"job": f"{alg}_{layout}", "first": first, "last": last, "steps": len(rewards)}
            print("learn " + json.dumps(record) + f" in {time.perf_counter() - start:.1f} s", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
