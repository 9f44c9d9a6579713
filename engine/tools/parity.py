"""Logit parity between the sharded Megatron model loaded from a Hugging Face checkpoint and transformers.

    python -m engine.parity model.path=DIR [parallel.tp=T parallel.pp=P parallel.vpp=V]
        [parity.batch=2 parity.seq_len=16 parity.tol=1e-4 parity.seed=0 cluster.device=cpu]

(under `torchrun --nproc_per_node=N` for N > 1 ranks; DP takes the ranks TP x PP leaves over). Builds the
model for the layout, loads the checkpoint with `load_hf_weights`, runs one fixed random batch through it
with megatron's forward-only pipeline schedule, gathers the vocab-parallel logits from the last stage, and
compares them on rank 0 with transformers' float32 logits. Prints one JSON line; exit code 1 if the max
absolute difference exceeds `parity.tol`. Both sides run in float32: on the tiny test models (logits up to
~6) the difference is 0 at TP=1 on CPU and <= 1.5e-5 otherwise (TP=2 sums in another order; GPU kernels).
Independent of the trainer: it shares only the config dataclasses, the builder and the loader.
Not covered: sequence parallelism (`parallel.sp`), which this check refuses.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from engine.config import ClusterConfig, ModelConfig, ParallelConfig
from engine.models.builder import ModelShape, ValueHead, build_gpt_chunks, resolve_shape
from engine.models.hf import check_tp_layout, load_hf_weights
from engine.models.hf_config import model_config_from_hf
from parallel.dims import ParallelDims
from parallel.state import ProcessGroups, destroy_distributed, init_distributed, world_size_from_env


@dataclass
class ParityConfig:
    batch: int = 2
    """Sequences in the random batch (one micro-batch each through the pipeline)."""
    seq_len: int = 16
    """Tokens per sequence (positions 0..seq_len-1, causal attention)."""
    tol: float = 1e-4
    """Largest allowed |logit difference| (float32 on both sides)."""
    seed: int = 0
    """Seed of the random token ids."""


@dataclass
class ParityModel:
    path: str = ""
    """Local Hugging Face checkpoint directory (the architecture comes from its config.json)."""


@dataclass
class ParityJob:
    model: ParityModel = field(default_factory=ParityModel)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)


def hf_model_shape(path: str, tp: int) -> ModelShape:
    """The float32 ModelShape of the checkpoint at `path` for TP size `tp` (checked to be splittable)."""
    overrides = model_config_from_hf(path)
    m = replace(ModelConfig(), path=path, dtype="float32", **overrides)
    shape = resolve_shape(m, overrides["vocab_size"], tp)
    check_tp_layout(shape, tp, f"{path}/config.json")
    return shape


def forward_logits(
    chunks: list[torch.nn.Module], tokens_bs: torch.Tensor, shape: ModelShape, groups: ProcessGroups
) -> torch.Tensor | None:
    """Logits (b, s, vocab) of `tokens_bs` on the last-stage ranks (TP-gathered), None on the others
    (values (b, s, 1) for a critic's value head).

    One sequence per micro-batch through megatron's forward-only schedule (any PP/VPP layout).
    """
    from engine.roles.policy import schedule

    b, s = tokens_bs.shape
    position_ids = torch.arange(s, device=tokens_bs.device).unsqueeze(0)  # (1, s)

    def step(data_iterator, model):
        tokens = next(data_iterator)  # (1, s)
        return model(tokens, position_ids, None), None  # no loss: the schedule stores the output

    iters = [iter(tokens_bs.split(1)) for _ in chunks]
    outputs = schedule(groups, chunks[0].config)(
        forward_step_func=step,
        data_iterator=iters if len(chunks) > 1 else iters[0],
        model=chunks,
        num_microbatches=b,
        seq_length=s,
        micro_batch_size=1,
        forward_only=True,
    )
    if not groups.is_last_stage:
        return None
    local = torch.cat(outputs, dim=0)  # (b, s, padded_vocab / tp), or (b, s, 1) for a value head
    if groups.dims.tp > 1 and not isinstance(chunks[-1].output_layer, ValueHead):
        parts = [torch.empty_like(local) for _ in range(groups.dims.tp)]
        dist.all_gather(parts, local.contiguous(), group=groups.tp)
        local = torch.cat(parts, dim=-1)
    return local[..., : shape.vocab_size].contiguous()  # drop the padded vocabulary rows


def _hf_logits(path: str, tokens_bs: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(tokens_bs.device).eval()
    with torch.no_grad():
        return hf(input_ids=tokens_bs).logits.float()  # (b, s, vocab)


def build_and_load(path: str, groups: ProcessGroups, value_head: bool = False):
    """(chunks, shape): this rank's float32 model chunks for `groups`' layout, loaded from `path`."""
    shape = hf_model_shape(path, groups.dims.tp)
    chunks = build_gpt_chunks(shape, groups, init_std=0.02, recompute=False, value_head=value_head)
    load_hf_weights(chunks, path, shape, groups)
    for c in chunks:
        c.eval()
    return chunks, shape


def random_tokens(shape: ModelShape, parity: ParityConfig, device: torch.device) -> torch.Tensor:
    """The fixed random batch (batch, seq_len), identical on every rank."""
    gen = torch.Generator().manual_seed(parity.seed)
    return torch.randint(0, shape.vocab_size, (parity.batch, parity.seq_len), generator=gen).to(device)


def logits_on_rank0(
    chunks, tokens_bs: torch.Tensor, shape: ModelShape, groups: ProcessGroups, width: int = 0
):
    """Full logits (b, s, width or vocab) on every rank of the last stage's PP group(s), rank 0 included.

    `width` = 1 for a critic's values.
    """
    logits = forward_logits(chunks, tokens_bs, shape, groups)
    if groups.dims.pp > 1:  # bring the last stage's logits to every stage of the PP group
        if logits is None:
            logits = torch.empty((*tokens_bs.shape, width or shape.vocab_size), device=tokens_bs.device)
        dist.broadcast(logits, src=groups.pp_last_rank, group=groups.pp)
    return logits


@torch.no_grad()
def compare_logits(chunks, shape: ModelShape, path: str, groups: ProcessGroups, parity: ParityConfig):
    """The parity report (same dict on every rank): Megatron chunks vs transformers on one random batch."""
    dims = groups.dims
    tokens = random_tokens(shape, parity, groups.device)
    logits = logits_on_rank0(chunks, tokens, shape, groups)
    box: list[Any] = [None]
    if groups.rank == 0:
        ref = _hf_logits(path, tokens)
        diff = (logits.float() - ref).abs().max().item()
        box[0] = {
            "model": path,
            "tp": dims.tp,
            "pp": dims.pp,
            "vpp": dims.vpp,
            "ep": dims.ep,
            "batch": parity.batch,
            "seq_len": parity.seq_len,
            "dtype": "float32",
            "max_abs_logit": ref.abs().max().item(),
            "max_abs_logit_diff": diff,
            "tol": parity.tol,
            "ok": diff <= parity.tol,
        }
    dist.broadcast_object_list(box, src=0, group=groups.world, device=groups.device)
    return box[0]


def run_parity(path: str, groups: ProcessGroups, parity: ParityConfig) -> dict[str, Any]:
    """Build + load at `groups`' layout and compare with transformers; the same report on every rank."""
    chunks, shape = build_and_load(path, groups)
    return compare_logits(chunks, shape, path, groups, parity)


def main(argv: list[str]) -> int:
    """CLI entry: key=value overrides in, one JSON line out (rank 0), 0 if ok else 1."""
    job: ParityJob = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(ParityJob), OmegaConf.from_dotlist(argv))
    )
    if not job.model.path:
        raise SystemExit("model.path is empty: pass model.path=DIR (a local Hugging Face checkpoint)")
    p = job.parallel
    if p.sp:
        raise SystemExit("parallel.sp=true: the parity check runs without sequence parallelism; drop it")
    shape = hf_model_shape(job.model.path, p.tp)  # config errors before any process group exists
    dims = ParallelDims(
        world_size=world_size_from_env(),
        tp=p.tp,
        pp=p.pp,
        vpp=p.vpp,
        first_stage_layers=p.first_stage_layers,
        last_stage_layers=p.last_stage_layers,
        ep=p.ep,
    )
    try:
        dims.stage_layer_counts(shape.num_layers)
    except ValueError as err:
        raise SystemExit(
            f"{job.model.path}/config.json: num_hidden_layers={shape.num_layers}: {err}"
        ) from None
    groups = init_distributed(dims, job.cluster.device, timeout_s=job.cluster.timeout_s)
    try:
        report = run_parity(job.model.path, groups, job.parity)
        if groups.rank == 0:
            print(json.dumps(report), flush=True)
        return 0 if report["ok"] else 1
    finally:
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
