"""Cutting a mini-batch into micro-batches: a fixed number of rows each, or grouped under a token budget,
each micro-batch either packed (rows back to back in one sequence; the default) or padded (b, s).

Without a token budget (`trainer.max_tokens_per_micro_batch=0`), `trainer.micro_batch_size` sets the size
(8 where empty; where it is empty, packed and in one stage, packed micro-batches grow to at least 32,768
tokens as memory allows, the GPU's or the host's: `fill_tokens`, engine/micro_batch_sizing.py).
Padded, a micro-batch is `micro_batch_size` rows in order, each as long as the batch's longest row (one shape
per call). Packed (the default), rows are grouped as under a token budget of `micro_batch_size` x the batch's
width (its longest row + 1): the padded layout's tokens per micro-batch, so the same worst-case activation
memory, but with the rows' real tokens only, so short rows share a micro-batch. At long-tailed lengths
padding to the batch's longest row computes mostly padding (1.5B, 512 rows to 4,096 response tokens, one
H200: 36.7 s padded vs 16.2 s packed per update), and `micro_batch_size` rows packed alone leave the GPU
waiting on the host's launches (0.5B, long tail to 1,024: 7.8 s vs 3.0 s per update grouped by width;
scripts/bench/README.md).

Token budget (`trainer.max_tokens_per_micro_batch` > 0): rows are sorted by length (prompt + response),
longest first, and grouped greedily while the micro-batch's tokens stay within the budget: padded, each row
joins the last micro-batch or starts one; packed, each row joins the first micro-batch it fits in (first-fit
decreasing: the short rows of a long tail fill the room the long ones left, so micro-batches are full to
within a row's length of the budget, and fewer).
- Padded (`trainer.pack_sequences=false`): the tokens counted are rows x (the group's longest row + 1
  target slot); each micro-batch (b, s) is cut to its longest row and right-padded from position 0 with
  causal attention, so dropping pad columns changes no valid logit.
- Packed: the tokens counted are the rows' real lengths; the rows of a group lie back to back in one (1, t)
  sequence, t = their summed lengths rounded up to what sequence parallelism needs (the rounding is one
  extra pseudo-row of padding), positions restart at 0 per row, and megatron's
  `PackedSeqParams(qkv_format="thd")` carries the row boundaries (`cu_seqlens`) to attention and RoPE
  (engine/models/spec.py). `row_starts`, `row_lengths` locate each row; `response_index` stays row-local
  (clamped inside the row), so the heads gather the same (rows, T) positions as from padded rows
  (engine/models/output_head.py `gather_rows`). Results equal the padded layout up to float summation order.

Packed or budgeted micro-batches of one `MegatronRole.run` call then differ in length (and with a budget in
rows). Without pipeline parallelism megatron's schedule never looks at the shapes; with PP the stages exchange
each activation's shape first (`variable_seq_lengths`, set on the role's config by engine/setup.py), one small
message per transfer. The alternatives lose: one `run` per shape would zero and DP-reduce the gradients once
per call (policy.py accumulates within one call only), and padding a call's micro-batches to one shape gives
back the padding this exists to remove. The interleaved schedule (vpp > 1) takes `micro_batch_size` rows in
order (packed too) and refuses a token budget (engine/validate/): it needs a micro-batch count that fits its
groups of PP micro-batches, which a budget does not guarantee. Nor does its shape exchange work
(megatron-core 0.16, gloo: "Received data size doesn't match expected size" in the first update), so under
it packed micro-batches are padded to one layout per call (`shapes="one"`), still far below rows x the
batch's longest row. CUDA graphs of the layers (trainer.cuda_graphs, engine/models/layer_graphs.py) need
nearly the same (`shapes="graphs"`): a graph replays one micro-batch signature (tokens, the number of
`cu_seqlens` entries, `max_seqlen`), and a long-tailed call's micro-batches otherwise differ in all three.
`one_layout` gives the call's layout: t its longest packed micro-batch's tokens, `max_seqlen` its longest
row, and one count of segments (rows plus padding pseudo-rows); each micro-batch's padding is split evenly
over its pseudo-rows, each 1 to `max_seqlen` tokens (no zero-length rows, which not every attention kernel
takes; short pseudo-rows keep the padding's attention cheap). Equal rows stay equal: a fixed-length call's
last, smaller micro-batch is padded with pseudo-rows as long as its rows. For the graphs only micro-batches
of at least `GRAPH_FILL` of the largest one's tokens are padded: first-fit grouping leaves all but the call's
last one or two within a row of the budget, so the padding stays small (`perf/padding_fraction`); smaller
ones keep their own shape and run eagerly, once, since padding them can cost more GPU time than their
launches (one H200, 1.5B, long tail to 4,096, 24 micro-batches of ~34.8k tokens: a last one of 17.8k padded
to 34.9k made the update 2.4% slower, where the graphs' memory guard kept every layer eager anyway).
The loss normaliser contract of engine/roles/policy.py makes the update independent of how rows are split.
`MicroBatcher.token_counts` adds up real and processed (padded) tokens and micro-batches for
`perf/padding_fraction` and `perf/tokens_per_micro_batch`.
"""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from engine.config import TrainerConfig
from engine.micro_batch_sizing import fill_tokens, micro_batch_rows, packs_sequences
from engine.roles import shared_prompts
from engine.rollout.routes import NO_ROUTE
from engine.step.batch import ROUTES, Experience, packed_response_index, response_lengths, row_fields
from parallel.dims import ParallelDims


def padded_length(length: int, multiple: int = 1) -> int:
    """Sequence columns for a row of `length` tokens: +1 target slot (as build_experience), rounded up."""
    return -(-(length + 1) // multiple) * multiple


def pack_by_token_budget(
    lengths: list[int], max_tokens: int, multiple: int = 1, packed: bool = False
) -> list[list[int]]:
    """Indices into `lengths` grouped into micro-batches, longest rows first, each within `max_tokens`
    (a row longer than the budget goes alone): padded, len(group) * padded_length(longest in group), each
    row in the last group or a new one; `packed`, the group's summed lengths rounded up to `multiple`, each
    row in the first group it fits in."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if packed:
        return _first_fit(order, lengths, max_tokens, multiple)
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * padded_length(lengths[groups[-1][0]], multiple) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _first_fit(order: list[int], lengths: list[int], max_tokens: int, multiple: int) -> list[list[int]]:
    """`order` (longest first) into groups whose summed lengths, rounded up to `multiple`, stay within
    `max_tokens`: each row into the first group with room for it, else a new group."""
    groups: list[list[int]] = []
    totals: list[int] = []
    open_groups: list[int] = []  # groups that may still take a row: room for the shortest one
    shortest = min(lengths[i] for i in order) if order else 0
    for i in order:
        for g in open_groups:
            if padded_total(totals[g] + lengths[i], multiple) <= max_tokens:
                groups[g].append(i)
                totals[g] += lengths[i]
                break
        else:
            g = len(groups)
            groups.append([i])
            totals.append(lengths[i])
            open_groups.append(g)
        if padded_total(totals[g] + shortest, multiple) > max_tokens:
            open_groups.remove(g)
    return groups


def _micro_batch(exp: Experience, sel: torch.Tensor, seq: int, keys, device: torch.device) -> dict:
    tokens = exp.tokens[sel, :seq]
    steps = torch.arange(exp.response_ids.shape[1])
    index = (exp.prompt_lens[sel, None] - 1 + steps).clamp(max=seq - 2)  # see Experience.response_index
    mb = {
        "tokens": tokens.to(device),
        "positions": torch.arange(seq).expand_as(tokens).to(device),
        **row_fields(exp, sel, index, keys, device),
    }
    if ROUTES in exp.tensors:  # routing replay: aligned to `tokens` (b, s, layers, k)
        mb[ROUTES] = exp.tensors[ROUTES][sel, :seq].to(device)
    return mb


def padded_total(total: int, multiple: int) -> int:
    """A packed micro-batch's length for `total` real tokens: rounded up to `multiple`."""
    return -(-total // multiple) * multiple


def one_layout(groups: list[list[int]], multiple: int) -> tuple[int, int, int]:
    """(t, segments, max_seqlen) of every packed micro-batch of a call whose groups have these row lengths
    (module docstring): t >= each group's tokens (rounded up to `multiple`), and each group's padding
    t - tokens fits segments - rows pseudo-rows of 1 to max_seqlen tokens."""
    longest = max(max(g) for g in groups)
    totals = [sum(g) for g in groups]
    t = max(padded_total(total, multiple) for total in totals)
    segments = max(len(g) + -(-(t - total) // longest) for g, total in zip(groups, totals))
    while True:  # ends: the room (segments - rows) x longest grows faster than t with each segment added
        t = max([t] + [padded_total(total + segments - len(g), multiple) for g, total in zip(groups, totals)])
        if all(t - total <= (segments - len(g)) * longest for g, total in zip(groups, totals)):
            return t, segments, longest
        segments += 1


def _padding_rows(pad: int, count: int) -> list[int]:
    """`pad` tokens as `count` pseudo-rows of near-equal length (each at least 1 where pad >= count)."""
    if not count:
        return []
    size, longer = divmod(pad, count)
    return [size + 1] * longer + [size] * (count - longer)


def _packed_micro_batch(
    exp: Experience,
    sel: torch.Tensor,
    lengths: torch.Tensor,
    multiple: int,
    keys,
    device: torch.device,
    layout: tuple[int, int, int] | None = None,
) -> dict:
    """The rows `sel` ((rows,) real `lengths`) back to back in one (1, t) sequence, padded to the call's
    `layout` (`one_layout`) where given: see the module docstring."""
    total = int(lengths.sum())
    starts = torch.cumsum(lengths, 0) - lengths  # (rows,)
    # the padding: pseudo-rows of their own, so every row keeps its boundaries
    if layout is None:  # to the multiple: one pseudo-row
        t = padded_total(total, multiple)
        padding = [t - total] if t > total else []
    else:
        t, segments, longest = layout
        padding = _padding_rows(t - total, segments - len(sel))
    cu_seqlens = torch.cat([starts, torch.cumsum(torch.tensor([total, *padding]), 0)])
    tokens = torch.zeros(1, t, dtype=exp.tokens.dtype)
    positions = torch.arange(t) - torch.repeat_interleave(cu_seqlens[:-1], cu_seqlens.diff())
    for r, start, length in zip(sel.tolist(), starts.tolist(), lengths.tolist()):
        tokens[0, start : start + length] = exp.tokens[r, :length]
    max_seqlen = int(cu_seqlens.diff().max()) if layout is None else layout[2]
    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    mb = {
        "tokens": tokens.to(device),
        "positions": positions[None].to(device),
        "packed_seq_params": PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=max_seqlen,
            max_seqlen_kv=max_seqlen,
        ),
        "row_starts": starts.to(device),
        "row_lengths": lengths.to(device),
        **row_fields(exp, sel, packed_response_index(exp, sel, lengths), keys, device),
    }
    if ROUTES in exp.tensors:  # routing replay: packed like `tokens` (1, t, layers, k)
        routes = exp.tensors[ROUTES]
        packed = torch.full((1, t, *routes.shape[2:]), NO_ROUTE, dtype=routes.dtype)
        for r, start, length in zip(sel.tolist(), starts.tolist(), lengths.tolist()):
            packed[0, start : start + length] = routes[r, :length]
        mb[ROUTES] = packed.to(device)
    return mb


SHAPES = ("free", "one", "graphs")
"""`MicroBatcher`'s choices of packed micro-batch shapes within a call (its docstring)."""

GRAPH_FILL = 0.875
"""`shapes="graphs"`: the share of the call's largest micro-batch's tokens from which a micro-batch is padded
to the call's layout (module docstring)."""


class MicroBatcher:
    """Cuts rows of an Experience into micro-batch dicts (`tokens`, `positions` (b, s), `response_index`,
    `response_mask` (b, T), `response_valid` (the mask's True entries, flat), the named tensors, and `rows`:
    the Experience rows, in order); with `pack` `tokens`, `positions` are (1, t) and
    `packed_seq_params`, `row_starts`, `row_lengths` are added. `shapes` (packed, module docstring): "free"
    each micro-batch its own layout; "one" (the interleaved schedule's) `micro_batch_size` rows in order
    without a budget and every micro-batch of a call in one layout (`one_layout`: t, segments, max_seqlen);
    "graphs" (the layers' CUDA graphs') grouped as "free", then the micro-batches of at least `GRAPH_FILL`
    of the largest one's tokens in one layout."""

    def __init__(
        self,
        micro_batch_size: int,
        max_tokens: int,
        seq_multiple: int,
        device: torch.device,
        pack: bool = False,
        shapes: str = "free",
        token_cap: int = 0,
        fill_tokens: int = 0,
        share_prompts: bool = False,
    ):
        if shapes not in SHAPES:
            raise ValueError(f"MicroBatcher: shapes={shapes!r}, not one of {SHAPES}")
        if share_prompts and (not pack or shapes != "free"):
            raise ValueError("MicroBatcher: share_prompts needs packed micro-batches of free shapes")
        self.share_prompts = share_prompts
        """Each micro-batch's rows of one prompt hold it once (engine/roles/shared_prompts.py)."""
        self.micro_batch_size, self.max_tokens = micro_batch_size, max_tokens
        self.token_cap = 0 if max_tokens or shapes == "one" else token_cap
        """Without a budget, the most tokens a micro-batch by rows may hold (engine/roles/memory_cap.py; 0:
        none): packed rows are grouped under min(rows x width, cap), padded micro-batches take fewer rows (a
        divisor of micro_batch_size: pipeline stages without shape exchange need one shape).
        Not under the interleaved schedule, whose micro-batch count must fit its groups."""
        self.seq_multiple, self.device, self.pack = seq_multiple, device, pack
        self.shapes = shapes
        self.fixed_rows = not max_tokens and (not pack or shapes == "one")
        """`micro_batch_size` rows per micro-batch, in order: without a budget, padded or `shapes="one"`;
        packed otherwise, rows are grouped under `micro_batch_size` x the batch's width (module docstring)."""
        self.fill_tokens = 0 if max_tokens or self.fixed_rows else fill_tokens
        """Packed without a budget, the fewest tokens rows are grouped under where rows x width is less
        (engine/micro_batch_sizing.py `sized_by_memory`: 0, none), still at most `token_cap`."""
        self.token_counts = [0, 0, 0, 0]
        """Real tokens computed (prompt + response; a shared prompt once), tokens processed (with padding), the
        number of micro-batches and the rows' tokens (every row's prompt) cut since the last `reset_counts`."""

    def reset_counts(self) -> None:
        self.token_counts = [0, 0, 0, 0]

    def __call__(self, exp: Experience, rows: torch.Tensor, keys: tuple[str, ...] = ()) -> list[dict]:
        full = exp.tokens.shape[1]
        lengths = exp.prompt_lens[rows] + response_lengths(exp.response_mask[rows])
        budget = self.max_tokens or (
            0 if self.fixed_rows else max(self.micro_batch_size * full, self.fill_tokens)
        )
        if budget and self.token_cap:
            budget = min(budget, self.token_cap)
        if self.share_prompts:
            groups = shared_prompts.prompt_groups(exp, rows.tolist())
            if len(groups) < len(rows):  # some prompt shared (else the whole rows' layout, no gathers)
                return self._shared_prompts(exp, groups, rows, lengths, budget, keys)
        if budget:
            groups = pack_by_token_budget(lengths.tolist(), budget, self.seq_multiple, self.pack)
        else:
            size = self.micro_batch_size
            if self.token_cap:  # padded rows at the batch's width, a divisor of micro_batch_size: every
                # micro-batch keeps one shape wherever micro_batch_size divided the rows
                fits = self.token_cap // full
                size = max(d for d in range(1, size + 1) if size % d == 0 and (d <= fits or d == 1))
            groups = [list(range(i, min(i + size, len(rows)))) for i in range(0, len(rows), size)]
        if self.pack:
            layout, in_layout = None, range(len(groups))
            if self.shapes != "free" and groups:
                totals = [int(lengths[g].sum()) for g in groups]
                if self.shapes == "graphs":  # smaller micro-batches keep their own shape
                    in_layout = [k for k, total in enumerate(totals) if total >= GRAPH_FILL * max(totals)]
                layout = one_layout([lengths[groups[k]].tolist() for k in in_layout], self.seq_multiple)
            out = [
                _packed_micro_batch(
                    exp,
                    rows[g],
                    lengths[g],
                    self.seq_multiple,
                    keys,
                    self.device,
                    layout if k in in_layout else None,
                )
                for k, g in enumerate(groups)
            ]
        else:
            # under a budget each cut to its longest row (sorted first), else all to the batch's longest
            seqs = [
                min(padded_length(int(lengths[g[0]]), self.seq_multiple), full) if self.max_tokens else full
                for g in groups
            ]
            out = [_micro_batch(exp, rows[g], seq, keys, self.device) for g, seq in zip(groups, seqs)]
        self._count(int(lengths.sum()), out, int(lengths.sum()))
        return out

    def _shared_prompts(
        self, exp: Experience, groups, rows: torch.Tensor, lengths: torch.Tensor, budget, keys
    ):
        """Micro-batches holding each of `groups`' prompt once (rows of one prompt), first-fit decreasing by
        their tokens so laid out (engine/roles/shared_prompts.py)."""
        length_of = dict(zip(rows.tolist(), lengths.tolist()))
        units = [
            part for group in groups for part in shared_prompts.split_group(exp, group, length_of, budget)
        ]
        costs = [shared_prompts.unit_tokens(exp, unit, length_of) for unit in units]
        out = [
            shared_prompts.shared_prompt_micro_batch(
                exp, [units[u] for u in group], length_of, self.seq_multiple, keys, self.device
            )
            for group in pack_by_token_budget(costs, budget, self.seq_multiple, packed=True)
        ]
        self._count(sum(costs), out, int(lengths.sum()))
        return out

    def _count(self, real: int, out: list[dict], row_tokens: int) -> None:
        self.token_counts[0] += real
        self.token_counts[1] += sum(mb["tokens"].numel() for mb in out)
        self.token_counts[2] += len(out)
        self.token_counts[3] += row_tokens


def micro_batch_shapes_vary(t: TrainerConfig, vpp: int) -> bool:
    """Whether one call's micro-batches may differ in shape: cut under a token budget, or packed outside
    megatron's interleaved schedule (`vpp` > 1 pads a call's packed micro-batches to one layout instead:
    engine/roles/dynamic_batch.py). With pipeline parallelism the stages must then exchange each activation's
    shape (`variable_seq_lengths`)."""
    return t.max_tokens_per_micro_batch > 0 or (packs_sequences(t) and vpp == 1)


def trainer_batcher(
    t: TrainerConfig,
    dims: ParallelDims,
    device: torch.device,
    graphs: bool = False,
    token_cap: int = 0,
    share_prompts: bool = False,
) -> MicroBatcher:
    """The MicroBatcher of the trainer's config `t` on a rank of layout `dims`: `micro_batch_rows` rows
    (packed: their tokens at the batch's width) or a token budget, packed unless
    trainer.pack_sequences=false; one layout per call under the interleaved pipeline schedule (rows in order)
    and where the roles run their layers from CUDA graphs (`graphs`: engine/validate/run.py `layer_graphs_on`;
    one graph signature per call); without a budget, micro-batches of at most `token_cap` tokens (0: no cap;
    engine/roles/memory_cap.py), and where that cap is set and `sized_by_memory`, packed ones of at least
    MEMORY_SIZED_TOKENS under it (engine/micro_batch_sizing.py); each group's prompt once where
    `share_prompts` (trainer.share_prompts resolved: engine/validate/run.py `prompts_shared`;
    engine/roles/shared_prompts.py)."""
    fill = fill_tokens(t, device.type, dims.pp) if token_cap else 0  # only under a memory cap
    return MicroBatcher(
        micro_batch_rows(t),
        t.max_tokens_per_micro_batch,
        seq_multiple=dims.seq_multiple,
        device=device,
        pack=packs_sequences(t),
        shapes="one" if dims.vpp > 1 else "graphs" if graphs else "free",
        token_cap=token_cap,
        fill_tokens=fill,
        share_prompts=share_prompts,
    )
