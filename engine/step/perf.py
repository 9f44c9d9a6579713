"""Training FLOPs of a batch of sequences and model FLOPs utilisation (MFU), for `perf/mfu/actor`.

FLOPs of forward + backward, PaLM's convention (Chowdhery et al. 2022, appendix B):
- matmuls: 6 x (parameters of the layers' attention and MLP projections) per token, and 6 x hidden x vocab
  for the output layer only at the positions whose logits are computed (the actor's fused output head,
  engine/models/output_head.py, computes them at response positions only, none at prompt positions);
  the input embedding is a lookup and counts nothing;
- attention scores and values: 12 x layers x (heads x head_dim) x seq_len per token, i.e. NOT causal:
  every query is counted against all seq_len keys, as PaLM counts. A causal count (the work a causal kernel
  does; verl's flops_counter counts it: 6 where this has 12) is half of this term.
Only real tokens count, not padding.
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


def train_flops(shape: ModelShape, seq_lens: torch.Tensor, head_lens: torch.Tensor | None = None) -> float:
    """Forward + backward FLOPs over sequences of `seq_lens` (num_seqs,) real tokens whose output layer
    computes logits at `head_lens` (num_seqs,) positions each (None: at every position)."""
    lens = seq_lens.double()
    head = lens if head_lens is None else head_lens.double()
    output = shape.hidden_size * shape.vocab_size
    attention = (
        12 * shape.num_layers * shape.num_attention_heads * shape.head_dim * float((lens * lens).sum())
    )
    return (
        6.0 * (matmul_params(shape) - output) * float(lens.sum())
        + 6.0 * output * float(head.sum())
        + attention
    )


def mfu(flops: float, seconds: float, num_devices: int, peak_tflops: float) -> float:
    """Achieved FLOP/s over the peak of `num_devices` accelerators."""
    if seconds <= 0:
        return 0.0
    return flops / seconds / (num_devices * peak_tflops * 1e12)
