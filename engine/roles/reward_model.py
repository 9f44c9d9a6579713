"""A frozen Megatron reward model (`reward.model_path`): a Hugging Face *ForSequenceClassification or
*ForTokenClassification checkpoint with a one-label `score` head, built in the actor's training layout with
a value head and scored at the last valid token of prompt + response.

It reads the actor's token ids as they are: the reward model must share the actor's tokenizer (checked only
as "its vocabulary holds the tokenizer's"). A sequence classifier pools at the last non-pad token; with
right-padded rows that is the same position, so the score equals transformers' on the unpadded sequence.
This module must not train or save the model: it is built with `optim=None` and left out of checkpoints.
"""

from __future__ import annotations

import json
import os

import torch

from engine.roles.dynamic_batch import MicroBatcher
from engine.roles.policy import MegatronRole
from engine.step.batch import build_experience, response_lengths
from engine.step.update import forward_rows

CLASSIFIER_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification")


def check_reward_model_dir(path: str) -> str | None:
    """Why `path` cannot be a reward model (None when it can): a directory whose config.json names a
    sequence/token classifier with one label."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        return "is not a directory"
    if not os.path.isfile(config_file):
        return "has no config.json"
    with open(config_file) as f:
        hf = json.load(f)
    archs = hf.get("architectures") or []
    if not any(a.endswith(CLASSIFIER_SUFFIXES) for a in archs):
        return (
            f"config.json architectures={archs} is not a *ForSequenceClassification/*ForTokenClassification"
        )
    num_labels = len(hf.get("id2label") or {"0": ""})
    if num_labels != 1:
        return f"config.json has {num_labels} labels; a reward model has one (num_labels=1)"
    return None


def last_token_value_fn(values_local: torch.Tensor, mb: dict):
    """Forward-only: the value head (b, s, 1) at each row's last valid token, position prompt_len + L - 1
    (response_index[:, 0] is prompt_len - 1, never clamped). Returned as (b, T) with the score repeated along
    T, the shape `forward_rows` reassembles; the caller keeps column 0."""
    lengths = response_lengths(mb["response_mask"])
    last = mb["response_index"][:, 0] + lengths  # (b,)
    score = values_local[..., 0].gather(1, last[:, None])  # (b, 1)
    return torch.zeros((), device=score.device), {"score": score.expand_as(mb["response_mask"]).detach()}


class RewardModel:
    """Scores (prompt, response) token ids with a frozen value-head model in the training layout."""

    def __init__(self, role: MegatronRole, pad_id: int, seq_multiple: int):
        self.role, self.pad_id, self.seq_multiple = role, pad_id, seq_multiple

    def __call__(
        self,
        prompts: list[list[int]],
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        n: int,
        batcher: MicroBatcher,
    ) -> torch.Tensor:
        """(rows,) float32 scores of `n` responses per prompt, rows adjacent per prompt (every rank of the
        model-parallel group passes the same rows; zero rows skip the forward on all of them)."""
        rows = response_ids.shape[0]
        if rows == 0:
            return torch.zeros(0, dtype=torch.float32)
        exp = build_experience(
            prompts,
            response_ids,
            response_mask,
            list(range(len(prompts))),
            n,
            self.pad_id,
            seq_multiple=self.seq_multiple,
        )
        return forward_rows(self.role, exp, last_token_value_fn, "score", batcher)[:, 0]
