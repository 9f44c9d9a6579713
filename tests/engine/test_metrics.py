"""PhaseTimer (no processes): per-phase seconds everywhere, per-phase peak memory on CUDA only; the step's
rollout statistics (engine/step/stats.py, on a gloo world of one) against verl's formulas by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from engine.metrics import PhaseTimer
from engine.step.batch import REWARD_EXTRA, Experience
from engine.step.stats import rollout_metrics


def test_cpu_timer_has_seconds_and_no_memory_keys():
    timer = PhaseTimer(torch.device("cpu"))
    with timer.phase("gen"):
        torch.zeros(1000)
    with timer.phase("gen"):
        pass
    metrics = timer.as_metrics()
    assert set(metrics) == {"timing/gen"} and metrics["timing/gen"] >= 0


@pytest.mark.gpu
def test_cuda_timer_reports_each_phase_own_peak():
    device = torch.device("cuda")
    timer = PhaseTimer(device)
    with timer.phase("big"):
        x = torch.empty(2**28, dtype=torch.uint8, device=device)  # 0.25 GiB, freed below
        del x
    with timer.phase("small"):
        y = torch.empty(2**20, dtype=torch.uint8, device=device)
        del y
    m = timer.as_metrics()
    assert m["perf/max_memory_allocated_gb/big"] >= 0.25
    assert m["perf/max_memory_allocated_gb/small"] < m["perf/max_memory_allocated_gb/big"] - 0.2


def test_resume_drops_lines_logged_after_the_checkpoint(tmp_path):
    import json

    from engine.metrics import MetricsLogger

    logger = MetricsLogger(str(tmp_path), ["jsonl"], enabled=True, total_steps=6, progress_bar=False)
    for step in range(1, 6):
        logger.log(step, {"reward/mean": float(step)})
    logger.resume_at(3)  # the crashed run had logged steps 4-5 past its step-3 checkpoint
    logger.log(4, {"reward/mean": 40.0})
    logger.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["reward/mean"] == 40.0


def test_resume_drops_a_line_cut_by_a_kill(tmp_path, capsys):
    """A kill (or a full disk) mid-write leaves a cut last line: resuming drops it and says so, instead of
    failing to parse it; the bar of a resumed run starts at its step."""
    import json

    from engine.metrics import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in (1, 2, 3)))
    with open(path, "a") as f:
        f.write('{"step": 4, "reward/me')
    logger = MetricsLogger(str(tmp_path), ["jsonl"], enabled=True, total_steps=6, progress_bar=True)
    logger.resume_at(2)
    assert logger._bar.n == 2
    logger.log(3, {"reward/mean": 3.0})
    logger.close()
    assert [json.loads(line)["step"] for line in open(path)] == [1, 2, 3]
    assert "dropped 1 unreadable line" in capsys.readouterr().out


def _experience(response_mask: torch.Tensor, finished: list[float], **tensors) -> Experience:
    rows, width = response_mask.shape
    return Experience(
        tokens=torch.zeros(rows, width + 2, dtype=torch.long),
        prompt_lens=torch.ones(rows, dtype=torch.long),
        response_ids=torch.zeros(rows, width, dtype=torch.long),
        response_mask=response_mask,
        group_index=torch.arange(rows),
        tensors={"scores": torch.zeros(rows), "finished": torch.tensor(finished), **tensors},
    )


def test_clip_ratio_is_verls_and_truncated_ratio_counts_every_limit(gloo_world):
    """response_length/clip_ratio = verl's compute_data_metrics: mean(response_length == max_response_length),
    the length counted by the attention mask (a multi-turn episode's tool tokens included) and the maximum
    being the response width (here 4 = the configured max_response_len). truncated_ratio = 1 - finished."""
    response_mask = torch.tensor(
        [
            [1, 1, 1, 1],  # cut at the global maximum
            [1, 1, 1, 1],  # its stop token is the 4th: verl counts it as clipped too
            [1, 1, 0, 0],  # cut at its prompt's own max_new_tokens=2: truncated, not clipped
            [1, 0, 0, 0],  # stopped
            [1, 0, 0, 1],  # an episode: a tool turn (mask 0) inside, 4 tokens in all
        ],
        dtype=torch.float32,
    )
    finished = [0.0, 1.0, 0.0, 1.0, 1.0]
    # verl: attention_mask over the response (1 on tool tokens too) summed per row
    verl_attention_mask = torch.tensor([[1] * 4, [1] * 4, [1, 1, 0, 0], [1, 0, 0, 0], [1] * 4])
    verl_clip = torch.mean(torch.eq(verl_attention_mask.sum(-1).float(), 4).float()).item()
    assert verl_clip == pytest.approx(3 / 5)
    groups = SimpleNamespace(dp=gloo_world, device=torch.device("cpu"), dims=SimpleNamespace(dp=1))
    out = rollout_metrics(_experience(response_mask, finished), groups, False, max_response_len=4)
    assert out["response_length/clip_ratio"] == pytest.approx(verl_clip)
    assert out["response_length/truncated_ratio"] == pytest.approx(2 / 5)
    assert out["response_length/max"] == 4 and out["response_length/mean"] == pytest.approx(13 / 5)
    # a larger configured maximum: nothing reached it, whatever was cut
    out = rollout_metrics(_experience(response_mask, finished), groups, False, max_response_len=8)
    assert out["response_length/clip_ratio"] == 0.0 and out["response_length/truncated_ratio"] == 0.4


def test_reward_extras_leave_out_rows_without_the_key(gloo_world):
    """reward/extra/<key>: the mean over the rows that have the key (NaN: that row's output lacked it, e.g. a
    float-scoring rule's row among DAPO-Math's)."""
    acc = torch.tensor([1.0, math.nan, 0.0, 1.0])
    exp = _experience(torch.ones(4, 2), [1.0] * 4, **{f"{REWARD_EXTRA}acc": acc})
    groups = SimpleNamespace(dp=gloo_world, device=torch.device("cpu"), dims=SimpleNamespace(dp=1))
    assert rollout_metrics(exp, groups, False, max_response_len=2)["reward/extra/acc"] == pytest.approx(2 / 3)
    # no row of the step returned the key: NaN, not a measured 0.0
    exp = _experience(torch.ones(4, 2), [1.0] * 4, **{f"{REWARD_EXTRA}acc": torch.full((4,), math.nan)})
    assert math.isnan(rollout_metrics(exp, groups, False, max_response_len=2)["reward/extra/acc"])
