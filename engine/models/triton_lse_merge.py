"""The shared-prompt split attention's merge (engine/models/shared_prompt_split.py `merge_parts`) as one Triton
kernel.

Each response token's two attention parts (over its own tokens, over its prompt's) merge by their log-sum-exps:
l = logaddexp(l_self, l_cross), out = lerp(o_cross, o_self, exp(l_self - l)), in float32, rounded once, and l
written back into both parts' log-sum-exp buffers (their backwards read it). The parts come from cuDNN or
FlashAttention-2 as token-major (..., heads, dim) views and head-major log-sum-exps viewed token-major; the
compiled `merge_parts` over those views ran at ~1/7 of the bandwidth (0.5B: 390 us per call for ~180 MB; one
H100, scripts/bench/README.md "Update"). Here a program takes a block of tokens with all their heads: the
log-sum-exps are read and written once per (token, head), the outputs a whole head dim at a time.

Views of up to three leading dims (the dense split's (G, n, R, ...), the varlen split's (tokens, ...)) with any
strides and a unit stride over the head dim; `out` may alias `o_self`. Parity:
tests/engine/interpreted_training_kernels.py (the interpreter, float16, against `merge_parts` in both forms' views)
and, on CUDA, the split's device check (`split_available`) and tests/engine/test_packing_gpu.py.
"""

from __future__ import annotations

import torch

from engine.models.triton_support import elementwise_supported, tl, triton

ELEMENTS = 8192
"""Elements of each part's output one program holds (its tokens: this over the heads' tile x head dim)."""

if triton is not None:

    @triton.jit
    def _at(i0, i1, i2, s0, s1, s2):
        """The offsets of tokens (i0, i1, i2) in a view of leading strides (s0, s1, s2), as a column."""
        return (i0 * s0 + i1 * s1 + i2 * s2)[:, None]

    @triton.jit
    def _merge(
        os_ptr, ls_ptr, oc_ptr, lc_ptr, out_ptr, tokens, size1, size2, heads,
        s_os0, s_os1, s_os2, s_osh, s_ls0, s_ls1, s_ls2, s_lsh, s_oc0, s_oc1, s_oc2, s_och,
        s_lc0, s_lc1, s_lc2, s_lch, s_out0, s_out1, s_out2, s_outh,
        BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, DIM: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        live = t < tokens
        i0 = (t // (size1 * size2)).to(tl.int64)
        i1 = ((t // size2) % size1).to(tl.int64)
        i2 = (t % size2).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        ok = live[:, None] & (h < heads)[None, :]
        at_ls = ls_ptr + _at(i0, i1, i2, s_ls0, s_ls1, s_ls2) + h[None, :] * s_lsh
        at_lc = lc_ptr + _at(i0, i1, i2, s_lc0, s_lc1, s_lc2) + h[None, :] * s_lch
        l_self = tl.load(at_ls, mask=ok, other=0.0).to(tl.float32)
        l_cross = tl.load(at_lc, mask=ok, other=0.0).to(tl.float32)
        top = tl.maximum(l_self, l_cross)
        gap = tl.where(top == float("-inf"), 0.0, tl.abs(l_self - l_cross))  # both -inf: no keys at all
        merged = top + tl.log(1.0 + tl.exp(-gap))
        weight = tl.exp(l_self - merged)[:, :, None]  # the self part's share of the token's softmax
        d = tl.arange(0, DIM)[None, None, :]
        ok3 = ok[:, :, None]
        at_os = os_ptr + (_at(i0, i1, i2, s_os0, s_os1, s_os2) + h[None, :] * s_osh)[:, :, None] + d
        at_oc = oc_ptr + (_at(i0, i1, i2, s_oc0, s_oc1, s_oc2) + h[None, :] * s_och)[:, :, None] + d
        o_self = tl.load(at_os, mask=ok3, other=0.0).to(tl.float32)
        o_cross = tl.load(at_oc, mask=ok3, other=0.0).to(tl.float32)
        diff = o_self - o_cross  # torch.lerp's two-sided form: exact at both ends
        out = tl.where(weight < 0.5, o_cross + weight * diff, o_self - diff * (1.0 - weight))
        at_out = out_ptr + (_at(i0, i1, i2, s_out0, s_out1, s_out2) + h[None, :] * s_outh)[:, :, None] + d
        tl.store(at_out, out.to(out_ptr.dtype.element_ty), mask=ok3)
        tl.store(at_ls, merged, mask=ok)
        tl.store(at_lc, merged, mask=ok)


def supported(o_self: torch.Tensor, l_self: torch.Tensor, o_cross: torch.Tensor, l_cross, out) -> bool:
    """The kernel applies: Triton runs here for the parts' dtype (half precision), float32 log-sum-exps, a
    power-of-two head dim at unit stride, at most three leading dims."""
    dim = o_self.shape[-1]
    outputs = (o_self, o_cross, out)
    return (
        elementwise_supported(o_self.device, o_self.dtype)
        and o_self.dtype in (torch.float16, torch.bfloat16)
        and l_self.dtype == l_cross.dtype == torch.float32
        and dim & (dim - 1) == 0
        and all(x.stride(-1) == 1 and x.shape == o_self.shape for x in outputs)
        and l_self.shape == l_cross.shape == o_self.shape[:-1]
        and 2 <= l_self.dim() <= 4
    )


def _lead3(x: torch.Tensor, keep: int) -> tuple[int, ...]:
    """The strides of x's dims before its last `keep`, padded in front to three (size-1 dims: stride 0)."""
    strides = x.stride()[: x.dim() - keep]
    return (0,) * (3 - len(strides)) + tuple(strides)


def merge_parts(o_self, l_self, o_cross, l_cross, out) -> None:
    """engine/models/shared_prompt_split.py `merge_parts` (same arguments and results) in one launch;
    `supported(...)` must hold."""
    lead = o_self.shape[:-2]
    sizes = (1,) * (3 - len(lead)) + tuple(lead)
    tokens, heads, dim = sizes[0] * sizes[1] * sizes[2], o_self.shape[-2], o_self.shape[-1]
    if tokens == 0:
        return
    strides = []
    for x, keep in ((o_self, 2), (l_self, 1), (o_cross, 2), (l_cross, 1), (out, 2)):
        strides += [*_lead3(x, keep), x.stride(-2) if keep == 2 else x.stride(-1)]
    block_h = triton.next_power_of_2(heads)
    block_t = max(1, ELEMENTS // (block_h * dim))
    _merge[(triton.cdiv(tokens, block_t),)](
        o_self, l_self, o_cross, l_cross, out, tokens, sizes[1], sizes[2], heads, *strides,
        BLOCK_T=block_t, BLOCK_H=block_h, DIM=dim, num_warps=8,
    )  # fmt: skip
