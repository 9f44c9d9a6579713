"""Hugging Face safetensors checkpoints in and out of this rank's Megatron TP/PP shards.

- `model_config_from_hf(path)`: ModelConfig overrides from config.json (engine/models/hf_config.py).
- `load_hf_weights(chunks, path, shape, groups)`: every rank copies only the slices its own shards hold,
  from lazy memory-mapped views (safetensors `get_slice`), straight into its parameters, one parameter at
  a time; single-file and sharded (`model.safetensors.index.json`) checkpoints.
- `save_hf_checkpoint(...)`: one tensor at a time, TP shards are all-gathered in their stage and sent to
  global rank 0, which writes safetensors files of bounded size, the index, config.json and tokenizer files;
  at parallel.ep > 1 each layer's routed experts first reach the stage's writer (engine/models/hf_experts.py).

The name/split mapping lives in engine/models/hf_map.py. The actor, reference and critic all load this way;
a critic (`ValueHead` output layer) takes `score.weight` when the checkpoint has one, else stays zero.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from engine.models.builder import ModelShape, ValueHead
from engine.models.hf_config import HF_CONFIG_FILE, HFCheckpointError
from engine.models.hf_experts import ExpertStream
from engine.models.hf_map import (
    TIED_OUTPUT_RULE,
    VALUE_HEAD_BIAS,
    VALUE_HEAD_RULE,
    WeightRule,
    hf_from_shards,
    hf_names,
    local_expert,
    match_rule,
    shard_from_hf,
)
from parallel.state import ProcessGroups

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


class HFCheckpoint:
    """The tensors of a single-file or sharded safetensors checkpoint, read lazily (a context manager).

    `tensor(name)` is a view of the memory-mapped file (safetensors' `get_slice`): indexing it and copying
    the result reads only the pages that slice touches, so a rank never materialises a full tensor.
    """

    def __init__(self, path: str):
        self.path = path
        self._stack = ExitStack()
        self._open: dict[str, Any] = {}
        index = os.path.join(path, INDEX_FILE)
        single = os.path.join(path, SINGLE_FILE)
        if os.path.isfile(index):
            self.source = index
            with open(index) as f:
                self.file_of: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.isfile(single):
            self.source = single
            self.file_of = dict.fromkeys(self._file(SINGLE_FILE, "").keys(), SINGLE_FILE)
        else:
            raise HFCheckpointError(
                f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}; the engine reads safetensors only "
                f"(re-save the model with save_pretrained(..., safe_serialization=True))"
            )

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def where(self, name: str) -> str:
        """The file holding tensor `name` (for messages)."""
        return os.path.join(self.path, self.file_of.get(name, "?"))

    def _file(self, file: str, name: str):
        if file not in self._open:
            full = os.path.join(self.path, file)
            if not os.path.isfile(full):
                raise HFCheckpointError(f"{full} is missing (it holds {name!r} according to {INDEX_FILE})")
            self._open[file] = self._stack.enter_context(safe_open(full, framework="pt"))
        return self._open[file]

    def tensor(self, name: str) -> torch.Tensor:
        """A lazy view of tensor `name`: slice it before copying to read only that part."""
        if name not in self.file_of:
            raise HFCheckpointError(
                f"tensor {name!r} is missing from {self.source}; the checkpoint does not match its "
                f"{HF_CONFIG_FILE} (check num_hidden_layers, tie_word_embeddings, model_type)"
            )
        file = self._file(self.file_of[name], name)
        if name not in file.keys():
            raise HFCheckpointError(
                f"tensor {name!r} is missing from {self.where(name)} named by {INDEX_FILE}"
            )
        return file.get_slice(name)[:]


def check_tp_layout(shape: ModelShape, tp: int, source: str) -> None:
    """Refuse a TP size the checkpoint's heads/widths cannot be split by, naming the key and the fix."""
    for key, value in (
        ("num_key_value_heads (num_query_groups)", shape.num_query_groups),
        ("num_attention_heads", shape.num_attention_heads),
        ("intermediate_size (ffn_hidden_size)", shape.ffn_hidden_size),
    ):
        if value % tp:
            divisors = [d for d in range(1, value + 1) if value % d == 0]
            raise HFCheckpointError(
                f"{source}: {key}={value} is not divisible by parallel.tp={tp}; "
                f"set parallel.tp to one of {divisors[:8]}"
            )


def _rule_for(chunk: torch.nn.Module, name: str, shape: ModelShape) -> tuple[WeightRule, int | None]:
    """Rule and global layer id of a chunk's parameter (tied output layer and value head included)."""
    if name == "output_layer.weight":
        if isinstance(chunk.output_layer, ValueHead):
            return VALUE_HEAD_RULE, None
        if shape.tie_embeddings:
            return TIED_OUTPUT_RULE, None
    rule, local = match_rule(name)
    if local is None:
        return rule, None
    return rule, chunk.decoder.layers[local].layer_number - 1  # megatron's global 1-based number


def _expected_hf_shapes(rule: WeightRule, shard_shape, shape: ModelShape, tp: int) -> list[torch.Size]:
    meta = torch.empty(shard_shape, device="meta")
    return [t.shape for t in hf_from_shards(rule, [meta] * tp, shape)]


@torch.no_grad()
def load_hf_weights(
    chunks: list[torch.nn.Module], path: str, shape: ModelShape, groups: ProcessGroups
) -> None:
    """Fill this rank's chunks with its TP/PP shards of the HF checkpoint at `path`.

    Copies per parameter only the slices that rank holds, straight from the memory-mapped file into the
    parameter (nothing else is allocated). A critic's value head loads `score.weight` if present, else
    keeps its init. Call it before wrapping the chunks (DDP) and before building the optimizer, whose
    fp32 main copies are taken from the parameters.
    """
    tp, tp_rank = groups.dims.tp, groups.tp_rank
    check_tp_layout(shape, tp, os.path.join(path, HF_CONFIG_FILE))
    offset = groups.expert_offset(shape.moe.num_experts) if shape.moe else 0
    with HFCheckpoint(path) as ckpt:
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                rule, layer = _rule_for(chunk, name, shape)
                expert = local_expert(name) + offset if rule.expert else None
                names = hf_names(rule, layer, expert)
                if rule is VALUE_HEAD_RULE:
                    if names[0] not in ckpt:
                        continue  # a fresh critic head: keep the zero init
                    _check_zero_bias(ckpt)
                split_tp, split_rank = (1, 0) if rule.expert else (tp, tp_rank)  # experts: whole per rank
                _check_shapes(ckpt, rule, names, name, param.shape, shape, split_tp)

                def read(i, index, names=names):
                    return ckpt.tensor(names[i])[index]

                shard_from_hf(rule, read, param.data, shape, split_tp, split_rank)


def _check_zero_bias(ckpt: HFCheckpoint) -> None:
    if VALUE_HEAD_BIAS in ckpt and ckpt.tensor(VALUE_HEAD_BIAS).any():
        raise HFCheckpointError(
            f"tensor {VALUE_HEAD_BIAS!r} in {ckpt.where(VALUE_HEAD_BIAS)} is nonzero, but the engine's value "
            f"head has no bias; zero it (a constant shift of all values) or fold it into the reward model"
        )


def _check_shapes(ckpt: HFCheckpoint, rule, names, megatron_name, shard_shape, shape, tp) -> None:
    for hf_name, want in zip(names, _expected_hf_shapes(rule, shard_shape, shape, tp)):
        have = ckpt.tensor(hf_name).shape
        if have != want:
            raise HFCheckpointError(
                f"tensor {hf_name!r} in {ckpt.where(hf_name)} has shape {tuple(have)} but the model built "
                f"from {HF_CONFIG_FILE} expects {tuple(want)} (Megatron {megatron_name}); the weights do not "
                f"match config.json: fix config.json or point model.path at the matching checkpoint"
            )


def _local_hf_tensors(
    chunks, shape: ModelShape, groups: ProcessGroups, head_bias: bool, experts: ExpertStream | None
) -> Iterator[dict[str, torch.Tensor]]:
    """This stage's HF tensors, one Megatron parameter at a time (all TP ranks must iterate together).

    Yields on every TP rank; only TP rank 0's dicts are complete (others get empty dicts). `head_bias`:
    add a zero `score.bias` next to a value head (what *ForTokenClassification expects). With `experts`
    (parallel.ep > 1) a layer's routed experts come from the stream, all of them at the layer's first one.
    """
    tp = groups.dims.tp
    streamed: set[int] = set()
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            rule, layer = _rule_for(chunk, name, shape)
            if rule is TIED_OUTPUT_RULE:
                continue  # the first stage writes model.embed_tokens.weight
            if rule.expert and experts is not None:
                if layer not in streamed:
                    streamed.add(layer)
                    yield _hf_experts(experts.exchange(layer), layer, shape)
                continue
            shard = param.detach()
            if tp > 1 and not rule.expert:
                gathered = [torch.empty_like(shard) for _ in range(tp)]
                dist.all_gather(gathered, shard.contiguous(), group=groups.tp)
            else:
                gathered = [shard]
            if groups.tp_rank == 0:
                expert = local_expert(name) if rule.expert else None  # ep = 1: local = global
                named = dict(zip(hf_names(rule, layer, expert), hf_from_shards(rule, gathered, shape)))
                if rule is VALUE_HEAD_RULE and head_bias:
                    named[VALUE_HEAD_BIAS] = shard.new_zeros(1)
                yield named
            else:
                yield {}
            del gathered


def _hf_experts(tensors: dict[str, torch.Tensor], layer: int, shape: ModelShape) -> dict[str, torch.Tensor]:
    """HF tensors of one layer's routed experts given by global Megatron name, in expert order ({} if none)."""
    named = {}
    for name in sorted(tensors, key=lambda n: (local_expert(n), n)):
        rule, _ = match_rule(name)
        named.update(
            zip(hf_names(rule, layer, local_expert(name)), hf_from_shards(rule, [tensors[name]], shape))
        )
    return named


class _ShardWriter:
    """Writes tensors into safetensors files of at most `max_bytes` each, then the index."""

    def __init__(self, out_dir: str, max_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[list[str]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size

    def _flush(self) -> None:
        tmp = os.path.join(self.out_dir, f"part-{len(self.files):05d}.safetensors.tmp")
        save_file(self.pending, tmp, metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.files:
            self._flush()
        n = len(self.files)
        names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for i, (final, tensors) in enumerate(zip(names, self.files)):
            os.replace(
                os.path.join(self.out_dir, f"part-{i:05d}.safetensors.tmp"), os.path.join(self.out_dir, final)
            )
            weight_map.update(dict.fromkeys(tensors, final))
        if n > 1:
            with open(os.path.join(self.out_dir, INDEX_FILE), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def _send_stage(tensors: Iterator[dict[str, torch.Tensor]], device: torch.device) -> None:
    """PP stage > 0, TP rank 0: send (names, shapes, dtypes) then the tensors to global rank 0; None ends."""
    for named in tensors:
        if not named:
            continue
        meta = [(n, t.shape, t.dtype) for n, t in named.items()]
        dist.send_object_list([meta], dst=0, device=device)
        for t in named.values():
            dist.send(t.contiguous().to(device), dst=0)
    dist.send_object_list([None], dst=0, device=device)


def _recv_stage(src: int, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    while True:
        box = [None]
        dist.recv_object_list(box, src=src, device=device)
        if box[0] is None:
            return
        for name, size, dtype in box[0]:
            t = torch.empty(size, dtype=dtype, device=device)
            dist.recv(t, src=src)
            yield name, t


@torch.no_grad()
def save_hf_checkpoint(
    chunks: list[torch.nn.Module],
    shape: ModelShape,
    groups: ProcessGroups,
    out_dir: str,
    src_dir: str | None,
    hf_config: dict[str, Any],
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2 << 30,
) -> None:
    """Write the model as a Hugging Face checkpoint in `out_dir` (collective over all ranks).

    DP replica 0 takes part (and at parallel.ep > 1 every rank holding experts that a stage's writer lacks:
    `engine.models.hf_experts`, one layer's experts at a time); global rank 0 writes safetensors files (<= `max_shard_bytes` each, with
    `model.safetensors.index.json` when more than one), `hf_config` as config.json, and the tokenizer
    files of `src_dir` if given. Tensors keep the parameters' dtype unless `dtype` is set. A critic's
    value head is written as `score.weight` (plus a zero `score.bias` for *ForTokenClassification). Rank 0
    holds at most one file's worth of tensors at a time.

    The files go into a temporary directory next to `out_dir` that then replaces `out_dir` whole, so no file
    of an earlier export survives (an older index.json would shadow a new single file). An existing
    `out_dir` may hold only files an export writes; anything else is refused before any work
    (HFCheckpointError on every rank), as replacing the directory would delete it.
    """
    rank0 = groups.rank == 0
    head_bias = any(a.endswith("ForTokenClassification") for a in hf_config.get("architectures") or [])
    problem = [_foreign_entry_problem(out_dir) if rank0 else None]
    if dist.is_initialized() and groups.dims.world_size > 1:
        dist.broadcast_object_list(problem, src=0, group=groups.world, device=groups.device)
    if problem[0]:
        raise HFCheckpointError(problem[0])
    tmp = f"{os.path.abspath(out_dir)}.tmp-{secrets.token_hex(6)}"
    if rank0:
        os.makedirs(tmp)
    experts = ExpertStream(chunks, shape, groups) if shape.moe and groups.dims.ep > 1 else None
    if groups.dp_rank != 0 and experts is not None:
        experts.serve()  # this rank's experts that its stage's writer lacks
    if groups.dp_rank == 0:
        writer = _ShardWriter(tmp, max_shard_bytes) if rank0 else None
        for stage in range(groups.dims.pp):
            if groups.pp_rank == stage:
                local = _local_hf_tensors(chunks, shape, groups, head_bias, experts)
                if rank0:
                    for named in local:
                        for name, t in named.items():
                            writer.add(name, t.to(dtype or t.dtype).cpu())
                elif groups.tp_rank == 0:
                    _send_stage(local, groups.device)
                else:
                    for _ in local:  # take part in the TP all-gathers
                        pass
            elif rank0:
                for name, t in _recv_stage(dist.get_global_rank(groups.pp, stage), groups.device):
                    writer.add(name, t.to(dtype or t.dtype).cpu())
        if rank0:
            writer.close()
            _write_metadata(tmp, src_dir, hf_config)
            _replace_dir(tmp, out_dir)
    if dist.is_initialized():
        dist.barrier(group=groups.world)


def _foreign_entry_problem(out_dir: str) -> str | None:
    """Why `out_dir` cannot be replaced by an export (it holds something an export does not write), or None."""
    if not os.path.exists(out_dir):
        return None
    if not os.path.isdir(out_dir):
        return f"export target {out_dir} exists and is not a directory. Fix: choose another output path"
    ours = {SINGLE_FILE, INDEX_FILE, HF_CONFIG_FILE, *TOKENIZER_FILES}
    for entry in sorted(os.listdir(out_dir)):
        if entry not in ours and not re.fullmatch(r"model-\d+-of-\d+\.safetensors", entry):
            return (
                f"export target {out_dir} holds {entry!r}, which an export does not write; the export replaces "
                f"the whole directory. Fix: export into a new or empty directory, or move {entry!r} away"
            )
    return None


def _replace_dir(tmp: str, out_dir: str) -> None:
    """Rename the complete directory `tmp` to `out_dir`, replacing an earlier export there."""
    old = None
    if os.path.exists(out_dir):
        old = f"{os.path.abspath(out_dir)}.old-{secrets.token_hex(6)}"
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _write_metadata(out_dir: str, src_dir: str | None, hf_config: dict[str, Any]) -> None:
    with open(os.path.join(out_dir, HF_CONFIG_FILE), "w") as f:
        json.dump(hf_config, f, indent=2)
    if src_dir:
        for file in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(src_dir, file)):
                shutil.copy2(os.path.join(src_dir, file), os.path.join(out_dir, file))
