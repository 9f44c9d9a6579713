"""The actor's forward as plain functions of this rank's rollout-layout weight shards, for the native engine.

It re-implements megatron's GPTModel with our layer spec (engine/models/spec.py: RMSNorm in float32, fused
QKV interleaved per query group, optional QKV bias and QK-norm, RoPE with megatron's cos/sin rounding and
Llama-3 scaling, SDPA core attention, SwiGLU [gate; up] or a mixture of experts (engine/models/moe.py: the
router's top-k and weights as megatron computes them; the experts as grouped GEMMs where that runs without
host syncs: engine/rollout/moe_experts.py), tied or untied output layer) because the rollout TP size differs
from the training modules' (parity: tests/engine/test_rollout_native.py). KV cache and bookkeeping: native.py.

Three entry points:
- `prefill`: left-padded prompts (u, s) -> logits of the last position, K/V written into cache rows;
- `prefill_continued`: new tokens of rows whose earlier K/V are in the cache (the next turn of an episode),
  attending over the row's cache and each other, causally -> logits of the last position;
- `decode`: one token per cache row, each row at its own cache position `cur[r]` (a device tensor, so that the
  step can be captured in a CUDA graph), attending over the row's written positions.
A layer's KV cache is (rows, positions, groups, head_dim): a row's keys are contiguous (flash reads them).

Kernels (`DecodeKernels`; CUDA only, the attention kernels in half precision; CPU runs the plain path):
- decode attention, first that applies: the Triton flash-decoding kernel of engine/rollout/triton_decode.py
  (16-row query tiles holding a KV group's query heads, each row's keys [pad, cur] streamed once);
  FlashAttention-2 varlen (`torch.ops.aten._flash_attention_forward`: row r's keys start at its first real
  position and `seqused_k` stops them at `cur`; the query heads of a group folded into the query axis, which
  FA2 pads to 128-row tiles); the plain path: SDPA with a boolean mask over the first `num_keys` positions,
  query heads folded the same way (memory-efficient or cuDNN kernel on GPU);
- the elementwise chains compiled into one kernel each (torch.compile): residual add + RMSNorm, SwiGLU, RoPE;
- a dense MLP at <= 64 rows and rollout.tp=1 (`DecodeKernels.mlp`): fc1 + SwiGLU and fc2 as two Triton kernels
  that deal the weights to the SMs evenly (triton_mlp.py; fc2's split partials added by the next residual add + RMSNorm);
- with the Triton or flash attention (`DecodeKernels.fused`): a decode step's RoPE and K/V cache writes as one
  Triton kernel (triton_rope_kv.py; inside the Triton attention's: `rope_in_attention`), the merge another;
- with `DecodeKernels.sampler` where Triton runs, decode's logits stay in the model's dtype (`upcast=False`,
  as the engine asks) for the Triton draw (engine/rollout/triton_sample.py), which reads them once.
Prefill attention: FlashAttention-2 varlen, causal, over each prompt's real tokens (the GQA heads as they are,
no mask) where the flash kernel runs and the fast kernels are on; SDPA with a mask over the left padding
otherwise (CPU, float32, `DecodeKernels(attention="sdpa")`). Measured: scripts/bench/README.md, "Rollout".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.models import moe
from engine.models.builder import ModelShape
from engine.models.compiled import ROLLOUT, cuda_kernel
from engine.models.triton_support import dot_supported, elementwise_supported
from engine.rollout import triton_decode, triton_mlp, triton_rope_kv
from engine.rollout.attention_kernels import (
    DecodeKernels,
    decode_attention_kernel,
    flash_decode_supported,
    flash_prefill_offsets,
    flash_varlen_decode,
    flash_varlen_prefill,
)
from engine.rollout.moe_experts import MoEWeights, moe_layer
from engine.rollout.paged_kv import positions_at
from engine.rollout.rope import apply_rope, signed_sin
from parallel.rollout_weights import RolloutWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """engine.models.spec.RMSNorm (fused, the default) as a function: normalise in float32, round once to the
    input dtype, scale in the input dtype."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def add_rms_norm(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: (x + y, rms_norm(x + y))."""
    s = x + y
    return s, rms_norm(s, weight, eps)


def add_partials_rms_norm(
    x: torch.Tensor, parts: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm` of float32 partial sums `parts` (split, *x.shape) (engine/rollout/triton_mlp.py's `fc2`
    with a split): added in order and rounded once to x's dtype first."""
    return add_rms_norm(x, parts.sum(0).to(x.dtype), weight, eps)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """megatron's SwiGLU on the fused [gate; up] projection: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass
class _Layer:
    """One transformer layer's shards (names: decoder.layers.{i}.*)."""

    input_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    proj_w: torch.Tensor
    mlp_norm: torch.Tensor
    fc1_w: torch.Tensor | None
    """Dense SwiGLU [gate; up] (None in an MoE layer)."""
    fc2_w: torch.Tensor | None
    moe: MoEWeights | None = None
    """The MoE MLP's weights (None in a dense layer)."""


def _required(params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in params:
        raise KeyError(
            f"rollout weights lack {name!r}: the weight transition must run (to_rollout) before generate, "
            "and its weights must stay alive until generate returns"
        )
    return params[name]


class RolloutModel:
    """The forward of one rollout-TP rank; its collectives run over `weights.tp_group`."""

    def __init__(
        self,
        shape: ModelShape,
        weights: RolloutWeights,
        rope: tuple[torch.Tensor, torch.Tensor],
        kernels: DecodeKernels | None = None,
    ):
        if weights.pp_size != 1:
            raise ValueError(
                f"rollout.pp={weights.pp_size}: the native rollout engine runs whole models (rollout.pp=1); "
                "set rollout.pp=1"
            )
        t, s = weights.tp_size, shape
        for key, value in (
            ("num_attention_heads", s.num_attention_heads),
            ("num_query_groups", s.num_query_groups),
        ):
            if value % t:
                raise ValueError(
                    f"model.{key}={value} is not divisible by rollout.tp={t}; pick a rollout.tp dividing it"
                )
        self.shape, self.tp_size, self.tp_group = s, t, weights.tp_group
        self.heads, self.groups = s.num_attention_heads // t, s.num_query_groups // t
        self.per_group, self.head_dim = self.heads // self.groups, s.head_dim
        self.vocab_shard = s.padded_vocab_size // t
        self.vocab_start = weights.tp_rank * self.vocab_shard
        p = weights.params
        self.embed_w = _required(p, "embedding.word_embeddings.weight")
        if tuple(self.embed_w.shape) != (self.vocab_shard, s.hidden_size):
            raise ValueError(
                f"embedding shard has shape {tuple(self.embed_w.shape)}, expected ({self.vocab_shard}, "
                f"{s.hidden_size}) for rollout.tp={t}: the weights do not match the model shape"
            )
        self.final_norm = _required(p, "decoder.final_layernorm.weight")
        self.out_w = p["output_layer.weight"] if "output_layer.weight" in p else self.embed_w
        self.layers = [self._layer(p, i) for i in range(s.num_layers)]
        self.routes: list[torch.Tensor] | None = None
        """MoE: while a list, every layer's expert indices (tokens, k) are appended to it, layer by layer."""
        self.dtype = self.embed_w.dtype
        self.cos, self.sin = rope[0], signed_sin(rope[1])
        kernels = kernels or DecodeKernels()
        dev = self.embed_w.device
        self.attention = decode_attention_kernel(
            kernels.attention, dev, self.dtype, self.head_dim, self.per_group
        )

        def kernel(fn):
            return cuda_kernel(fn, dev, ROLLOUT, dynamic=None) if kernels.compiled else fn

        self._add_norm, self._norm = kernel(add_rms_norm), kernel(rms_norm)
        self._add_partials_norm = kernel(add_partials_rms_norm)  # (its own compiles: not add_norm's shapes)
        self._swiglu, self._rope = kernel(swiglu), kernel(apply_rope)
        self.fused = kernels.fused and self.attention in ("triton", "flash")
        self.prefill_flash = self.attention != "sdpa" and flash_decode_supported(
            dev, self.dtype, self.head_dim
        )
        """Prefill attention by FlashAttention-2 varlen (`flash_varlen_prefill`), else SDPA with a mask."""
        self.shared_prefix = kernels.shared_prefix and self.attention == "triton"
        """`decode` takes a `prefix`: rows that hold a prompt's K/V read it from one row's copy."""
        self.fused_sampler = kernels.sampler and elementwise_supported(dev, self.dtype)
        """The engine draws with engine/rollout/triton_sample.py: decode returns logits in the model's dtype."""
        no_qk_norm = all(la.q_norm is None for la in self.layers)
        self.fused_rope_kv = self.fused and triton_rope_kv.triton is not None and no_qk_norm
        in_triton = self.attention == "triton" and kernels.rope_in_attention
        self.rope_in_attention = self.fused_rope_kv and in_triton  # RoPE and K/V writes in its kernel
        self.attention_knobs = kernels.attention_knobs()  # the Triton attention's tiles and register caps
        # at <= 64 rows and rollout.tp=1 (TP > 1 would all-reduce the partials' rounded sum: not yet run)
        dense = [w for la in self.layers if la.moe is None for w in (la.fc1_w, la.fc2_w)]
        self.triton_mlp = kernels.mlp and t == 1 and dot_supported(dev, self.dtype)
        self.triton_mlp = self.triton_mlp and triton_mlp.contiguous(*dense)

    def _layer(self, p: dict[str, torch.Tensor], i: int) -> _Layer:
        pre = f"decoder.layers.{i}."
        att = pre + "self_attention."
        dense = self.shape.moe is None
        return _Layer(
            input_norm=_required(p, pre + "input_layernorm.weight"),
            qkv_w=_required(p, att + "linear_qkv.weight"),
            qkv_b=p.get(att + "linear_qkv.bias"),
            q_norm=p.get(att + "q_layernorm.weight"),
            k_norm=p.get(att + "k_layernorm.weight"),
            proj_w=_required(p, att + "linear_proj.weight"),
            mlp_norm=_required(p, pre + "pre_mlp_layernorm.weight"),
            fc1_w=_required(p, pre + "mlp.linear_fc1.weight") if dense else None,
            fc2_w=_required(p, pre + "mlp.linear_fc2.weight") if dense else None,
            moe=None if dense else moe_layer(p, pre + "mlp.", self.shape.moe, _required),
        )

    def expert_views(self) -> list[torch.Tensor]:
        """MoE: the stacked expert weights of the grouped path (built here if they are not): a CUDA graph of
        the decode step is valid only while they keep their addresses."""
        out = []
        for layer in self.layers:
            if layer.moe is not None and layer.moe.grouped:
                layer.moe.stack()
                out += [layer.moe.fc1_efh, layer.moe.fc2_ehf]
        return out

    def free_stacked_experts(self) -> None:
        """Drop the stacked expert weights (a copy unless they are views: engine/rollout/moe_experts.py)."""
        for layer in self.layers:
            if layer.moe is not None:
                layer.moe.free_stacked()

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        """The layer's MLP on normed hidden states h (b, s, hidden), summed over the TP group. MoE: the
        router and the routed experts run whole on every TP rank (training's numerics and rounding order:
        engine/models/moe.py); only the shared expert's partial sums are reduced."""
        if layer.moe is None and self.triton_mlp and h.numel() <= triton_mlp.MAX_ROWS * h.shape[-1]:
            return triton_mlp.decode_mlp(h, layer.fc1_w, layer.fc2_w)  # fc2's partials: `_layers` adds them
        if layer.moe is None:
            return self._all_reduce(F.linear(self._swiglu(F.linear(h, layer.fc1_w)), layer.fc2_w))
        w, h_th = layer.moe, h.reshape(-1, h.shape[-1])
        out, index_tk = w.routed(h_th, self.shape.moe)
        if self.routes is not None:  # recording for routing replay (engine/rollout/routes.py)
            self.routes.append(index_tk)
        if w.shared_fc1 is not None:
            out = out + self._all_reduce(moe.shared_expert(h_th, w.shared_fc1, w.shared_fc2, w.shared_gate))
        return out.view_as(h)

    # ---- pieces ---------------------------------------------------------------------------------
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(...,) token ids -> (..., hidden): vocab-parallel lookup, summed over the TP group."""
        if self.tp_size == 1:
            return F.embedding(ids, self.embed_w)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_shard)
        x = F.embedding(local.clamp(0, self.vocab_shard - 1), self.embed_w)
        return self._all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))

    def logits(self, h_bh: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """(b, hidden) final-normed hidden states -> (b, vocab_size) logits over the real vocabulary: float32, or
        with `upcast=False` in the model's dtype (a view of the head's output where TP is 1)."""
        local = F.linear(h_bh, self.out_w)  # (b, vocab/tp)
        if self.tp_size > 1:
            b = local.shape[0]
            parts = local.new_empty(self.tp_size * b, self.vocab_shard)  # gloo wants rank-major rows
            dist.all_gather_into_tensor(parts, local.contiguous(), group=self.tp_group)
            local = parts.view(self.tp_size, b, self.vocab_shard).permute(1, 0, 2).reshape(b, -1)
        local = local[:, : self.shape.vocab_size]
        return local.float() if upcast else local

    def _projected(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        """h (b, s, hidden) -> the fused QKV projection (b, s, groups, heads per group + 2, dim): each group's
        query heads, then its key and value."""
        qkv = F.linear(h, layer.qkv_w, layer.qkv_b)
        return qkv.view(*h.shape[:2], self.groups, self.per_group + 2, self.head_dim)

    def _qkv(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h (b, s, hidden) -> q (b, s, groups, heads per group, dim), k and v (b, s, groups, dim), QK-norm and
        RoPE applied (`cos`, `sin` broadcast as (b, s, 1, 1, dim)). The query heads of a group and its key
        are adjacent in the fused projection, so RoPE runs on both at once."""
        pg, eps = self.per_group, self.shape.norm_eps
        qkv = self._projected(layer, h)
        if layer.q_norm is None:
            qk = qkv[:, :, :, : pg + 1]
        else:
            q = self._norm(qkv[:, :, :, :pg], layer.q_norm, eps)
            k = self._norm(qkv[:, :, :, pg : pg + 1], layer.k_norm, eps)
            qk = torch.cat((q, k), dim=3)
        qk = self._rope(qk, cos, sin)
        return qk[:, :, :, :pg], qk[:, :, :, pg], qkv[:, :, :, pg + 1]

    def _layers(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend, raw=False
    ) -> torch.Tensor:
        """Every transformer layer on embeddings `x` (b, s, hidden) with RoPE tables `cos`, `sin` broadcast as
        (b, s, 1, 1, dim); `attend(i, q, k, v)` returns layer i's attention output (b, s, heads * dim) (`raw`:
        `attend(i, qkv, None, None)` with the projection before QK-norm and RoPE, `_projected`). Returns the
        final-normed hidden states. Each residual add is fused with the norm that follows it (the next
        layer's input norm, the final norm after the last)."""
        eps, layers = self.shape.norm_eps, self.layers
        h = self._norm(x, layers[0].input_norm, eps)
        for i, layer in enumerate(layers):
            q, k, v = (self._projected(layer, h), None, None) if raw else self._qkv(layer, h, cos, sin)
            proj = self._all_reduce(F.linear(attend(i, q, k, v), layer.proj_w))
            x, h = self._add_norm(x, proj, layer.mlp_norm, eps)
            mlp = self._mlp(layer, h)
            after = layers[i + 1].input_norm if i + 1 < len(layers) else self.final_norm
            x, h = (self._add_partials_norm if mlp.dim() > x.dim() else self._add_norm)(x, mlp, after, eps)
        return h

    # ---- entry points ---------------------------------------------------------------------------
    def prefill(
        self,
        ids_us: torch.Tensor,
        pad_u: torch.Tensor,
        cache_k: list[torch.Tensor],
        cache_v: list[torch.Tensor],
        row_prompt: torch.Tensor,
        at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run left-padded prompts `ids_us` (u, s) with `pad_u` leading pad tokens each; write their K/V at
        cache positions [0, s) of the cache rows (`cache_k[l]` (rows, >= s, groups, dim), row r holding prompt
        `row_prompt[r]`; paged: `cache_k[l]` is the flat (positions, groups, dim) buffer and row r's position
        j sits at `at[r, j]`); return the logits of the last position, (u, vocab_size) float32.

        Real tokens never attend to pad positions. With SDPA (a mask) pad positions attend to themselves only,
        so their K/V stay finite (a fully masked row would be NaN and poison the real rows through 0 * NaN in
        the value sum); with FlashAttention-2 (`prefill_flash`) a row's pads close the previous row's sequence
        (`flash_prefill_offsets`): finite, and never read.
        """
        u, n = ids_us.shape
        dev = ids_us.device
        ar = torch.arange(n, device=dev)
        pos = (ar - pad_u[:, None]).clamp(min=0)  # (u, s): positions count real tokens only
        cos, sin = self.cos[pos][:, :, None, None], self.sin[pos][:, :, None, None]  # (u, s, 1, 1, dim)
        if self.prefill_flash:  # FlashAttention-2 varlen, causal: no mask, no repeated K/V heads
            cum = flash_prefill_offsets(pad_u, n)
        else:
            mask = (ar[None, None, :] >= pad_u[:, None, None]) & (ar[None, :, None] >= ar[None, None, :])
            mask = (mask | torch.eye(n, dtype=torch.bool, device=dev)).unsqueeze(1)  # (u, 1, queries, keys)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if at is None:
                cache_k[i][:, :n], cache_v[i][:, :n] = k[row_prompt], v[row_prompt]
            else:
                cache_k[i][at], cache_v[i][at] = k[row_prompt], v[row_prompt]
            if self.prefill_flash:
                return flash_varlen_prefill(q, k, v, cum).view(u, n, self.heads * self.head_dim)
            q = q.reshape(u, n, self.heads, self.head_dim).transpose(1, 2)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # (u, groups, s, dim)
            if self.per_group > 1:
                k, v = k.repeat_interleave(self.per_group, dim=1), v.repeat_interleave(self.per_group, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (u, heads, s, dim)
            return out.transpose(1, 2).reshape(u, n, self.heads * self.head_dim)

        h = self._layers(self.embed(ids_us), cos, sin, attend)
        return self.logits(h[:, -1])

    def prefill_continued(
        self,
        ids_uc: torch.Tensor,
        real_uc: torch.Tensor,
        pad_u: torch.Tensor,
        end: int,
        cache_k: list[torch.Tensor],
        cache_v: list[torch.Tensor],
    ) -> torch.Tensor:
        """Prefill with the past in the cache: tokens `ids_uc` (u, c) sit at cache positions [end - c, end) of
        rows [0, u), whose earlier positions [pad_u[r], end - c) already hold K/V; only the positions where
        `real_uc` is true are new tokens (the others, right-aligned rows' leading fillers, keep what the cache
        holds: their K/V are not written). Queries attend causally over [pad_u[r], own position]. Returns the
        logits of the last position, (u, vocab_size) float32.

        A filler query attends to its own cache position as well, so that no query row is fully masked (a NaN
        there would not reach real rows: filler K/V are never written, and real queries read the cache)."""
        u, c = ids_uc.shape
        dev = ids_uc.device
        at_q, at_k = torch.arange(end - c, end, device=dev), torch.arange(end, device=dev)
        pos = (at_q[None] - pad_u[:, None]).clamp(min=0)  # (u, c): positions count real tokens only
        mask = (at_k[None, None] >= pad_u[:, None, None]) & (at_k[None, None] <= at_q[None, :, None])
        mask = (mask | (at_k[None, None] == at_q[None, :, None])).unsqueeze(1)  # (u, 1, queries, keys)
        cos, sin = self.cos[pos][:, :, None, None], self.sin[pos][:, :, None, None]  # (u, c, 1, 1, dim)
        new = real_uc[:, :, None, None]  # (u, c, 1, 1)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            for cache, x in ((cache_k[i], k), (cache_v[i], v)):
                window = cache[:, end - c : end]
                window.copy_(torch.where(new, x, window))
            q = q.reshape(u, c, self.heads, self.head_dim).transpose(1, 2)
            k, v = (
                cache_k[i][:, :end].transpose(1, 2),
                cache_v[i][:, :end].transpose(1, 2),
            )  # (u, groups, end, d)
            if self.per_group > 1:
                k, v = k.repeat_interleave(self.per_group, dim=1), v.repeat_interleave(self.per_group, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (u, heads, c, dim)
            return out.transpose(1, 2).reshape(u, c, self.heads * self.head_dim)

        h = self._layers(self.embed(ids_uc), cos, sin, attend)
        return self.logits(h[:, -1])

    def decode(
        self,
        tokens_b: torch.Tensor,
        pad_b: torch.Tensor,
        cur: torch.Tensor,
        cache_k: list[torch.Tensor],
        cache_v: list[torch.Tensor],
        num_keys: int,
        table: torch.Tensor | None = None,
        page: int = 0,
        upcast: bool = True,
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One decode step: token `tokens_b[r]` sits at cache position `cur[r]` ((b,) int64, or (1,): the same
        for every row) of row r, whose first `pad_b[r]` positions are padding; K/V are written there and the
        row attends over cache positions [pad_b[r], cur[r]] (the plain path masks the first `num_keys`; the
        Triton and flash kernels read exactly those). Paged (`table` (b, pages per row) and `page` given; not
        with the flash kernel): the caches are flat (positions, groups, dim) buffers and row r's position n
        sits at `table[r, n // page] * page + n % page`. Returns (b, vocab_size) logits, float32 (`upcast`) or
        in the model's dtype. No host synchronisation and static shapes: capturable in a CUDA graph.
        `prefix` = (source, end): row r holds row source[r]'s K/V at its positions before end[r] (samples of
        one prompt), which the Triton attention reads from row source[r] (triton_decode.decode_attention's
        `sourced`, with `shared_prefix`); other kernels read every row's own copy."""
        b = tokens_b.shape[0]
        pg, hd = self.per_group, self.head_dim
        cur = cur.expand(b)
        pos = cur - pad_b  # (b,)
        rows = torch.arange(b, device=tokens_b.device)
        if table is not None:
            if self.attention == "flash":
                raise ValueError("the flash decode kernel reads contiguous rows, not a paged cache")
            if not self.rope_in_attention:  # (there the attention kernel writes K/V through the table)
                write = table.gather(1, (cur // page)[:, None]).squeeze(1).long() * page + cur % page
        cos_bd, sin_bd = self.cos[pos], self.sin[pos]  # (b, dim)
        cos, sin = cos_bd[:, None, None, None], sin_bd[:, None, None, None]  # (b, 1, 1, 1, dim)
        if self.attention == "flash":  # row r's keys: flat positions r * cache_len + [pad_r, cur]
            cache_len = cache_k[0].shape[1]
            cum_q = torch.arange(0, b * pg + 1, pg, dtype=torch.int32, device=tokens_b.device)
            starts = torch.arange(b, device=tokens_b.device) * cache_len + pad_b
            cum_k = torch.cat((starts, starts.new_full((1,), b * cache_len))).to(torch.int32)
            used_k = (cur + 1 - pad_b).to(torch.int32)
        elif self.attention == "sdpa":
            ar = torch.arange(num_keys, device=tokens_b.device)
            mask = ((ar >= pad_b[:, None]) & (ar <= cur[:, None]))[:, None, None]  # (b, 1, 1, keys)
            if table is not None:  # row r's first num_keys positions, gathered
                keys_at = positions_at(table, num_keys, page)  # (b, num_keys)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
            rope = None
            if self.rope_in_attention:  # q: the raw projection; RoPE and the K/V writes in the attention
                q, rope = q[:, 0], (cos_bd, sin_bd)
            elif self.fused_rope_kv:  # q: the raw projection (b, 1, groups, per group + 2, dim)
                at = cur if table is None else write
                q = triton_rope_kv.rope_write_kv(
                    q[:, 0], cos_bd, sin_bd, cache_k[i], cache_v[i], at, table is not None
                )
            else:
                at = (rows, cur) if table is None else (write,)
                cache_k[i].index_put_(at, k[:, 0])  # k (b, 1, groups, dim)
                cache_v[i].index_put_(at, v[:, 0])
                q = q[:, 0]  # (b, groups, per group, dim)
            if self.attention == "triton":
                paged = {} if table is None else {"table": table, "page": page}
                out = triton_decode.decode_attention(
                    q, cache_k[i], cache_v[i], pad_b, cur, triton_merge=self.fused, sourced=prefix, rope=rope,
                    **paged, **self.attention_knobs,
                )  # fmt: skip
            elif self.attention == "flash":
                out = flash_varlen_decode(q, cache_k[i], cache_v[i], cum_q, cum_k, used_k)
            else:
                if table is None:
                    keys = (cache_k[i][:, :num_keys], cache_v[i][:, :num_keys])
                else:
                    keys = (cache_k[i][keys_at], cache_v[i][keys_at])
                keys = (keys[0].transpose(1, 2), keys[1].transpose(1, 2))
                out = F.scaled_dot_product_attention(q, *keys, attn_mask=mask)  # (b, groups, pg, dim)
            return out.reshape(b, 1, self.heads * hd)

        h = self._layers(self.embed(tokens_b[:, None]), cos, sin, attend, raw=self.fused_rope_kv)
        return self.logits(h[:, 0], upcast)
