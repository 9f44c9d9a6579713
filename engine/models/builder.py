"""Build megatron-core `GPTModel`s (Llama/Qwen style: RMSNorm, SwiGLU, RoPE, GQA, optional QKV bias and
QK-norm, tied or untied embeddings) from `ModelConfig`, sharded by megatron itself over TP/PP/VPP
(uneven first/last stages where `ParallelDims.stage_layer_counts` says so).

The actor and reference are plain GPTModels; the critic swaps the output layer for a scalar value head.
This module builds modules only: it reads no checkpoint and wraps nothing in DDP. Every chunk gets the
rank's process groups explicitly (`ProcessGroups.megatron_groups()`); nothing here reads megatron's globals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from engine.config import ModelConfig, MoEConfig
from engine.models.spec import Fusions, install_moe_without_te, install_rope_fusion, layer_spec, norm_spec
from engine.models.triton_swiglu import install_swiglu_kernels
from engine.models.wgrad import install_wgrad_fusion
from parallel.dims import ParallelDims
from parallel.rollout_weights import global_param_names, is_expert_param
from parallel.state import ProcessGroups

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MoEShape:
    """The mixture-of-experts MLP of every layer (model.moe.*), resolved once."""

    num_experts: int
    top_k: int
    ffn_hidden_size: int
    """Inner width of one routed expert."""
    shared_ffn_hidden_size: int = 0
    """Inner width of the shared expert; 0 = none."""
    shared_gate: bool = False
    """sigmoid(gate . x) scales the shared expert's output (Qwen2-MoE)."""
    score_function: str = "softmax"
    """`softmax` or `sigmoid` router scores."""
    norm_topk_prob: bool = True
    """Top-k weights renormalised to sum to 1 (always with sigmoid)."""
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    token_dispatcher: str = "alltoall"


@dataclass(frozen=True)
class ModelShape:
    """Everything the rest of the engine needs to know about the architecture, resolved once."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    """The model's real vocabulary (logits beyond it are masked)."""
    padded_vocab_size: int
    """Rows of the embedding / output layer: vocab_size rounded up to a multiple of TP."""
    max_position_embeddings: int
    rope_theta: float
    norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    tie_embeddings: bool
    dtype: torch.dtype
    rope_scaling_factor: float = 0.0
    """Llama-3 RoPE scaling factor (0 = none); low/high frequency factors 1/4, original context 8192."""
    moe: MoEShape | None = None
    """Mixture-of-experts MLPs in every layer; None = dense SwiGLU MLPs."""


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocabulary rows after padding so every TP shard of the embedding has the same size."""
    return -(-vocab_size // tp) * tp


def resolve_shape(m: ModelConfig, vocab_size: int, tp: int) -> ModelShape:
    """Fix the architecture from the model config and the tokenizer's (or checkpoint's) vocabulary."""
    vocab = m.vocab_size or vocab_size
    return ModelShape(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        head_dim=m.head_dim or m.hidden_size // m.num_attention_heads,
        vocab_size=vocab,
        padded_vocab_size=padded_vocab(vocab, tp),
        max_position_embeddings=m.max_position_embeddings,
        rope_theta=m.rope_theta,
        norm_eps=m.norm_eps,
        qkv_bias=m.qkv_bias,
        qk_norm=m.qk_norm,
        tie_embeddings=m.tie_embeddings,
        dtype=_DTYPES[m.dtype],
        rope_scaling_factor=m.rope_scaling_factor,
        moe=moe_shape(m),
    )


def moe_shape(m: ModelConfig) -> MoEShape | None:
    """model.moe as a `MoEShape`, or None for a dense model (model.moe.num_experts=0)."""
    e = m.moe
    if e.num_experts == 0:
        return None
    return MoEShape(
        num_experts=e.num_experts,
        top_k=e.top_k,
        ffn_hidden_size=e.ffn_hidden_size or m.ffn_hidden_size,
        shared_ffn_hidden_size=e.shared_expert_ffn_hidden_size,
        shared_gate=e.shared_expert_gate,
        score_function=e.score_function,
        norm_topk_prob=e.norm_topk_prob,
        aux_loss_coef=e.aux_loss_coef or 0.0,  # None: no checkpoint sets it (engine/config.py)
        z_loss_coef=e.z_loss_coef,
        token_dispatcher=e.token_dispatcher,
    )


def moe_config(moe: MoEShape | None) -> MoEConfig:
    """The model.moe config that builds `moe` (the inverse of `moe_shape`; dense: the default, 0 experts)."""
    if moe is None:
        return MoEConfig()
    return MoEConfig(
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        ffn_hidden_size=moe.ffn_hidden_size,
        shared_expert_ffn_hidden_size=moe.shared_ffn_hidden_size,
        shared_expert_gate=moe.shared_gate,
        score_function=moe.score_function,
        norm_topk_prob=moe.norm_topk_prob,
        aux_loss_coef=moe.aux_loss_coef,
        z_loss_coef=moe.z_loss_coef,
        token_dispatcher=moe.token_dispatcher,
    )


def moe_config_fields(moe: MoEShape | None, ep: int) -> dict:
    """megatron's TransformerConfig MoE fields for `moe` at expert-parallel size `ep` (none when dense).

    megatron's softmax router applies softmax after top-k unless `moe_router_pre_softmax`: over the top-k
    logits that is the renormalised top-k softmax (norm_topk_prob=true), and softmax-then-top-k is the
    unnormalised one. Experts are not tensor-parallel (expert TP size 1)."""
    if moe is None:
        return {}
    install_moe_without_te()
    losses = "aux_loss" if moe.aux_loss_coef > 0 else "none"
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_shared_expert_intermediate_size=moe.shared_ffn_hidden_size or None,
        moe_shared_expert_gate=moe.shared_gate,
        moe_router_score_function=moe.score_function,
        moe_router_pre_softmax=moe.score_function == "softmax" and not moe.norm_topk_prob,
        moe_router_load_balancing_type=losses,
        moe_aux_loss_coeff=moe.aux_loss_coef,
        moe_z_loss_coeff=moe.z_loss_coef or None,
        moe_token_dispatcher_type=moe.token_dispatcher,
        moe_grouped_gemm=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )


def transformer_config(
    shape: ModelShape,
    dims: ParallelDims,
    init_std: float,
    recompute: bool,
    on_cpu: bool,
    fusions: Fusions | None = None,
) -> TransformerConfig:
    """megatron's TransformerConfig for this architecture and layout (CPU-safe fusions when on_cpu; RoPE
    fusion per `fusions`, on CPU too: there it runs the reference op chain through the same hook)."""
    half = shape.dtype != torch.float32
    fusions = fusions or Fusions()
    rope_fusion, wgrad_fusion = fusions.rope, fusions.wgrad and not on_cpu
    if rope_fusion:
        install_rope_fusion()  # before TransformerConfig: its checks look for the kernel
    if wgrad_fusion:
        install_wgrad_fusion()  # before the layers: they check for the kernel when built
    if not on_cpu:  # megatron's fused SwiGLU (bias_activation_fusion) runs there: through our kernels
        install_swiglu_kernels()
    counts = dims.stage_layer_counts(shape.num_layers)
    uneven = len(set(counts)) > 1  # else megatron's own even split
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None,
        num_layers_in_first_pipeline_stage=counts[0] if uneven else None,
        num_layers_in_last_pipeline_stage=counts[-1] if uneven else None,
        sequence_parallel=dims.sp,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=init_std,
        params_dtype=shape.dtype,
        pipeline_dtype=shape.dtype,
        bf16=shape.dtype == torch.bfloat16,
        fp16=shape.dtype == torch.float16,
        autocast_dtype=shape.dtype if half else None,
        use_cpu_initialization=on_cpu,
        perform_initialization=True,
        bias_activation_fusion=not on_cpu,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=not on_cpu,
        apply_rope_fusion=rope_fusion,
        gradient_accumulation_fusion=wgrad_fusion,
        batch_p2p_comm=not on_cpu,  # gloo pairs batched p2p wrongly under interleaved PP
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
        deallocate_pipeline_outputs=False,
        **moe_config_fields(shape.moe, dims.ep),
    )


class ValueHead(torch.nn.Module):
    """Scalar value per token for the critic, in place of the vocabulary output layer.

    Replicated across TP ranks (its input is identical on them), so its gradient needs no TP reduction;
    under sequence parallelism the sequence-sharded input is gathered first, over `tp_group`.
    """

    def __init__(
        self,
        hidden_size: int,
        dtype: torch.dtype,
        sequence_parallel: bool,
        tp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        if sequence_parallel and tp_group is None:
            raise ValueError("ValueHead: sequence_parallel needs the tensor-parallel group (tp_group)")
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden_sbh: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            hidden_sbh = gather_from_sequence_parallel_region(
                hidden_sbh, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return hidden_sbh @ self.weight.t(), None  # (s, b, 1)


def build_gpt_chunks(
    shape: ModelShape,
    groups: ProcessGroups,
    *,
    init_std: float,
    recompute: bool,
    value_head: bool = False,
    fusions: Fusions | None = None,
) -> list[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage) for the layout and groups of `groups`,
    parameters on `groups.device`; `fusions` picks the fused kernels (default: all; engine/models/spec.py)."""
    dims, device = groups.dims, groups.device
    fusions = fusions or Fusions()
    config = transformer_config(
        shape, dims, init_std, recompute, on_cpu=device.type == "cpu", fusions=fusions
    )
    spec = layer_spec(shape.qk_norm, fusions, num_experts=shape.moe.num_experts if shape.moe else None)
    pg_collection = groups.megatron_groups()
    chunks = []
    for vp_stage in range(dims.vpp):
        vp = vp_stage if dims.vpp > 1 else None
        pre, post = groups.holds_chunk_ends(vp_stage)
        block = TransformerBlockSubmodules(
            layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=vp, pp_rank=groups.pp_rank),
            layer_norm=norm_spec(fusions),
        )
        model = GPTModel(
            config=config,
            transformer_layer_spec=block,
            vocab_size=shape.padded_vocab_size,
            max_sequence_length=shape.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=shape.tie_embeddings and not value_head,
            position_embedding_type="rope",
            rotary_base=int(shape.rope_theta),
            rope_scaling=shape.rope_scaling_factor > 0,
            rope_scaling_factor=shape.rope_scaling_factor or 8.0,
            vp_stage=vp,
            pg_collection=pg_collection,
        )
        if value_head and post:
            model.output_layer = ValueHead(shape.hidden_size, shape.dtype, dims.sp, groups.tp)
        if shape.moe:
            mark_experts_expert_parallel(model)
        chunks.append(model.to(device))
    return chunks


def mark_experts_expert_parallel(model: torch.nn.Module) -> None:
    """Tag every routed expert's parameter `allreduce=False`, at every parallel.ep, so megatron's DDP and
    optimizer treat it as an expert parameter: its gradient is summed over the expert data-parallel group
    (`ProcessGroups.experts.expt_dp`: tp x dp / ep, as expert TP is 1) and its grad norm taken over the expert
    groups. megatron tags them only when expert_model_parallel_size > 1; at EP=1 they would be dense
    parameters, reduced over DP alone, while with sequence parallelism each TP rank routes its own sequence
    shard through its own whole copy of the experts: the TP copies would get different gradients and drift."""
    for name, param in model.named_parameters():
        if is_expert_param(name):
            param.allreduce = False


@torch.no_grad()
def build_gpt_chunks_layout_invariant(
    shape: ModelShape, groups: ProcessGroups, *, init_std: float, recompute: bool, value_head: bool = False
) -> list[GPTModel]:
    """`build_gpt_chunks` whose random init is the same model at every parallel.pp, vpp and ep (megatron's CPU
    initialisation also draws every TP shard from the whole tensor: the same model at every parallel.tp on
    CPU). megatron draws a stage's layers from the seeded stream as if they came first (a later stage starts
    from another point of the stream than at PP=1: other weights), and every rank's local experts from one
    shared stream (local expert i equal on every expert-parallel rank). So at pp > 1 or ep > 1 the model is
    first built whole on this rank (one stage, every expert: a transient copy of the model of this TP shard)
    and its weights copied into this rank's chunks by global name; the RNG state afterwards is that of the
    whole build, as at PP=1."""
    dims = groups.dims
    if dims.pp == 1 and dims.ep == 1:
        return build_gpt_chunks(shape, groups, init_std=init_std, recompute=recompute, value_head=value_head)
    kwargs = dict(init_std=init_std, recompute=recompute, value_head=value_head)
    whole = build_gpt_chunks(shape, groups.as_one_stage(), **kwargs)
    after = _rng_states(groups.device)
    chunks = build_gpt_chunks(shape, groups, **kwargs)
    _set_rng_states(groups.device, after)
    source = global_param_names(whole, [range(shape.num_layers)])
    layers = dims.train_layout().layers(groups.pp_rank, shape.num_layers)
    offset = groups.expert_offset(shape.moe.num_experts) if shape.moe else 0
    for name, param in global_param_names(chunks, layers, offset).items():
        if name == "output_layer.weight" and name not in source:  # the last stage's copy of a tied embedding
            name = "embedding.word_embeddings.weight"
        param.copy_(source[name])
    return chunks


def _rng_states(device: torch.device) -> tuple:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda, get_cuda_rng_tracker().get_states()


def _set_rng_states(device: torch.device, states: tuple) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)
    get_cuda_rng_tracker().set_states(states[2])
