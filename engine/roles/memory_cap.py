"""A cap on the tokens of the trainer's default micro-batches from the memory their activations would take.

Without a token budget (`trainer.max_tokens_per_micro_batch=0`, the default) a micro-batch holds
`trainer.micro_batch_size` rows at the batch's width (engine/roles/dynamic_batch.py; with it empty, packed and
in one stage, at least 32,768 tokens: engine/micro_batch_sizing.py): its tokens grow with the longest
response, and the activations its backward keeps grow with them. At Qwen2.5-1.5B the layers keep
~73 KB per token and layer, ~2 MB per token over its 28 layers, so 8 rows of 256 + 16,384 tokens (133k tokens)
would need ~270 GB: out of memory on any GPU, where a 32k-token budget runs at a 92 GB peak on one H200
(scripts/bench/README.md). The cap keeps that default from asking for more than `MEMORY_FRACTION` of the
memory left once the models are built, at `activation_bytes_per_token`: it binds only where a micro-batch by
rows would come near the device's limit (by this count on one H200, 139 GiB: 1.5B past ~41k tokens, i.e.
responses longer than ~4.9k tokens at 8 rows; 0.5B past ~100k), and never where the user set a budget. On
the CPU the memory is the host's available memory, split evenly among the host's ranks (`host_free_bytes`).

`activation_bytes_per_token` counts what one token leaves saved in every layer of this rank for the backward,
in the model's dtype: the two norms' inputs and outputs (4 x hidden; divided by TP under sequence
parallelism), the query, key and value and the attention output (2 x query width + 2 x key/value width), and
the MLP's two-branch input to SwiGLU and its output (3 x ffn; MoE: top-k routed experts' widths plus the
shared expert, and the routed copies of the token); with full recompute, each layer's input plus one layer's
full set. Measured against it (peak memory of a 32k-token micro-batch minus the states, one H200): 0.5B ~42 KB
per token and layer against 40 KB counted, 1.5B ~71 KB against 73 KB. Under pipeline parallelism (1F1B) the
first stage keeps as many micro-batches in flight as there are stages, of its share of the layers: all the
layers' worth, as counted. The optimizer's AdamW states, allocated at its first step, are reserved first, and
so are the rollout's gathered weights where rollout.keep_rollout_weights keeps them through the update.
"""

from __future__ import annotations

import os

import torch

from engine.micro_batch_sizing import MEASURED_DEVICES, fill_tokens, micro_batch_rows
from engine.models.builder import ModelShape
from engine.models.layer_graphs import cached_bytes
from parallel.dims import ParallelDims
from parallel.rollout_weights import is_expert_param

MEMORY_FRACTION = 0.7
"""Share of the device's free memory (after the models, and the AdamW states to come) a micro-batch's
activations may take; the rest covers the output head's chunks, the backward's temporaries and the
allocator's fragmentation."""

ADAM_STATE_BYTES = 8
"""Two float32 moments per trainable parameter, allocated at the optimizer's first step."""


def activation_bytes_per_token(shape: ModelShape, dims: ParallelDims, recompute: bool) -> int:
    """Bytes of activations one token keeps for the backward on this rank (module docstring)."""
    h, tp = shape.hidden_size, dims.tp
    norms = 4 * h // (tp if dims.sp else 1)
    attention = (2 * shape.num_attention_heads + 2 * shape.num_query_groups) * shape.head_dim // tp
    if shape.moe is None:
        mlp = 3 * shape.ffn_hidden_size // tp
    else:
        m = shape.moe
        mlp = (3 * (m.top_k * m.ffn_hidden_size + m.shared_ffn_hidden_size) + 2 * m.top_k * h) // tp
    per_layer = (norms + attention + mlp) * shape.dtype.itemsize
    if recompute:
        return shape.num_layers * h * shape.dtype.itemsize // (tp if dims.sp else 1) + per_layer
    return shape.num_layers * per_layer


def trained_activation_bytes(shape: ModelShape, roles: list, dims: ParallelDims, recompute: bool) -> int:
    """`activation_bytes_per_token` of the largest model the micro-batches train: `shape` (the actor's) or a
    trainable role's (a critic larger than the actor keeps more per token; frozen roles run forward only)."""
    trained = [r.shape for r in roles if r is not None and getattr(r, "optimizer", None) is not None]
    return max(activation_bytes_per_token(s, dims, recompute) for s in [shape, *trained])


def adam_state_reserve(roles: list, distributed_optimizer: bool, dp: int) -> int:
    """Bytes the AdamW states of `roles` (MegatronRoles with an optimizer) will take on this rank: reserved
    whether or not a restored checkpoint already allocated them (a smaller cap, never a larger one)."""
    params = 0
    for role in roles:
        if role is None or getattr(role, "optimizer", None) is None:
            continue
        params += sum(p.numel() for m in role.models for p in m.parameters() if p.requires_grad)
    return ADAM_STATE_BYTES * params // (dp if distributed_optimizer else 1)


def kept_rollout_weights_reserve(cfg, actor, dims: ParallelDims) -> int:
    """Bytes the rollout's gathered weights hold through the update with rollout.keep_rollout_weights
    (parallel/hybrid_engine.py, parallel/expert_gather.py; else they are dropped after each rollout): the
    rollout shard (every stage's layers, 1/rollout.tp of each tensor, every expert) less this rank's training
    shard where the rollout reuses it in place (rollout.tp = parallel.tp; a TP merge copies it too)."""
    r = cfg.rollout
    if (
        actor is None
        or not r.keep_rollout_weights
        or r.weight_sync != "hybrid"
        or cfg.placement.mode == "split"
    ):
        return 0
    dense = experts = 0
    for model in actor.models:
        for name, param in model.named_parameters():
            nbytes = param.numel() * param.element_size()
            experts, dense = (experts + nbytes, dense) if is_expert_param(name) else (experts, dense + nbytes)
    reused = dense if r.tp == dims.tp else 0
    return dense * dims.tp * dims.pp // r.tp - reused + experts * (dims.ep * dims.pp - 1)


def memory_token_cap(free_bytes: int, reserve_bytes: int, bytes_per_token: int) -> int:
    """Tokens per micro-batch whose activations fit `MEMORY_FRACTION` of `free_bytes` less `reserve_bytes`
    (at least 1)."""
    usable = max(0, free_bytes - reserve_bytes) * MEMORY_FRACTION
    return max(1, int(usable // max(1, bytes_per_token)))


def device_free_bytes(device: torch.device) -> int:
    """The driver's free memory on `device` plus what the caching allocator holds unused."""
    return torch.cuda.mem_get_info(device)[0] + cached_bytes(device)


def host_free_bytes() -> int:
    """This process's share of the host's available memory: `_available_host_bytes` (less, where a cgroup
    limits the memory, what the cgroup has left), split evenly among the host's ranks (torchrun's
    LOCAL_WORLD_SIZE): on the CPU every rank trains in the same memory."""
    available = _available_host_bytes()
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        available = min(available, max(0, limit - used))
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def free_memory_bytes(device: torch.device) -> int:
    """The memory a micro-batch's activations may come from: `device_free_bytes` on CUDA, `host_free_bytes`
    on the CPU."""
    return device_free_bytes(device) if device.type == "cuda" else host_free_bytes()


def _available_host_bytes() -> int:
    """/proc/meminfo's MemAvailable; where there is none (not Linux), half the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def _read_int(path: str) -> int | None:
    """The integer in `path`, None where it is missing or not a number (cgroup v2's "max")."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def cap_line(
    cap: int,
    bytes_per_token: int,
    free_bytes: int,
    reserve_bytes: int,
    rows: int,
    fill: int,
    host: bool = False,
) -> str:
    """The run's startup line about the cap; `fill`: the fewest tokens micro-batches grow to (0: none); `host`:
    `free_bytes` is this rank's share of the host's memory (the CPU)."""
    size = f"{rows} rows at the batch's width (trainer.micro_batch_size)"
    where = " (this rank's share of the host's memory)" if host else ""
    if fill:
        size = f"the larger of {fill:,} tokens and {size[:-1]} empty)"
    return (
        f"micro-batches: {size}, at most {cap:,} tokens "
        f"each: {MEMORY_FRACTION:.0%} of {free_bytes / 2**30:.1f} GiB free{where}, less "
        f"{reserve_bytes / 2**30:.1f} GiB for AdamW's states (and kept rollout weights), at ~{bytes_per_token / 2**10:,.0f} KiB of "
        "activations per token (engine/roles/memory_cap.py; trainer.max_tokens_per_micro_batch sets a budget "
        "instead)"
    )


def trainer_token_cap(cfg, shape: ModelShape, groups, roles: list) -> int:
    """The cap for the trainer's micro-batcher (0: none): on CUDA or the CPU, without a token budget, outside the
    interleaved schedule; the smallest of every rank's (the ranks of a model replica must cut alike), and a
    startup line on the logging rank. `shape`: the actor's; `roles`: every built role, the actor first (the
    largest activations of the trainable ones count, as a larger critic's would; they reserve AdamW's
    states; the actor, any rollout weights kept through the update)."""
    t, dims = cfg.trainer, groups.dims
    if groups.device.type not in MEASURED_DEVICES or t.max_tokens_per_micro_batch or dims.vpp > 1:
        return 0
    per_token = trained_activation_bytes(shape, roles, dims, cfg.model.recompute)
    reserve = adam_state_reserve(roles, cfg.optim.distributed_optimizer, dims.dp)
    reserve += kept_rollout_weights_reserve(cfg, roles[0], dims)
    free = free_memory_bytes(groups.device)
    cap = torch.tensor([memory_token_cap(free, reserve, per_token)], device=groups.device)
    torch.distributed.all_reduce(cap, op=torch.distributed.ReduceOp.MIN, group=groups.world)
    if groups.is_logging_rank:
        fill = fill_tokens(t, groups.device.type, dims.pp)
        host = groups.device.type == "cpu"
        print(cap_line(int(cap), per_token, free, reserve, micro_batch_rows(t), fill, host), flush=True)
    return int(cap)
