"""engine.plot: a PNG from metrics.jsonl (records written here, as the trainer writes them)."""

import json

import pytest

from engine.tools.plot import _val_keys, main, read_metrics, write_plot

pytest.importorskip("matplotlib")


def _record(step, **extra):
    return {
        "step": step,
        "reward/mean": 0.1 * step,
        "reward/min": 0.0,
        "reward/max": 0.2 * step,
        "response_length/mean": 4.0 + step,
        "response_length/max": 5.0 + step,
        "actor/entropy": 1.0 / step,
        "actor/rollout_kl": 0.01,
        "timing/gen": 0.5,
        "timing/update_actor": 0.3,
        "timing/reward": 0.1,
        "timing/step": 0.9,
        **extra,
    }


def test_plot_writes_png_and_keeps_last_record_per_step(tmp_path):
    lines = [json.dumps(_record(1)), json.dumps(_record(2, **{"val/reward_mean": 0.3}))]
    lines += [
        '{"step": 3, "reward/me',
        json.dumps(_record(3)),
        json.dumps(_record(3, **{"reward/mean": 9.0})),
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["reward/mean"] == 9.0
    assert main([str(tmp_path)]) == 0
    png = (tmp_path / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    out = write_plot(str(tmp_path), str(tmp_path / "other.png"))
    assert out.endswith("other.png") and (tmp_path / "other.png").exists()


def test_plot_errors_name_the_file(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    assert "metrics.jsonl not found" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    assert main([str(tmp_path)]) == 1
    assert "holds no step" in capsys.readouterr().err


def test_plot_draws_every_validation_score():
    """The validation panel: rewards per data source and, with rollout.val_n = k > 1, mean@k/best@k/maj@k."""
    record = _record(
        2, **{"val/reward_mean": 0.3, "val/openai/gsm8k/reward": 0.3, "val/openai/gsm8k/reward_std": 0.1}
    )
    record.update({f"val/openai/gsm8k/{m}@4": 0.5 for m in ("mean", "best", "maj")})
    assert _val_keys([record]) == [
        "val/openai/gsm8k/best@4",
        "val/openai/gsm8k/maj@4",
        "val/openai/gsm8k/mean@4",
        "val/openai/gsm8k/reward",
        "val/reward_mean",
    ]
