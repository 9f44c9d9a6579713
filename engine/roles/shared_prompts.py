"""Packed micro-batches that hold each group's prompt once (trainer.share_prompts).

A GRPO-style step samples n responses per prompt, and packed as n full rows a micro-batch computes each
prompt's tokens n times, though in a causal model they compute the same in every row (they attend only to
the prompt). Here the rows of a micro-batch that share a prompt form one unit: the prompt's tokens once,
each response's tokens (its positions continuing from the prompt's end), and each response attends to that
one copy of the prompt (engine/models/shared_prompt_attention.py). A micro-batch lays out every unit's prompt
first (the prompts block), then every unit's responses in the same unit order (the responses block), then any
padding: where every unit has one shape the two blocks are dense batches, which cuDNN's attention takes as
views (engine/models/shared_prompt_split.py). The model then skips (n - 1) / n
of the prompt tokens for the same log-probs, values and gradients (the prompt's gradient is the sum of what
its responses send back, as the rows' sum is). At 256-token prompts and 512-token responses, n = 8: 29%
fewer tokens through every layer.

Cutting: the batch's rows are grouped by identical prompt tokens; a group costs its prompt plus its responses
in tokens; groups are packed first-fit decreasing under the micro-batch budget (engine/roles/dynamic_batch.py),
a group larger than the budget split into parts of whole rows, each with its own copy of the prompt. The
output head and the value head find a row's positions through `row_starts` (where its response would start
were its prompt in front of it: a response token at row-local position p >= P lies at row_starts + p) and
`prompt_starts` (p < P: the shared prompt), engine/models/output_head.py `packed_at`.
"""

from __future__ import annotations

import itertools

import torch

from engine.models.shared_prompt_attention import SHARED_POSITIONS, SharedPromptSeqParams
from engine.models.shared_prompt_split import CrossSegments
from engine.step.batch import Experience, packed_response_index, row_fields


def prompt_groups(exp: Experience, rows: list[int]) -> list[list[int]]:
    """`rows` (Experience row ids) grouped by identical prompt tokens, groups and rows in first-seen order."""
    groups: dict[bytes, list[int]] = {}
    for r in rows:
        key = exp.tokens[r, : int(exp.prompt_lens[r])].numpy().tobytes()
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def unit_tokens(exp: Experience, unit: list[int], lengths: dict[int, int]) -> int:
    """Tokens of a unit laid out once: its prompt plus each row's response."""
    prompt = int(exp.prompt_lens[unit[0]])
    return prompt + sum(lengths[r] - prompt for r in unit)


def split_group(exp: Experience, group: list[int], lengths: dict[int, int], budget: int) -> list[list[int]]:
    """A group's rows in parts of whole rows whose unit tokens stay within `budget` (a row alone may not)."""
    prompt = int(exp.prompt_lens[group[0]])
    parts: list[list[int]] = []
    tokens = 0  # the last part's unit tokens
    for r in group:
        response = lengths[r] - prompt
        if parts and tokens + response <= budget:
            parts[-1].append(r)
            tokens += response
        else:
            parts.append([r])
            tokens = prompt + response
    return parts


def shared_prompt_micro_batch(
    exp: Experience,
    units: list[list[int]],
    lengths: dict[int, int],
    multiple: int,
    keys,
    device: torch.device,
) -> dict:
    """One micro-batch of `units` (each: rows of one prompt), in the layout of the module docstring: the
    packed micro-batch dict of engine/roles/dynamic_batch.py, with `SharedPromptSeqParams`, `prompt_starts`
    and `row_prompt_lens`; `rows` in the order laid out."""
    prompts = [int(exp.prompt_lens[unit[0]]) for unit in units]
    pieces, positions, q_lens, kv, k_lens = [], [], [], [], []
    prompt_starts_of = [0, *itertools.accumulate(prompts)]
    for unit, prompt, start in zip(units, prompts, prompt_starts_of):  # the prompts block
        pieces.append(exp.tokens[unit[0], :prompt])
        positions.append(torch.arange(prompt))
        if prompt:  # no empty segments: not every attention kernel takes them
            q_lens.append(prompt)
            kv.append(torch.arange(start, start + prompt))
            k_lens.append(prompt)
    rows, row_starts, prompt_starts, prompt_lens, responses = [], [], [], [], []
    cursor = prompt_starts_of[-1]
    for unit, prompt, start in zip(units, prompts, prompt_starts_of):  # the responses block
        for r in unit:
            response = lengths[r] - prompt
            pieces.append(exp.tokens[r, prompt : lengths[r]])
            positions.append(torch.arange(prompt, lengths[r]))
            if response:
                q_lens.append(response)
                kv.append(
                    torch.cat([torch.arange(start, start + prompt), torch.arange(cursor, cursor + response)])
                )
                k_lens.append(prompt + response)
            rows.append(r)
            row_starts.append(cursor - prompt)  # may be negative: only response positions p >= prompt use it
            prompt_starts.append(start)
            prompt_lens.append(prompt)
            responses.append(response)
            cursor += response
    uniform = uniform_shape(units, prompts, responses)
    cross = cross_segments(units, prompts, responses, device)
    t = -(-cursor // multiple) * multiple
    if t > cursor:  # the padding: a pseudo-row of its own
        pieces.append(torch.zeros(t - cursor, dtype=exp.tokens.dtype))
        positions.append(torch.arange(t - cursor))
        q_lens.append(t - cursor)
        kv.append(torch.arange(cursor, t))
        k_lens.append(t - cursor)
        uniform = None
    sel = torch.tensor(rows)
    row_lengths = torch.tensor([lengths[r] for r in rows])
    cu = torch.cumsum(torch.tensor([0, *q_lens]), 0).to(device=device, dtype=torch.int32)
    cu_k = torch.cumsum(torch.tensor([0, *k_lens]), 0).to(device=device, dtype=torch.int32)
    flat_positions = torch.cat(positions)
    longest = int(flat_positions.max()) + 1
    SHARED_POSITIONS.register(cu, flat_positions.to(device))
    mb = {
        "tokens": torch.cat(pieces)[None].to(device),
        "positions": flat_positions[None].to(device),
        "packed_seq_params": SharedPromptSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
            kv_index=torch.cat(kv).to(device),
            cu_seqlens_k=cu_k,
            max_q=max(q_lens),
            max_k=max(k_lens),
            uniform=uniform,
            cross=cross,
        ),
        "row_starts": torch.tensor(row_starts).to(device),
        "prompt_starts": torch.tensor(prompt_starts).to(device),
        "row_prompt_lens": torch.tensor(prompt_lens).to(device),
        "row_lengths": row_lengths.to(device),
        **row_fields(exp, sel, packed_response_index(exp, sel, row_lengths), keys, device),
    }
    return mb


def uniform_shape(units: list[list[int]], prompts: list[int], responses: list[int]) -> tuple | None:
    """(units, responses per unit, prompt length, response length) where every unit has that many responses,
    every prompt that length and every response that length (none empty): the micro-batch's prompts block is
    then a (units, prompt) batch and its responses a (units x responses, response) one
    (engine/models/shared_prompt_split.py); else None."""
    counts = {len(unit) for unit in units}
    if len(counts) != 1 or len(set(prompts)) != 1 or len(set(responses)) != 1:
        return None
    if prompts[0] == 0 or responses[0] == 0:
        return None
    return (len(units), counts.pop(), prompts[0], responses[0])


def cross_segments(
    units: list[list[int]], prompts: list[int], responses: list[int], device: torch.device
) -> CrossSegments | None:
    """The responses block's queries over their prompts' keys, unit by unit (units without responses left
    out), for the split attention (engine/models/shared_prompt_split.py); None where a unit with responses has
    no prompt (its queries would have no keys there)."""
    totals, spans, row = [], [], 0
    for unit, prompt, start in zip(units, prompts, [0, *itertools.accumulate(prompts)]):
        total = sum(responses[row : row + len(unit)])
        row += len(unit)
        if total == 0:
            continue
        if prompt == 0:
            return None
        totals.append(total)
        spans.append((start, start + prompt))
    if not totals:
        return None
    k_bounds = [spans[0][0]]
    for first, last in spans:
        if first != k_bounds[-1]:  # a unit without responses between two with them: its prompt in no segment
            return None
        k_bounds.append(last)
    return CrossSegments(
        sum(prompts), tuple(itertools.accumulate(totals, initial=0)), tuple(k_bounds), device
    )
