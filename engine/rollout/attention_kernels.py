"""Which decode attention kernel the native engine's forward (engine/rollout/model.py) runs, and the
FlashAttention-2 varlen calls (decode, prefill): the kernel choice (`DecodeKernels`, `decode_attention_kernel`)
lives here so that the forward reads as the model alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.rollout import triton_decode


def flash_decode_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether FlashAttention-2 (built into torch) runs the decode attention: CUDA sm80+, half precision,
    head_dim a multiple of 8 up to 256, and torch's flash SDPA backend enabled."""
    return (
        device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and head_dim % 8 == 0
        and head_dim <= 256
        and torch.backends.cuda.flash_sdp_enabled()
        and torch.cuda.get_device_capability(device) >= (8, 0)
    )


def flash_varlen_decode(q, cache_k, cache_v, cum_q, cum_k, used_k) -> torch.Tensor:
    """FlashAttention-2 varlen decode: q (b, groups, heads per group, dim) with the heads of a group folded into
    the query axis (cumulative query lengths `cum_q`), row r's keys at flat cache positions starting at
    `cum_k[r]`, `used_k[r]` of them; cache (b, positions, groups, dim). Returns (b, groups, per group, dim)."""
    b, g, pg, hd = q.shape
    out = torch.ops.aten._flash_attention_forward(
        q.transpose(1, 2).reshape(b * pg, g, hd),
        cache_k.view(-1, g, hd),
        cache_v.view(-1, g, hd),
        cum_q,
        cum_k,
        pg,
        cache_k.shape[1],
        0.0,
        False,
        False,
        seqused_k=used_k,
    )[0]
    return out.view(b, pg, g, hd).transpose(1, 2)


def flash_prefill_offsets(pad_u: torch.Tensor, n: int) -> torch.Tensor:
    """Sequence offsets for `flash_varlen_prefill` of u left-padded prompts of n positions (`pad_u` (u,) pad
    tokens each), flattened to u * n tokens: sequence 0 is row 0's pads (empty where it has none), then row
    i's real tokens followed by row i + 1's pads, the last row's real tokens last. Causal attention keeps every
    real token on its own row's real tokens; pads attend to the row before them (finite, never read). On the
    device: (u + 2,) int32, no host sync."""
    u = pad_u.numel()
    starts = torch.arange(u, device=pad_u.device) * n + pad_u  # each row's first real token
    ends = starts.new_tensor([0, u * n])
    return torch.cat((ends[:1], starts, ends[1:])).to(torch.int32)


def flash_varlen_prefill(q, k, v, cum: torch.Tensor) -> torch.Tensor:
    """FlashAttention-2 varlen causal self-attention of prefill: q (u, n, groups, heads per group, dim), k and v
    (u, n, groups, dim) (views: unit stride over dim), sequences at offsets `cum` (`flash_prefill_offsets`)
    of the u * n flattened tokens. Returns (u * n, heads, dim), contiguous."""
    u, n, g, pg, hd = q.shape
    return torch.ops.aten._flash_attention_forward(
        q.reshape(u * n, g * pg, hd),
        k.reshape(u * n, g, hd),
        v.reshape(u * n, g, hd),
        cum,
        cum,
        2 * n,  # bounds every sequence: a row's real tokens and the next row's pads
        2 * n,
        0.0,
        True,
        False,
    )[0]


ATTENTION_KERNELS = ("triton", "flash", "sdpa")


@dataclass
class DecodeKernels:
    """Which fast kernels the rollout forward uses where they apply (CUDA, half precision)."""

    attention: str = "auto"
    """Decode attention: "triton" (engine/rollout/triton_decode.py), "flash" (FlashAttention-2 varlen over each
    row's written keys), "sdpa" (masked SDPA over the first `num_keys` positions: the plain path), or "auto":
    the first of those that applies here (CPU: sdpa)."""
    compiled: bool = True
    """Residual add + RMSNorm, SwiGLU and RoPE as torch.compile'd kernels (ENGINE_COMPILE_ROLLOUT=0: off)."""
    fused: bool = True
    """With the Triton or flash decode attention: RoPE and the K/V cache writes as one Triton kernel
    (engine/rollout/triton_rope_kv.py; not with QK-norm), and the Triton kernel's split merge as one Triton
    kernel. False: the compiled RoPE, two indexed writes, the compiled merge (the baseline of
    scripts/bench/rollout.py's `native_unfused`)."""
    rope_in_attention: bool = True
    """With `fused` and the Triton decode attention: RoPE of the step's query heads and key, and the K/V cache
    writes, inside the attention kernel (engine/rollout/triton_decode.py `rope`): one launch per layer and
    step instead of two (at narrow batches each is a few microseconds of launch and ramp). False: the separate
    RoPE/K-V kernel (engine/rollout/triton_rope_kv.py; the baseline of scripts/bench/rollout.py's
    `native_rope_kernel`)."""
    sampler: bool = True
    """Temperature sampling without top-k/top-p as a two-level inverse CDF in two Triton kernels, on the decode
    step's logits in the model's dtype (engine/rollout/triton_sample.py). False: the torch draw on float32
    logits (engine/rollout/sampler.py; the baseline of scripts/bench/rollout.py's `native_torch_sampler`)."""
    shared_prefix: bool = True
    """With the Triton decode attention, in calls of n > 1 samples per prompt: each sample reads its prompt's
    K/V (which every sample holds a copy of) from the copy of its group's first live sample, which the GPU's L2
    cache then serves to the others (engine/rollout/triton_decode.py `sourced`), in decode batches of
    `shared_prefix_min_rows` rows or more: 7% faster rollouts at 1.5B with n = 8 on an H200. False: each
    reads its own copy (scripts/bench/rollout.py's `native_unshared`). Figures: scripts/bench/README.md,
    "Rollout"."""
    shared_prefix_min_rows: int = 64
    """Narrower batches read their own copies: there the prompt is a small share of the keys (the long tail's
    last rows), and the shared read was measured at 64 rows and more only (scripts/bench/README.md,
    "Rollout")."""
    attention_tiles: tuple[int, ...] | None = None
    """The Triton decode attention's (key block, warps, pipeline stages[, register cap]); None: the kernel's
    defaults (triton_decode.py `decode_attention`). The cap is Triton's `maxnreg` launch option: fewer registers
    per thread, more programs per SM (scripts/bench/kernel_registers.py counts them ahead of time).
    scripts/bench/rollout.py's `native_tiles` times a choice against the default in the same run."""
    attention_occupancy: bool = True
    """Where `attention_tiles` names no register cap: each launch of the Triton decode attention capped at the
    registers that fit its programs (rows x KV groups x key splits) in the fewest waves over the GPU's SMs,
    from a ladder of caps per kernel variant with at most 32 B spilled (engine/rollout/occupancy.py), or
    uncapped where no cap saves a wave. Measured (scripts/bench/README.md, "Rollout", 85887c7 and 0a930bf): on an
    H100 2.5-2.7% faster rollouts at 0.5B (fixed 512, long tail to 1,024) and 1.5B (long tail to 4,096); on an
    H200 at 0.5B fixed, the cap it picks there (64) set by hand, 3.3-4.4%. False: every launch uncapped
    (scripts/bench/rollout.py's `native_uncapped`)."""

    mlp: bool = True
    """At rollout.tp=1, a dense layer's MLP at steps of <= 64 rows as two Triton kernels that deal the weights
    to the SMs evenly (engine/rollout/triton_mlp.py; fc2's split partials added by the next residual add +
    RMSNorm, model.py `add_partials_rms_norm`). Measured on an H100 (scripts/bench/README.md, "Rollout",
    1ca151b): the MLP and its norms 8-16% faster at widths <= 16, the 1.5B long tail to 16,384 1.1% faster.
    False: cuBLAS and the compiled SwiGLU (scripts/bench/rollout.py's `native_cublas_mlp`)."""

    def __post_init__(self) -> None:
        if self.attention_tiles is None:
            return
        block_n, warps, stages, *cap = (*self.attention_tiles, 0, 0, 0)[: max(3, len(self.attention_tiles))]
        if (
            len(cap) > 1
            or block_n < 16
            or block_n & (block_n - 1)
            or warps not in (1, 2, 4, 8, 16)
            or stages < 1
            or not all(24 <= c <= 255 for c in cap)
        ):
            raise ValueError(
                f"DecodeKernels.attention_tiles={self.attention_tiles}: expected (key block: a power of two "
                ">= 16, warps: 1, 2, 4, 8 or 16, pipeline stages >= 1[, register cap: 24..255]), e.g. (64, 4, 2)"
            )

    def attention_knobs(self) -> dict[str, int]:
        """`attention_tiles` and `attention_occupancy` as triton_decode.decode_attention's keyword arguments ({}:
        its defaults)."""
        names = ("block_n", "num_warps", "num_stages", "max_registers")
        knobs = dict(zip(names, self.attention_tiles or ()))
        if self.attention_occupancy and "max_registers" not in knobs:  # (a named cap is the launch's)
            knobs["occupancy"] = True
        return knobs


def decode_attention_kernel(
    wanted: str, device: torch.device, dtype: torch.dtype, head_dim: int, per_group: int
) -> str:
    """Resolve `DecodeKernels.attention` for this device, dtype and head shape; a named kernel that cannot
    run here is an error."""
    ok = {
        "triton": triton_decode.supported(device, dtype, head_dim, per_group),
        "flash": flash_decode_supported(device, dtype, head_dim),
        "sdpa": True,
    }
    if wanted == "auto":
        return next(k for k in ATTENTION_KERNELS if ok[k])
    if wanted not in ok:
        raise ValueError(
            f"decode attention kernel {wanted!r}: pick one of auto, {', '.join(ATTENTION_KERNELS)}"
        )
    if not ok[wanted]:
        raise ValueError(
            f"decode attention kernel {wanted!r} cannot run on {device} in {dtype} with head_dim {head_dim}: "
            "use 'auto'"
        )
    return wanted
