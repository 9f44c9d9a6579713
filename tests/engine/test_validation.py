"""engine/step/validation.py: mean@k, best@k, maj@k by hand, answers from the built-in rules, the reward
extras per source as verl's process_validation_metrics averages them."""

import pytest
import torch

from engine.step.validation import per_source_means, prompt_values, response_answers, sample_metrics


def test_sample_metrics_by_hand():
    scores = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.5], [0.0, 1.0, 0.0]])  # (prompts, k)
    answers = ["7", "8", "7", "3", "4", "5", None, "9", "2"]
    out = sample_metrics(scores, answers)
    assert torch.allclose(out["mean@3"], torch.tensor([2 / 3, 0.5 / 3, 1 / 3]))
    assert out["best@3"].tolist() == [1.0, 0.5, 1.0]
    # prompt 0: "7" twice -> 1.0; prompt 1: a three-way tie, the first ("3") wins -> 0.0;
    # prompt 2: "9" and "2" tie, "9" seen first -> 1.0
    assert out["maj@3"].tolist() == [1.0, 0.0, 1.0]
    assert sample_metrics(scores[:1] * 0, [None, None, None])["maj@3"].tolist() == [0.0]
    # no answer anywhere: what the responses scored without one (math_dapo: -1, not 0)
    assert sample_metrics(torch.full((1, 3), -1.0), [None, None, None])["maj@3"].tolist() == [-1.0]
    assert "maj@3" not in sample_metrics(scores, None)


def test_response_answers_from_rules():
    texts = ["so #### 1,000", "#### 7.0", r"\boxed{\dfrac12}"]
    sources = ["openai/gsm8k", "openai/gsm8k", "lighteval/MATH"]
    assert response_answers(sources, texts, "strict") == ["1000", "7.0", r"\frac{1}{2}"]
    assert response_answers(sources, texts, "numeric") == ["1000", "7", r"\frac{1}{2}"]
    assert response_answers(["my/source", "lighteval/MATH"], texts[1:], "strict") is None  # no rule: no vote


def test_reward_extras_per_source_as_verl(gloo_world):
    """DAPO-Math's acc: verl's val-core/<source>/acc/mean@N is, per source, the mean over prompts of each
    prompt's mean over its N responses. Here the one response per prompt (N = 1) and k = 2 sampled ones; a
    GSM8K prompt (a float rule: acc NaN) gets no acc and does not dilute math_dapo's."""
    nan = float("nan")
    sources = ["math_dapo", "math_dapo", "openai/gsm8k"]
    scores = [torch.tensor([1.0, -1.0, 1.0]), torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, 0.0])]
    extras = [{"acc": torch.tensor([1.0, 0.0, nan])}, {"acc": torch.tensor([1.0, 0.0, 0.0, 0.0, nan, nan])}]
    values = prompt_values(2, scores, extras, None)
    torch.testing.assert_close(values["extra/acc/mean@2"], torch.tensor([0.5, 0.0, nan]), equal_nan=True)
    out = per_source_means([(sources, values)], gloo_world)
    # verl, by hand: math_dapo acc/mean@1 = mean(1, 0); acc/mean@2 = mean(mean(1, 0), mean(0, 0))
    assert out["val/math_dapo/extra/acc"] == pytest.approx(0.5)
    assert out["val/math_dapo/extra/acc/mean@2"] == pytest.approx(0.25)
    assert out["val/math_dapo/reward"] == 0.0 and out["val/math_dapo/mean@2"] == pytest.approx(-0.5)
    assert out["val/openai/gsm8k/reward"] == 1.0 and not any("gsm8k/extra" in key for key in out)
