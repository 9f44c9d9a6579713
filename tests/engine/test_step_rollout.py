"""engine/step/rollout.py: the data rows' response budgets (`max_new_tokens` column) in the step's rollouts.

World size 1, in this process (tests/engine/trainer_jobs.py builds a real job: tiny megatron actor,
native rollout engine, gloo group); the prompts come from a real parquet file with the column.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
from trainer_jobs import built_job

from engine.metrics import PhaseTimer
from engine.roles.dynamic_batch import MicroBatcher
from engine.rollout.base import SamplingParams
from engine.step.context import StepContext
from engine.step.rollout import rollout, share_sampling
from engine.tasks.embedded import build_embedded_tokenizer

CAPS = (3, None, 1, 6, None, 2, 5, 4)  # None: rollout.max_new_tokens (6)


def test_share_sampling_cuts_the_limits_of_a_micro_dp_share():
    sampling = SamplingParams(max_new_tokens=6, max_new_tokens_per_prompt=(3, 6, 1, 2))
    assert share_sampling(sampling, 2, 4).max_new_tokens_per_prompt == (1, 2)
    plain = SamplingParams(max_new_tokens=6)
    assert share_sampling(plain, 1, 3) is plain


def test_row_caps_stop_training_and_validation_responses(tmp_path):
    """With EOS ignored every response of a capped row has exactly its cap tokens (finish reason "length"),
    the others rollout.max_new_tokens; in the sampled (n=2) and the validation (greedy) rollouts alike."""
    rows = [
        {
            "prompt": [{"role": "user", "content": f"copy {i}{i}"}],
            "data_source": "embedded/copy",
            "reward_model": {"ground_truth": f"{i}{i}", "style": "rule"},
            "extra_info": {"index": i},
            "max_new_tokens": cap,
        }
        for i, cap in enumerate(CAPS)
    ]
    path = str(tmp_path / "caps.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    tok = build_embedded_tokenizer(str(tmp_path / "tok"))
    overrides = [
        f"data.train_files=[{path}]",
        f"data.val_files=[{path}]",
        f"model.tokenizer_path={tok}",
        "data.batch_size=8",
        "rollout.n=2",
        "rollout.max_new_tokens=6",
        "rollout.ignore_eos=true",
    ]
    with built_job(overrides, str(tmp_path / "run")) as c:
        ctx = StepContext(c, MicroBatcher(4, 0, 1, c.groups.device), 0, PhaseTimer(c.groups.device))
        records = c.loader.next_batch()
        val_records = [r for batch in c.val_batches for r in batch]
        sample = rollout(ctx, records, ("sample",))[0]
        val = rollout(ctx, val_records, ("val",))[0]
    for out, recs, n in ((sample, records, 2), (val, val_records, 1)):
        want = [6 if r.max_new_tokens is None else r.max_new_tokens for r in recs for _ in range(n)]
        assert out.response_mask.sum(-1).long().tolist() == want
        assert out.finish_reasons == ["length"] * len(want) and out.response_ids.shape[1] == 6
    assert sorted(r.max_new_tokens or 0 for r in records) == sorted(cap or 0 for cap in CAPS)
