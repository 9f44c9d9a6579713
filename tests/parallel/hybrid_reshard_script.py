"""torchrun script of tests/parallel/test_hybrid_engine.py: every 3D-HybridEngine check for one world size
(2 or 4 CPU ranks, gloo) in one launch, because a launch costs ~10 s.

For each layout (t, p, vpp) -> (t_g, p_g) and tied/untied embeddings, even and uneven pipeline stages, on a tiny GPTModel with GQA, QKV bias
and QK-norm: rollout tensors equal the slices of NaiveGather's full weights (torch.equal); received bytes
equal the plan and HybridFlow's formula; the gathered part is freed by to_train (weak references die);
training parameters are bit-identical and still in the engine's buffer after two round trips. Then a
training step after a round trip (megatron DDP + optimizer, with and without the distributed optimizer)
equals the step of a model that never resharded. Split placement (`SPLIT_CASES`): the first ranks train, the
others receive their rollout shard with `SplitTransfer` (rollout.tp below, equal to or above parallel.tp),
checked against the full weights twice (the second time after the training weights changed), received bytes
= the rollout shard's bytes. Rank 0 prints `HYBRID_OK <json>` at the end.

The checks live in tests/parallel/hybrid_reshard_checks.py (colocated) and
tests/parallel/split_transfer_checks.py (split placement); this script holds the cases and the entry point.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch.distributed as dist
from hybrid_reshard_checks import (
    NUM_LAYERS,
    check_expert_reshard,
    check_invalid,
    check_random_init_layout_invariant,
    check_repointed_after_build,
    check_reshard,
    check_training,
    setup,
)
from megatron.core import parallel_state
from split_transfer_checks import check_split

# training layout (tp, pp, vpp[, num_layers]) -> checks: ("reshard", rollout_tp, rollout_pp, tie, keep,
# bucket_bytes) or ("train", rollout_tp, rollout_pp, tie, distributed_optimizer). A layer count that pp * vpp
# does not divide takes megatron's uneven first/last stages (3 layers at PP=2: 2 then 1; 10 layers at PP=4 x
# VPP=2: 4, 2, 2, 2).
CASES = {
    2: {
        (2, 1, 1): [
            ("reshard", 1, 1, False, False, None),
            ("reshard", 1, 1, True, True, 32768),
            ("train", 1, 1, True, False),
        ],
        (1, 2, 1): [("reshard", 1, 1, True, False, None), ("reshard", 1, 2, True, False, None)],
        (1, 2, 2): [("reshard", 1, 1, False, True, None), ("train", 1, 1, True, False)],
        (1, 2, 1, 3): [
            ("reshard", 1, 1, True, False, None),
            ("reshard", 1, 2, False, False, None),
            ("train", 1, 1, True, False),
        ],
    },
    4: {
        (2, 2, 1): [
            ("reshard", 1, 1, False, False, None),
            ("reshard", 1, 1, True, False, 32768),
            ("reshard", 2, 1, False, False, None),
            ("reshard", 1, 2, True, False, None),
        ],
        (2, 2, 2): [
            ("reshard", 1, 1, True, False, None),
            ("reshard", 2, 1, True, True, None),
            ("train", 1, 1, True, False),
        ],
        (4, 1, 1): [("reshard", 2, 1, False, False, None), ("reshard", 1, 1, True, False, 65536)],
        (2, 1, 1): [("reshard", 1, 1, True, False, None), ("train", 1, 1, False, True)],
        (1, 4, 1): [("reshard", 1, 2, True, False, None)],
        (1, 4, 2): [("reshard", 1, 2, False, False, None)],
        (1, 2, 1): [("train", 1, 1, True, True)],
        (2, 2, 1, 3): [
            ("reshard", 1, 1, False, False, None),
            ("reshard", 2, 1, True, False, None),
            ("reshard", 1, 2, True, False, 32768),
            ("train", 1, 1, False, True),
        ],
        (1, 4, 2, 10): [("reshard", 1, 2, False, False, None), ("reshard", 1, 1, True, False, None)],
    },
}


# world size -> [(parallel.tp, parallel.pp, rollout.tp)] at parallel.ep=2 (tiny MoE with a shared expert)
EXPERT_CASES = {2: [], 4: [(1, 2, 1), (2, 1, 1)]}


# world size -> [(parallel.tp, parallel.pp, placement.rollout_ranks, rollout.tp, tied, bucket bytes)]
SPLIT_CASES = {
    2: [(1, 1, 1, 1, False, None)],
    4: [
        (2, 1, 2, 1, False, None),  # two rollout replicas from one TP=2 replica: TP shards merged
        (1, 2, 2, 2, True, 4096),  # rollout.tp > parallel.tp: training shards split; many small buckets
        (1, 1, 2, 1, False, 8192),  # two training replicas, each sends to one rollout replica
        (1, 3, 1, 1, True, None),  # three uneven stages (8 layers: 3, 3, 2... megatron's rule), tied
        (
            1,
            1,
            2,
            2,
            False,
            None,
            "vllm",
        ),  # Qwen2-like (no QK-norm), into rollout.backend=vllm at rollout.tp=2
    ],
}


def main() -> None:
    world = int(os.environ["WORLD_SIZE"])
    start = time.perf_counter()
    summary = {"world": world, "reshard": {}, "training": {}}
    for (tp, pp, vpp, *layers), checks in CASES[world].items():
        num_layers = layers[0] if layers else NUM_LAYERS
        groups = setup(tp, pp, vpp)
        for what, rtp, rpp, tie, *rest in checks:
            key = f"t{tp}p{pp}v{vpp}L{num_layers}->t{rtp}p{rpp}{' tied' if tie else ''}"
            if what == "reshard":
                keep, bucket = rest
                summary["reshard"][key + (" keep" if keep else "")] = check_reshard(
                    groups, rtp, rpp, tie, keep, bucket, num_layers
                )
            else:
                (do,) = rest
                summary["training"][key + (" distopt" if do else "")] = check_training(
                    groups, rtp, rpp, tie, do, num_layers
                )
    summary["experts"] = {
        f"t{tp}p{pp}e2->t{rtp}": check_expert_reshard(tp, pp, rtp) for tp, pp, rtp in EXPERT_CASES[world]
    }
    summary["split"] = {}
    for tp, pp, k, rtp, tie, bucket, *backend in SPLIT_CASES[world]:
        key = f"t{tp}p{pp}+{k} rollout t{rtp}{' tied' if tie else ''}{f' bucket {bucket}' if bucket else ''}"
        summary["split"][key + "".join(f" {b}" for b in backend)] = check_split(
            tp, pp, k, rtp, tie, bucket, *backend
        )
    if world == 2:
        summary["invalid"] = check_invalid()
        summary["in_place_after_repoint"] = check_repointed_after_build()
        summary["random_init"] = check_random_init_layout_invariant(
            [(2, 1, 4), (2, 2, 4), (2, 1, 3)], True, False
        )
        summary["random_init"] += check_random_init_layout_invariant([(2, 1, 4)], False, True)
    summary["seconds"] = round(time.perf_counter() - start, 2)
    if dist.get_rank() == 0:
        print("HYBRID_OK " + json.dumps(summary), flush=True)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
