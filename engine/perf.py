"""Training FLOPs of a batch of sequences and model FLOPs utilisation (MFU), for `perf/mfu/actor`.

FLOPs of forward + backward, PaLM's convention (Chowdhery et al. 2022, appendix B): 6 x (matmul
parameters) per token, plus 12 x layers x (heads x head_dim) x seq_len per token for attention scores and
values (counted as if not causal, as verl and most MFU reports do). The input embedding is a lookup and
counts nothing; the output layer counts. Only real tokens count, not padding.
"""

from __future__ import annotations

import torch

from engine.models.builder import ModelShape


def matmul_params(shape: ModelShape) -> int:
    """Parameters that multiply activations: attention and MLP projections of every layer, output layer."""
    h, hd = shape.hidden_size, shape.head_dim
    attention = h * hd * (2 * shape.num_attention_heads + 2 * shape.num_query_groups)  # q, o; k, v
    mlp = 3 * h * shape.ffn_hidden_size  # gate, up, down
    return shape.num_layers * (attention + mlp) + h * shape.vocab_size


def train_flops(shape: ModelShape, seq_lens: torch.Tensor) -> float:
    """Forward + backward FLOPs over sequences of `seq_lens` (num_seqs,) real tokens."""
    lens = seq_lens.double()
    attention = (
        12 * shape.num_layers * shape.num_attention_heads * shape.head_dim * float((lens * lens).sum())
    )
    return 6.0 * matmul_params(shape) * float(lens.sum()) + attention


def mfu(flops: float, seconds: float, num_devices: int, peak_tflops: float) -> float:
    """Achieved FLOP/s over the peak of `num_devices` accelerators."""
    if seconds <= 0:
        return 0.0
    return flops / seconds / (num_devices * peak_tflops * 1e12)
