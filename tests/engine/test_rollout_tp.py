"""Rollout on real training shards: world size 2 (gloo), one launch of tests/engine/rollout_tp_script.py.

Training layout TP=2; rollout.tp 2 (the training shards themselves) and 1 (regrouped by the 3D-HybridEngine,
prompts split over the micro-DP group). Checks: greedy == transformers, rollout log-probs == the actor's
training forward (MegatronRole.run + log_prob_fn) within 1e-4 in float32, a turn continued from the kept KV
cache == a full prefill, identical outputs on both ranks, and the vLLM weight loader against vLLM's sharding
rules. See the script's docstring.
"""

from __future__ import annotations

import json
from pathlib import Path

import hf_tiny
import pytest
from distributed import run_torchrun

SCRIPT = str(Path(__file__).with_name("rollout_tp_script.py"))


@pytest.mark.slow
def test_world2_rollout_tp2_and_tp1_match_transformers_and_training_forward(tmp_path):
    for i, family in enumerate(("qwen2", "llama")):
        hf_tiny.save_tiny(family, str(tmp_path / family), seed=i)
    out = run_torchrun(SCRIPT, 2, [str(tmp_path)])
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT {" in line]
    assert {(r["family"], r["rollout_tp"]) for r in results} == {
        (f, t) for f in ("qwen2", "llama") for t in (2, 1)
    }
    for r in results:
        assert r["greedy_equal"] and r["greedy_logp_diff"] < 1e-4 and r["sampled_logp_diff"] < 1e-4, r
        assert r["continued_logp_diff"] < 1e-4, r  # the next turn from the kept KV cache == a full prefill
    # vocab 101: megatron pads to 102 (51 rows per rank), vLLM to 128 (64 rows): rank 0 receives 13 rows
    tp2 = [r for r in results if r["rollout_tp"] == 2]
    assert all(r["vllm_vocab_bytes_received"] > 0 for r in tp2)
