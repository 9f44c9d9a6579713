"""Export the actor as a Hugging Face checkpoint: at the end of a run (`trainer.export_hf=true`, into
`<output_dir>/hf_actor`) or on demand from a saved checkpoint:

    torchrun --nproc_per_node=W -m engine.export CHECKPOINT OUT_DIR [--device cpu|cuda] [--dtype bfloat16]

W is the world size the checkpoint was saved with (plain `python -m engine.export` when it is 1);
CHECKPOINT is a `global_step_<N>` directory, or a run's output_dir / checkpoints directory (its latest).
Every rank builds its chunks for the saved layout, copies its saved shard into them and
`engine.models.hf.save_hf_checkpoint` gathers them into safetensors + config.json + tokenizer files, written
into a temporary directory next to OUT_DIR that then replaces OUT_DIR whole (an earlier export's files never
mix with the new ones; a directory holding other files is refused).

config.json: the source checkpoint's (`model.path`) when the run started from one, else one built from the
architecture (`hf_config_from_shape`: Llama, or Qwen2 with QKV bias, or Qwen3 with QK-norm) so that
transformers' AutoModelForCausalLM loads it. A different layout is not needed for export: loading the
exported directory with `model.path` under any layout is how checkpoints change layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import OmegaConf

from engine.checkpoint.checkpoint import check_layout, check_shape, run_layout, tokenizer_dir_of
from engine.checkpoint.checkpoint_state import layer_ranges, load_params
from engine.checkpoint.store import find_checkpoint, rank_file, read_meta, read_rank_state
from engine.config import ModelConfig
from engine.models.builder import ModelShape, build_gpt_chunks, resolve_shape
from engine.models.hf import save_hf_checkpoint
from engine.models.hf_config import HFCheckpointError, hf_config_from_shape
from engine.roles.offload import all_onloaded
from parallel.rollout_weights import global_param_names
from parallel.state import ProcessGroups

if TYPE_CHECKING:
    from engine.setup import Components

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP and Float16Module wrappers."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    while isinstance(chunk, (DistributedDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk


def hf_config_for(
    source: Mapping[str, Any] | None,
    shape: ModelShape,
    special_token_ids: Mapping[str, int | None],
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """The source checkpoint's config.json (its dtype set to what is written), or one built from the shape."""
    if not source:
        return hf_config_from_shape(shape, special_token_ids, dtype)
    cfg = dict(source)
    name = str(dtype or shape.dtype).removeprefix("torch.")
    cfg["dtype" if "dtype" in cfg else "torch_dtype"] = name
    return cfg


def export_actor(c: Components, out_dir: str, dtype: torch.dtype | None = None) -> None:
    """Write the live actor of components `c` to `out_dir` in Hugging Face format (collective)."""
    from engine.models.hf_config import read_hf_config

    source = read_hf_config(c.cfg.model.path) if c.cfg.model.path else None
    special = {k: getattr(c.tokenizer, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    chunks = [unwrap(chunk) for chunk in c.actor.chunks]
    with all_onloaded(c.actor):
        save_hf_checkpoint(
            chunks,
            c.shape,
            c.groups,
            out_dir,
            tokenizer_dir_of(c) or None,
            hf_config_for(source, c.shape, special, dtype),
            dtype=dtype,
        )


HF_ACTOR_DIR = "hf_actor"
"""Where `trainer.export_hf=true` writes the actor, under the run's output directory."""


def export_after_fit(c: Components, step: int) -> None:
    """After the last step, when trainer.export_hf: write the actor to `<output_dir>/hf_actor` (collective)."""
    out = os.path.join(c.output_dir, HF_ACTOR_DIR)
    export_actor(c, out)
    if c.groups.is_logging_rank:
        print(f"checkpoint: exported the actor at step {step} to {out} (Hugging Face format)", flush=True)


def model_config_from_meta(meta: Mapping[str, Any]) -> ModelConfig:
    """The checkpoint's model config as a ModelConfig, nested sections (model.moe) included; keys this version
    does not declare are dropped, keys the checkpoint predates take their defaults."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    given = {k: v for k, v in meta["model"].items() if k in known}
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), given))


def export_checkpoint(
    path: str, out_dir: str, groups: ProcessGroups, dtype: torch.dtype | None = None, role: str = "actor"
) -> None:
    """Write `role` of the checkpoint at `path` to `out_dir` in Hugging Face format (collective; `groups`
    must have the checkpoint's layout)."""
    meta = read_meta(path)
    saved = meta["layout"]
    check_layout(saved, run_layout(groups, saved["distributed_optimizer"]), path)
    model = model_config_from_meta(meta)
    shape = resolve_shape(model, model.vocab_size, groups.dims.tp)
    check_shape(meta["shape"], shape, path)
    chunks = build_gpt_chunks(shape, groups, init_std=model.init_std, recompute=False)
    state = read_rank_state(path, groups.rank, mmap=True)
    if role not in state["roles"]:
        raise ValueError(
            f"{rank_file(path, groups.rank)} has no {role!r} (it holds {sorted(state['roles'])})"
        )
    params = global_param_names(chunks, layer_ranges(groups, shape.num_layers))
    load_params(params, state["roles"][role]["model"], rank_file(path, groups.rank))
    config = hf_config_for(meta.get("source_hf_config"), shape, meta["special_token_ids"], dtype)
    save_hf_checkpoint(chunks, shape, groups, out_dir, meta["tokenizer_dir"] or None, config, dtype=dtype)


def main(argv: list[str] | None = None) -> None:
    from parallel.dims import ParallelDims
    from parallel.state import destroy_distributed, init_distributed, world_size_from_env

    parser = argparse.ArgumentParser(prog="python -m engine.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a global_step_<N> directory, or a run's output_dir (its latest)")
    parser.add_argument("out", help="output directory of the Hugging Face checkpoint")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="cast tensors (default: kept)")
    args = parser.parse_args(argv)
    path = find_checkpoint(args.checkpoint, "")
    layout = read_meta(path)["layout"]
    world = world_size_from_env()
    if world != layout["world_size"]:
        sys.exit(
            f"{path} was saved by {layout['world_size']} ranks (tp={layout['tp']} pp={layout['pp']} "
            f"vpp={layout['vpp']}); this is {world}. Fix: torchrun --nproc_per_node={layout['world_size']} "
            f"-m engine.export {args.checkpoint} {args.out}"
        )
    dims = ParallelDims(
        world_size=world,
        tp=layout["tp"],
        pp=layout["pp"],
        vpp=layout["vpp"],
        first_stage_layers=layout.get("first_stage_layers", 0),  # absent: the automatic split
        last_stage_layers=layout.get("last_stage_layers", 0),
        ep=layout.get("ep", 1),
    )
    groups = init_distributed(dims, args.device)
    try:
        export_checkpoint(path, args.out, groups, _DTYPES.get(args.dtype))
        if groups.rank == 0:
            print(f"exported {path} to {os.path.abspath(args.out)}", flush=True)
    except HFCheckpointError as err:  # a user error: one line, no traceback
        sys.exit(str(err))
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
