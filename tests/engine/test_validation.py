"""engine/step/validation.py: mean@k, best@k, maj@k by hand, answers from the built-in rules."""

import torch

from engine.step.validation import response_answers, sample_metrics


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
