"""The actor's output head on the fused path: the GPTModel returns its final hidden states instead of
logits, and the per-token log-probs and entropy of the response tokens come from
`engine/models/fused_logprobs.linear_log_probs` on those positions only.

`hidden_states_output(models)` swaps, for the duration of a block, the forward of the model's output layer (a megatron
ColumnParallelLinear; its weight, name and checkpoint entry stay as they are) for the TP mapping that
layer applies to its input: with sequence parallelism the all-gather of the sequence (reduce-scatter of
the gradient), otherwise the identity whose backward all-reduces the gradient over the TP group. GPTModel
then transposes the (s, b, hidden) result to (b, s, hidden) as it would the logits.

The identity is ours, not megatron's `copy_to_tensor_model_parallel_region`: its backward (0.16.1,
tensor_parallel/mappings.py `_reduce`) all-reduces `grad.contiguous()` and returns the original `grad`,
so a non-contiguous gradient (the one GPTModel's transpose hands back here) silently goes unreduced.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from engine.models.fused_logprobs import linear_log_probs, linear_log_probs_one_pass


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient (made contiguous first) over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.group.size() > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


@contextlib.contextmanager
def hidden_states_output(models: list[torch.nn.Module]):
    """Within the block, each GPTModel in `models` that holds the last pipeline stage returns (b, s, hidden)
    final hidden states instead of logits; outside it the models are untouched (HF export, parity, tools)."""
    patched = [m.output_layer for m in models if m.post_process]
    for layer in patched:
        layer.forward = _hidden_forward(layer)
    try:
        yield
    finally:
        for layer in patched:
            del layer.forward  # the class's forward again


def _hidden_forward(layer):
    group = layer.tp_group

    def forward(input_, weight=None, runtime_gather_output=None):
        if layer.sequence_parallel:
            return gather_from_sequence_parallel_region(
                input_, tensor_parallel_output_grad=True, group=group
            ), None
        return _CopyToTensorParallel.apply(input_, group), None

    return forward


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """This rank's (vocab_padded / tp, hidden) output projection: the embedding when they are tied."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def packed_at(mb: dict, pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Packed positions of the row-local positions `pos` of rows `rows` (broadcast together) of a packed
    micro-batch: from each row's start (`row_starts`, engine/roles/dynamic_batch.py); where the rows share
    their prompts (engine/roles/shared_prompts.py) a prompt position p < P from the prompt's one copy
    (`prompt_starts`), a response position from where the row's response would start were its prompt in
    front of it (`row_starts`)."""
    at = mb["row_starts"][rows] + pos
    if "prompt_starts" in mb:
        at = torch.where(pos < mb["row_prompt_lens"][rows], mb["prompt_starts"][rows] + pos, at)
    return at


def gather_rows(x: torch.Tensor, mb: dict, index: torch.Tensor) -> torch.Tensor:
    """(rows, T, ...) entries of `x` at the row-local positions `index` (rows, T) of the micro-batch's rows:
    x (b, s, ...) row by row when padded; x (1, t, ...) at `packed_at` when packed
    (engine/roles/dynamic_batch.py)."""
    if "row_starts" in mb:
        rows = torch.arange(index.shape[0], device=index.device)[:, None]
        return x[0][packed_at(mb, index, rows)]
    return x.gather(1, index.reshape(*index.shape, *(1,) * (x.dim() - 2)).expand(*index.shape, *x.shape[2:]))


def unpack_rows(x: torch.Tensor, mb: dict) -> torch.Tensor:
    """A packed micro-batch's (1, t, ...) output as (rows, s, ...), s its longest row, each row from position
    0 and its last entry repeated past its end; a padded micro-batch's (b, s, ...) output as it is."""
    if "row_starts" not in mb:
        return x
    lengths = mb["row_lengths"]
    steps = torch.arange(int(lengths.max()), device=lengths.device)
    return gather_rows(x, mb, torch.minimum(steps[None], lengths[:, None] - 1))


def _head_rows(hidden: torch.Tensor, mb: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(hidden rows, their targets, valid) the head runs on: with `response_valid` the valid response tokens
    in flat (b, T) order, else every (row, step) entry; `valid` as in mb (None: every entry)."""
    index = mb["response_index"]
    valid = mb.get("response_valid")
    if valid is None:
        h = gather_rows(hidden, mb, index)
        if "row_starts" in mb:
            target_index = torch.minimum(index + 1, mb["row_lengths"][:, None] - 1)
        else:
            target_index = index + 1
        targets = gather_rows(mb["tokens"], mb, target_index)
        return h.reshape(-1, h.shape[-1]), targets.reshape(-1), None
    rows = valid // index.shape[1]  # (valid,) row of each valid token
    pos = index.reshape(-1)[valid]  # (valid,) its row-local position
    if "row_starts" in mb:
        h = hidden[0][packed_at(mb, pos, rows)]
        targets = mb["tokens"][0][packed_at(mb, torch.minimum(pos + 1, mb["row_lengths"][rows] - 1), rows)]
    else:
        h = hidden[rows, pos]
        targets = mb["tokens"][rows, pos + 1]
    return h, targets, valid


def _as_response(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """The head's flat per-token values as (b, T): 0 at the entries it did not run on."""
    if valid is None:
        return x.view(index.shape)
    return x.new_zeros(index.numel()).index_copy(0, valid, x).view(index.shape)


def response_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    mb: dict,
    *,
    temperature: float,
    vocab_size: int,
    tp_group,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies) (b, T) float32 of each row's response tokens: position response_index[r, j]
    (the prompt's last token + j) predicts token response_index[r, j] + 1 (kept inside the row when packed).
    `hidden` is (b, s, hidden), or (1, t, hidden) for a packed micro-batch. With `response_valid` (the flat
    indices of the response mask's True entries, engine/roles/dynamic_batch.py) the head runs on those
    tokens only and the other entries are 0: rows that end early cost no output-layer work past their end."""
    h, targets, valid = _head_rows(hidden, mb)
    logp, ent = linear_log_probs(
        h, weight, targets, temperature=temperature, vocab_size=vocab_size, tp_group=tp_group
    )
    return tuple(_as_response(x, mb["response_index"], valid) for x in (logp, ent))


def response_token_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    mb: dict,
    token_grads,
    *,
    grad_scale: torch.Tensor | float,
    temperature: float,
    vocab_size: int,
    tp_group,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`response_token_stats` with the loss's gradient in the same pass (engine/models/fused_logprobs.py
    `linear_log_probs_one_pass`): (log-probs, entropies, anchor), the first two without gradient, the anchor a
    float32 zero to add to the loss. `token_grads(mb, valid)` builds the loss's per-token gradient over the
    head's tokens: `valid` (mb's `response_valid`) or, when None, every (row, step) entry in order."""
    h, targets, valid = _head_rows(hidden, mb)
    anchor, logp, ent = linear_log_probs_one_pass(
        h,
        weight,
        targets,
        token_grads(mb, valid),
        grad_scale=grad_scale,
        temperature=temperature,
        vocab_size=vocab_size,
        tp_group=tp_group,
    )
    index = mb["response_index"]
    return _as_response(logp, index, valid), _as_response(ent, index, valid), anchor
