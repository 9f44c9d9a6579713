"""One step's experience on a training DP replica: the scored responses of a rollout (`Responses`, which
dynamic sampling filters and concatenates by prompt group) and the training-side layout (`Experience`).
Micro-batches are cut by engine/roles/dynamic_batch.py.

Sequences are laid out right-padded from position 0: [prompt, response, pad...], so a causal mask alone is
exact for every valid token (no attention mask, no position shifts). Response-aligned tensors (b, T) index
response token j of row r; its log-prob comes from the logits at sequence position prompt_len[r] + j - 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.rewards.reward_fn import concat_extras
from engine.rollout.routes import cat_routes, routes_for_sequences


def response_valid(response_mask: torch.Tensor) -> torch.Tensor:
    """(valid,) flat indices of the True entries of a (rows, T) response mask, found on the host where the
    micro-batch is cut, so the output head computes valid tokens only without a device sync."""
    return response_mask.reshape(-1).nonzero()[:, 0]


def row_fields(exp: Experience, sel: torch.Tensor, index: torch.Tensor, keys, device) -> dict:
    """The per-row entries of a micro-batch of rows `sel`: `response_index` (the positions `index` (rows, T)
    whose hidden states predict each response token), `response_mask`, `response_valid`, `rows` and the named
    tensors `keys`."""
    fields = {
        "response_index": index.to(device),
        "response_mask": exp.response_mask[sel].to(device),
        "response_valid": response_valid(exp.response_mask[sel]).to(device),
        "rows": sel,
    }
    for key in keys:
        fields[key] = exp.tensors[key][sel].to(device)
    return fields


def packed_response_index(exp: Experience, sel: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`response_index` of packed rows `sel` of real `lengths`: row-local, kept inside the row (valid entries
    are never clamped: prompt_len - 1 + j < length)."""
    steps = torch.arange(exp.response_ids.shape[1])
    return torch.minimum(exp.prompt_lens[sel, None] - 1 + steps, lengths[:, None] - 1)


def response_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """(rows,) int64 tokens of each response: one past its last mask-1 position. Equals the mask's sum for
    single-turn responses; a multi-turn episode's mask also has 0 on the tool tokens inside it."""
    if response_mask.shape[-1] == 0:
        return response_mask.sum(-1).long()
    steps = torch.arange(1, response_mask.shape[-1] + 1, device=response_mask.device)
    return torch.where(response_mask > 0, steps, 0).amax(-1)


@dataclass
class Experience:
    """Rows = (prompts of this DP replica) x n, the n samples of a prompt adjacent."""

    tokens: torch.Tensor
    """(rows, seq) int64: prompt + response, right-padded."""
    prompt_lens: torch.Tensor
    """(rows,) int64."""
    response_ids: torch.Tensor
    """(rows, T) int64, right-padded."""
    response_mask: torch.Tensor
    """(rows, T) float32: 1 on the tokens trained on (generated ones), 0 on padding and on the tool turns
    inside a multi-turn episode (in the sequence as context, never in a loss, KL or entropy)."""
    group_index: torch.Tensor
    """(rows,) int64: prompt group of each row, unique within the step (GRPO groups)."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-row or response-aligned tensors added by later phases (scores, advantages, old/ref log-probs,
    values), and `rollout_log_probs` (rows, T) when the rollout returned them (rollout.log_probs; absent
    otherwise, never filled in)."""

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    def response_index(self) -> torch.Tensor:
        """(rows, T) position in `tokens` of the logits that predict each response token."""
        steps = torch.arange(self.response_ids.shape[1], device=self.tokens.device)
        return (self.prompt_lens[:, None] - 1 + steps).clamp(max=self.tokens.shape[1] - 2)


def build_experience(
    prompts: list[list[int]],
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: list[int],
    n: int,
    pad_id: int,
    seq_multiple: int = 1,
) -> Experience:
    """Assemble right-padded sequences; `seq_multiple` rounds the length up (TP with sequence parallelism)."""
    rows = response_ids.shape[0]
    lengths = response_lengths(response_mask)
    prompt_lens = torch.tensor([len(prompts[r // n]) for r in range(rows)], dtype=torch.long)
    seq = int((prompt_lens + lengths).max()) + 1  # +1: the last valid position still has a target slot
    seq = -(-seq // seq_multiple) * seq_multiple
    tokens = torch.full((rows, seq), pad_id, dtype=torch.long)
    for r in range(rows):
        p, length = int(prompt_lens[r]), int(lengths[r])
        tokens[r, :p] = torch.tensor(prompts[r // n])
        tokens[r, p : p + length] = response_ids[r, :length]
    group = torch.tensor([group_ids[r // n] for r in range(rows)], dtype=torch.long)
    return Experience(tokens, prompt_lens, response_ids, response_mask, group)


@dataclass
class Responses:
    """Scored rollout of some prompts: `n` rows per prompt, adjacent; response tensors right-padded."""

    records: list
    """PromptRecord per prompt (group)."""
    n: int
    """Rows per prompt."""
    response_ids: torch.Tensor
    """(rows, T) int64."""
    response_mask: torch.Tensor
    """(rows, T) float32."""
    log_probs: torch.Tensor | None
    """(rows, T) float32, from the rollout engine; None with rollout.log_probs=false."""
    finished: torch.Tensor
    """(rows,) float32: 1 where the response ended with a stop token."""
    scores: torch.Tensor
    """(rows,) float32: the reward function's score."""
    overlong_penalty: torch.Tensor | None = None
    """(rows,) <= 0, DAPO's overlong shaping (None = off)."""
    baseline_scores: torch.Tensor | None = None
    """(rows,) ReMax: shaped score of the greedy response to the row's prompt."""
    reward_extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """(rows,) float32 per extra numeric key of a reward function's dict outputs (logged, not trained on); NaN
    where a row's output lacked the key."""
    staleness: torch.Tensor | None = None
    """(rows,) float32: actor updates between the weights that generated the row and those it trains
    (split placement, engine/split/; None elsewhere: generated by the weights being trained)."""
    routed_experts: torch.Tensor | None = None
    """(rows, positions, layers, top_k) int16: the rollout's expert choices (algorithm.router_replay;
    engine/rollout/routes.py), None otherwise."""

    @property
    def num_groups(self) -> int:
        return len(self.records)

    def shaped_scores(self) -> torch.Tensor:
        """(rows,) what the advantages see: score + overlong penalty."""
        return self.scores if self.overlong_penalty is None else self.scores + self.overlong_penalty

    def select(self, groups: list[int]) -> Responses:
        """The given prompt groups, in that order."""
        rows = torch.tensor([g * self.n + j for g in groups for j in range(self.n)], dtype=torch.long)
        pick = {f: getattr(self, f) for f in _ROW_FIELDS}
        return Responses(
            records=[self.records[g] for g in groups],
            n=self.n,
            **{f: None if t is None else t[rows] for f, t in pick.items()},
            reward_extras={k: v[rows] for k, v in self.reward_extras.items()},
            routed_experts=None if self.routed_experts is None else self.routed_experts[rows],
        )

    @staticmethod
    def concat(parts: list[Responses]) -> Responses:
        """Groups of all parts in order; response tensors padded to the widest part."""
        width = max(p.response_ids.shape[1] for p in parts)

        def cat(field_name: str) -> torch.Tensor | None:
            tensors = [getattr(p, field_name) for p in parts]
            if any(t is None for t in tensors):
                return None
            if tensors[0].dim() == 2:
                tensors = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors]
            return torch.cat(tensors)

        return Responses(
            records=[r for p in parts for r in p.records],
            n=parts[0].n,
            **{f: cat(f) for f in _ROW_FIELDS},
            reward_extras=concat_extras([p.reward_extras for p in parts], [len(p.scores) for p in parts]),
            routed_experts=cat_routes([p.routed_experts for p in parts]),
        )


_ROW_FIELDS = (
    "response_ids",
    "response_mask",
    "log_probs",
    "finished",
    "scores",
    "overlong_penalty",
    "baseline_scores",
    "staleness",
)


ROUTES = "routed_experts"
"""`Experience.tensors` key of the rollout's expert choices, (rows, seq, layers, top_k) int16 aligned to
`tokens` (-1: not routed by the rollout)."""

REWARD_EXTRA = "reward_extra/"
"""`Experience.tensors` key prefix of the reward function's numeric extras."""


def experience_from(
    resp: Responses, dp_rank: int, pad_id: int, seq_multiple: int, rollout_log_probs: bool
) -> Experience:
    """The training layout of this replica's scored responses, with their per-row tensors (scores, finished,
    rollout log-probs, overlong penalty, greedy baseline, reward extras)."""
    first_group = dp_rank * resp.num_groups  # group ids unique over replicas and refill rounds
    exp = build_experience(
        [r.prompt_ids for r in resp.records],
        resp.response_ids,
        resp.response_mask,
        list(range(first_group, first_group + resp.num_groups)),
        resp.n,
        pad_id,
        seq_multiple=seq_multiple,
    )
    exp.tensors.update(finished=resp.finished, scores=resp.scores)
    if rollout_log_probs:
        exp.tensors["rollout_log_probs"] = resp.log_probs
    if resp.overlong_penalty is not None:
        exp.tensors["overlong_penalty"] = resp.overlong_penalty
    if resp.baseline_scores is not None:
        exp.tensors["baseline_scores"] = resp.baseline_scores
    if resp.staleness is not None:
        exp.tensors["staleness"] = resp.staleness
    if resp.routed_experts is not None:  # aligned to `tokens` (engine/roles/router_replay.py)
        exp.tensors[ROUTES] = routes_for_sequences(resp.routed_experts, exp.tokens.shape[1])
    exp.tensors.update({f"{REWARD_EXTRA}{k}": v for k, v in resp.reward_extras.items()})
    return exp
