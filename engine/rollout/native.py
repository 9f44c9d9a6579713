"""The native rollout engine: batched KV-cache decoding that runs directly on the rollout-layout weights
handed over by the weight transition (no copy into another model), tensor-parallel over the rollout TP group.

It re-implements the forward of megatron's GPTModel (our layer spec) as plain functions of the weight
tensors, because the rollout layout's TP size differs from the training modules'. Parity with the training
forward is a test (tests/engine/test_rollout_native.py), not an assumption.

Layout of one batch: prompts left-padded to a common length; position ids count real tokens only; the
attention mask hides left padding. Finished rows are dropped from the batch (their KV cache rows with them)
so they stop costing compute.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.models.builder import ModelShape
from engine.rollout.base import RolloutEngine, RolloutOutput, SamplingParams, check_prompts
from engine.rollout.sampler import sample_tokens
from parallel.rollout_weights import RolloutWeights


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class NativeRollout(RolloutEngine):
    """KV-cache generation on `RolloutWeights`; call `set_weights` after each train -> rollout transition."""

    def __init__(self, shape: ModelShape, device: torch.device, max_num_seqs: int = 256, pad_id: int = 0):
        self.shape = shape
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.pad_id = pad_id
        hd = shape.head_dim
        inv_freq = 1.0 / (
            shape.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd)
        )
        self.inv_freq = inv_freq  # (head_dim / 2,)
        self.weights: RolloutWeights | None = None

    def set_weights(self, weights: RolloutWeights) -> None:
        self.weights = weights
        s, t = self.shape, weights.tp_size
        self.heads = s.num_attention_heads // t
        self.groups = s.num_query_groups // t
        self.vocab_shard = s.padded_vocab_size // t

    # ---- collectives over the rollout TP group -------------------------------------------------
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.weights.tp_size > 1:
            dist.all_reduce(x, group=self.weights.tp_group)
        return x

    def _gather_vocab(self, logits_local: torch.Tensor) -> torch.Tensor:
        if self.weights.tp_size == 1:
            return logits_local
        parts = [torch.empty_like(logits_local) for _ in range(self.weights.tp_size)]
        dist.all_gather(parts, logits_local.contiguous(), group=self.weights.tp_group)
        return torch.cat(parts, dim=-1)

    # ---- the model ---------------------------------------------------------------------------
    def _embed(self, ids_bs: torch.Tensor) -> torch.Tensor:
        table = self.weights.params["embedding.word_embeddings.weight"]
        start = self.weights.tp_rank * self.vocab_shard
        local = ids_bs - start
        outside = (local < 0) | (local >= self.vocab_shard)
        x = F.embedding(local.clamp(0, self.vocab_shard - 1), table)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return self._all_reduce(x)  # (b, s, hidden)

    def _rope(self, x: torch.Tensor, pos_bs: torch.Tensor) -> torch.Tensor:
        freqs = pos_bs.unsqueeze(-1).float() * self.inv_freq  # (b, s, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # (b, s, 1, hd)
        return (x.float() * emb.cos() + _rotate_half(x.float()) * emb.sin()).to(x.dtype)

    def _attention(self, i: int, x, pos_bs, cache_k, cache_v, start: int, key_mask_bk):
        p, s = self.weights.params, self.shape
        pre = f"decoder.layers.{i}.self_attention."
        b, n = x.shape[:2]
        hd, per_group = s.head_dim, self.heads // self.groups
        qkv = F.linear(x, p[pre + "linear_qkv.weight"], p.get(pre + "linear_qkv.bias"))
        qkv = qkv.view(b, n, self.groups, (per_group + 2) * hd)
        q, k, v = qkv.split([per_group * hd, hd, hd], dim=-1)
        q = q.reshape(b, n, self.heads, hd)
        if s.qk_norm:
            q = _rms_norm(q, p[pre + "q_layernorm.weight"], s.norm_eps)
            k = _rms_norm(k, p[pre + "k_layernorm.weight"], s.norm_eps)
        q, k = self._rope(q, pos_bs), self._rope(k, pos_bs)
        cache_k[i][:, :, start : start + n] = k.transpose(1, 2)
        cache_v[i][:, :, start : start + n] = v.transpose(1, 2)
        keys, values = cache_k[i][:, :, : start + n], cache_v[i][:, :, : start + n]  # (b, groups, keys, hd)
        causal = torch.ones(n, start + n, dtype=torch.bool, device=x.device).tril(start)
        mask = causal.unsqueeze(0) & key_mask_bk[:, None, : start + n]  # (b, n, keys)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask.unsqueeze(1), enable_gqa=self.heads != self.groups
        )  # (b, heads, n, hd)
        out = out.transpose(1, 2).reshape(b, n, self.heads * hd)
        return self._all_reduce(F.linear(out, p[pre + "linear_proj.weight"]))

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = self.weights.params
        pre = f"decoder.layers.{i}.mlp."
        gate, up = F.linear(x, p[pre + "linear_fc1.weight"]).chunk(2, dim=-1)
        return self._all_reduce(F.linear(F.silu(gate) * up, p[pre + "linear_fc2.weight"]))

    def forward(self, ids_bs, pos_bs, cache_k, cache_v, start: int, key_mask_bk) -> torch.Tensor:
        """Logits (b, s, padded_vocab) for `ids_bs` at cache offset `start`, caches updated in place."""
        p, s = self.weights.params, self.shape
        x = self._embed(ids_bs)
        for i in range(s.num_layers):
            pre = f"decoder.layers.{i}."
            x = x + self._attention(
                i,
                _rms_norm(x, p[pre + "input_layernorm.weight"], s.norm_eps),
                pos_bs,
                cache_k,
                cache_v,
                start,
                key_mask_bk,
            )
            x = x + self._mlp(i, _rms_norm(x, p[pre + "pre_mlp_layernorm.weight"], s.norm_eps))
        x = _rms_norm(x, p["decoder.final_layernorm.weight"], s.norm_eps)
        out_w = p.get("output_layer.weight", p["embedding.word_embeddings.weight"])
        logits = self._gather_vocab(F.linear(x, out_w)).float()
        if s.padded_vocab_size > s.vocab_size:
            logits[..., s.vocab_size :] = float("-inf")
        return logits

    # ---- generation --------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        if self.weights is None:
            raise RuntimeError("NativeRollout.generate called before set_weights()")
        check_prompts(
            prompts, self.shape.max_position_embeddings - sampling.max_new_tokens, self.shape.vocab_size
        )
        rows = [ids for ids in prompts for _ in range(sampling.n)]
        gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        outs = [
            self._generate_batch(rows[i : i + self.max_num_seqs], sampling, gen)
            for i in range(0, len(rows), self.max_num_seqs)
        ]
        return RolloutOutput(
            response_ids=torch.cat([o.response_ids for o in outs]),
            response_mask=torch.cat([o.response_mask for o in outs]),
            log_probs=torch.cat([o.log_probs for o in outs]),
            finish_reasons=[r for o in outs for r in o.finish_reasons],
        )

    @torch.no_grad()
    def _generate_batch(
        self, rows: list[list[int]], sampling: SamplingParams, gen: torch.Generator
    ) -> RolloutOutput:
        s, dev = self.shape, self.device
        b, plen, new = len(rows), max(len(r) for r in rows), sampling.max_new_tokens
        ids = torch.full((b, plen), self.pad_id, dtype=torch.long, device=dev)
        key_mask = torch.zeros(b, plen + new, dtype=torch.bool, device=dev)
        for r, toks in enumerate(rows):
            ids[r, plen - len(toks) :] = torch.tensor(toks, device=dev)
            key_mask[r, plen - len(toks) : plen] = True
        pos = (key_mask[:, :plen].long().cumsum(-1) - 1).clamp(min=0)
        dtype = self.weights.params["embedding.word_embeddings.weight"].dtype
        cache_shape = (b, self.groups, plen + new, s.head_dim)
        cache_k = [torch.empty(cache_shape, dtype=dtype, device=dev) for _ in range(s.num_layers)]
        cache_v = [torch.empty(cache_shape, dtype=dtype, device=dev) for _ in range(s.num_layers)]

        out_ids = torch.full((b, new), self.pad_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros(b, new, dtype=torch.float32, device=dev)
        out_mask = torch.zeros(b, new, dtype=torch.float32, device=dev)
        finished = torch.zeros(b, dtype=torch.bool, device=dev)
        stops = torch.tensor(sampling.stop_token_ids or [-1], device=dev)
        alive = torch.arange(b, device=dev)  # original row of each batch entry still decoding
        logits = self.forward(ids, pos, cache_k, cache_v, 0, key_mask)[:, -1]
        next_pos = pos[:, -1] + 1
        for step in range(new):
            tokens, logp = sample_tokens(logits, sampling, gen)
            out_ids[alive, step], out_lp[alive, step], out_mask[alive, step] = tokens, logp, 1.0
            key_mask[alive, plen + step] = True
            if not sampling.ignore_eos:
                finished[alive] = torch.isin(tokens, stops)
            if step == new - 1:
                break
            keep = ~finished[alive]
            if not bool(keep.all()):
                if not bool(keep.any()):
                    break
                alive, tokens, next_pos = alive[keep], tokens[keep], next_pos[keep]
                cache_k = [c[keep] for c in cache_k]
                cache_v = [c[keep] for c in cache_v]
            logits = self.forward(
                tokens[:, None], next_pos[:, None], cache_k, cache_v, plen + step, key_mask[alive]
            )[:, -1]
            next_pos = next_pos + 1
        reasons = ["stop" if f else "length" for f in finished.tolist()]
        return RolloutOutput(out_ids, out_mask, out_lp, reasons)
