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
    return _flops(shape, float(lens.sum()), float((lens * lens).sum()), float(head.sum()))


def shared_prompt_train_flops(
    shape: ModelShape, prompt_lens: torch.Tensor, response_lens: torch.Tensor, groups: list[list[int]]
) -> float:
    """`train_flops` of rows laid out with each group's prompt once (trainer.share_prompts,
    engine/roles/shared_prompts.py; `groups`: the rows of each prompt): the rows' count less, for every copy
    of a prompt not computed, its tokens' layers and their attention over the prompt (P^2 in this count's
    convention: a row of P tokens alone). A group split over micro-batches computes its prompt once per part:
    not counted (a lower MFU, never a higher one)."""
    flops = train_flops(shape, prompt_lens + response_lens, response_lens)
    for group in groups:
        prompt = float(prompt_lens[group[0]])
        flops -= (len(group) - 1) * _flops(shape, prompt, prompt * prompt, 0.0)
    return flops


def _flops(shape: ModelShape, tokens: float, squares: float, head_tokens: float) -> float:
    """6 x the layers' matmul parameters per token, 6 x the output layer's per head token, and attention at
    12 x layers x heads x head_dim per token and key (`squares`: the sum over tokens of the keys each sees)."""
    output = shape.hidden_size * shape.vocab_size
    attention = 12 * shape.num_layers * shape.num_attention_heads * shape.head_dim * squares
    return 6.0 * (matmul_params(shape) - output) * tokens + 6.0 * output * head_tokens + attention


def mfu(flops: float, seconds: float, num_devices: int, peak_tflops: float) -> float:
    """Achieved FLOP/s over the peak of `num_devices` accelerators."""
    if seconds <= 0:
        return 0.0
    return flops / seconds / (num_devices * peak_tflops * 1e12)
