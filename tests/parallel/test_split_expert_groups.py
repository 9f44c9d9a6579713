"""Split placement's expert groups (parallel/state.py `init_split_distributed`) equal the ones megatron's
parallel_state builds for the same training layout at parallel.ep=1 and expert TP 1, as the colocated path
uses: with sequence parallelism at parallel.tp > 1 each TP rank routes its own tokens through whole experts,
so the experts' gradients must be summed over TP x DP (expert data parallel), not over DP only.
World size 3: 2 training ranks (tp=2 with sp, or tp=1 and dp=2) + 1 rollout rank."""

from __future__ import annotations

import os

import pytest
from distributed import run_torchrun

SCRIPT = os.path.join(os.path.dirname(__file__), "split_expert_groups_script.py")


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 1)])
def test_split_expert_groups_match_megatron(tp, pp):
    run_torchrun(SCRIPT, 3, [str(tp), str(pp), "1"], timeout=300)
