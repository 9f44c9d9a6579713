"""A megatron model role (actor, reference, critic): chunks wrapped in megatron DDP with an optimizer and LR
schedule (when trainable), and one call that runs micro-batches through megatron's forward/backward schedule.

Loss normalisation is the caller's: each micro-batch loss is (sum over its tokens) / (global normaliser of the
mini-batch across all DP ranks and micro-batches), and gradients are SUMMED over micro-batches and DP ranks
(megatron's `calculate_per_token_loss` mode with a zero token count, so megatron adds no scaling of its own).
That makes the update identical however the mini-batch is split (tests/engine/test_dynamic_batch.py; at
TP=2 x PP=2 in tests/engine/trainer_run_script.py).

megatron gets the role's process groups explicitly (`ProcessGroups.megatron_groups()`): DDP, the optimizer,
the schedule and, through the schedule, finalize_model_grads read no global group.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from engine.config import OptimConfig
from engine.models.builder import ModelShape
from engine.models.compiled import switched_on
from engine.models.layer_graphs import LayerGraphs
from engine.models.logprobs import mask_padded_vocab
from engine.models.output_head import (
    hidden_states_output,
    output_weight,
    response_token_grads,
    response_token_stats,
    unpack_rows,
)
from engine.roles.grad_norm import install_foreach_grad_ops
from engine.roles.moe_losses import RouterLossWeights
from parallel.state import ProcessGroups

# What a role's loss_fn(output, micro_batch) -> (loss, metrics) receives as `output`, by the role's `head`
# (b = the micro-batch's rows; a packed micro-batch's output is unpacked to rows, s = its longest row):
#   "response": ResponseStats of the micro-batch's response tokens, from the fused output head (actor, reference)
#   "logits":   (b, s, vocab/tp) float32 vocab-parallel logits of every position (tools and tests)
#   "values":   (b, s, 1) float32 values (critic, reward model)
HEADS = ("response", "logits", "values")
LossFn = Callable[[object, dict], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""`loss_fn(output, mb) -> (loss, metrics)`. A "response" head's loss_fn may carry `token_grads`
(engine/step/losses.py `make_actor_loss`): then a training `run` computes the loss's gradient in the head's
forward (engine/models/output_head.py `response_token_grads`) unless ENGINE_ONE_PASS_HEAD=0."""
ONE_PASS_HEAD = "ENGINE_ONE_PASS_HEAD"
"""Switch of the one-pass output head (on unless "0"): for benchmarks' baselines and debugging."""


@dataclass
class ResponseStats:
    """Per response token (b, T) float32: log-prob of the token and entropy of the distribution it was
    drawn from (both at the run's temperature); differentiable when the run is not forward-only."""

    log_probs: torch.Tensor
    entropy: torch.Tensor


@dataclass
class StepStats:
    """Result of one optimizer step: `skipped` when float16 gradients overflowed (no update, the LR schedule
    does not advance, `grad_norm` is 0); `loss_scale` is the scale the next backward multiplies the loss by
    (1 unless model.dtype=float16)."""

    grad_norm: float
    lr: float
    skipped: bool
    loss_scale: float = 1.0


class MegatronRole:
    """One model role on this rank; `run` executes micro-batches, `optimizer_step` applies the update."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        groups: ProcessGroups,
        shape: ModelShape,
        optim: OptimConfig | None,
        total_optimizer_steps: int = 1,
        head: str = "response",
    ):
        if head not in HEADS:
            raise ValueError(f"MegatronRole: head must be one of {HEADS}, got {head!r}")
        self.groups, self.shape, self.head = groups, shape, head
        config = chunks[0].config
        self.config = config
        self.megatron_groups = groups.megatron_groups()
        self.models = list(chunks)  # the GPTModels themselves, under DDP or not
        # No Float16Module: the chunks are built with bf16/fp16 parameters already, and its only other job,
        # casting the last stage's whole (b, s, vocab) output to fp32, is not wanted: the "response" head
        # computes fp32 logits of response positions chunk by chunk (engine/models/fused_logprobs.py).
        self.trainable = optim is not None
        self.router_losses: RouterLossWeights | None = None
        self.router_replay = None
        """MoE routing replay (engine/roles/router_replay.py `RouterReplay`), set by engine/setup.py for
        the actor with algorithm.router_replay; it hands each micro-batch's recorded routes to the routers."""
        self.layer_graphs: LayerGraphs | None = None
        """CUDA graphs of the layers (trainer.cuda_graphs, `use_cuda_graphs`)."""
        if not self.trainable:
            for c in chunks:
                c.eval()
                c.requires_grad_(False)
            self.chunks, self.optimizer, self.scheduler = chunks, None, None
            return
        config.calculate_per_token_loss = True
        self.router_losses = RouterLossWeights(chunks, config) if config.num_moe_experts else None  # MoE
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=optim.distributed_optimizer,
        )
        self.chunks = [
            DistributedDataParallel(
                config=config,
                ddp_config=ddp_config,
                module=c,
                disable_bucketing=(i > 0),
                pg_collection=self.megatron_groups,
            )
            for i, c in enumerate(chunks)
        ]
        config.finalize_model_grads_func = finalize_model_grads  # the schedule passes pg_collection
        config.no_sync_func = (
            [c.no_sync for c in self.chunks] if len(self.chunks) > 1 else self.chunks[0].no_sync
        )
        install_foreach_grad_ops()  # megatron's norm/scale fallbacks: one sync per tensor (grad_norm.py)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=optim.lr,
                min_lr=optim.min_lr,
                weight_decay=optim.weight_decay,
                adam_beta1=optim.adam_beta1,
                adam_beta2=optim.adam_beta2,
                adam_eps=optim.adam_eps,
                clip_grad=optim.clip_grad,
                bf16=shape.dtype == torch.bfloat16,
                fp16=shape.dtype == torch.float16,
                params_dtype=shape.dtype,
                use_distributed_optimizer=optim.distributed_optimizer,
                initial_loss_scale=optim.initial_loss_scale,
            ),
            self.chunks,
            # megatron takes no gloo side groups with a collection; the checkpoint's optimizer state
            # (get_parameter_state_dp_reshardable) needs no communication
            use_gloo_process_groups=False,
            pg_collection=self.megatron_groups,
        )
        if groups.device.type == "cuda":
            use_fused_adam(self.optimizer)
        # megatron's schedule multiplies each micro-batch loss by this before its backward; the optimizer
        # divides the gradients by the same scale (float16's dynamic loss scale; 1 for bfloat16/float32)
        config.grad_scale_func = self.optimizer.scale_loss
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if optim.lr_warmup_steps else optim.lr,
            max_lr=optim.lr,
            min_lr=optim.min_lr,
            lr_warmup_steps=optim.lr_warmup_steps,
            lr_decay_steps=max(total_optimizer_steps, optim.lr_warmup_steps + 1),
            lr_decay_style=optim.lr_decay,
            start_wd=optim.weight_decay,
            end_wd=optim.weight_decay,
            wd_incr_steps=max(total_optimizer_steps, 1),
            wd_incr_style="constant",
        )

    def use_cuda_graphs(self) -> None:
        """Run the layers from CUDA graphs for micro-batch shapes that repeat (engine/models/layer_graphs.py)
        until `release_graphs`, which drops them; the next micro-batches capture anew."""
        if self.layer_graphs is None:
            self.layer_graphs = LayerGraphs(self.models)

    def release_graphs(self) -> None:
        """Free the layers' CUDA graphs and their memory (after an update or a forward pass: the rollout
        needs the memory, and the weights may move before the next)."""
        if self.layer_graphs is not None:
            self.layer_graphs.release()

    def run(
        self, micro_batches: list[dict], loss_fn: LossFn, *, forward_only: bool, temperature: float = 1.0
    ) -> list[dict]:
        """Run `micro_batches` (each: `tokens`, `positions` (b, s), or (1, t) with `packed_seq_params` for
        packed rows, plus whatever loss_fn reads, e.g. `response_index` (b, T) for the "response" head)
        through the schedule; returns loss_fn's metric
        dicts on the last PP stage ([] elsewhere). Log-probs and logits are at `temperature`."""
        if not forward_only:
            for c in self.chunks:
                c.zero_grad_buffer()
            self.optimizer.zero_grad()
        b, s = micro_batches[0]["tokens"].shape
        g = self.groups
        if self.router_losses is not None and not forward_only:
            self.router_losses.for_step(len(micro_batches), g.dims.dp)
        check_pipeline_micro_batches(micro_batches, g.dims.pp, g.dims.vpp, self.config.variable_seq_lengths)
        token_grads = getattr(loss_fn, "token_grads", None)
        one_pass = (
            self.head == "response"
            and not forward_only
            and token_grads is not None
            and switched_on(ONE_PASS_HEAD)
        )

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if self.router_replay is not None:
                self.router_replay.install(model, mb)
            # packed micro-batches: (1, t) rows back to back, their boundaries in packed_seq_params
            out = model(mb["tokens"], mb["positions"], None, packed_seq_params=mb.get("packed_seq_params"))

            def loss_func(output):
                anchor = None
                if self.head == "response":
                    head = dict(
                        temperature=temperature,
                        vocab_size=self.shape.vocab_size,
                        tp_group=g.tp if g.dims.tp > 1 else None,
                    )
                    weight = output_weight(getattr(model, "module", model))
                    if one_pass:  # the loss's gradient in the head's forward: no logits recomputed
                        logp, ent, anchor = response_token_grads(
                            output,
                            weight,
                            mb,
                            token_grads,
                            grad_scale=self.optimizer.get_loss_scale(),
                            **head,
                        )
                    else:
                        logp, ent = response_token_stats(output, weight, mb, **head)
                    output = ResponseStats(logp, ent)
                elif self.head == "logits":
                    output = unpack_rows(output, mb)
                    output = mask_padded_vocab(output.float() / temperature, self.shape.vocab_size, g.tp_rank)
                else:
                    output = unpack_rows(output, mb).float()
                loss, metrics = loss_fn(output, mb)
                if anchor is not None:
                    loss = loss + anchor
                return loss, torch.zeros((), dtype=torch.int, device=loss.device), metrics

            return out, loss_func

        iters = [iter(micro_batches) for _ in self.chunks]
        context = torch.no_grad() if forward_only else torch.enable_grad()
        head = hidden_states_output(self.models) if self.head == "response" else contextlib.nullcontext()
        with context, head:  # "response": the last stage returns hidden states, loss_func applies the head
            return schedule(g, self.config, self.megatron_groups)(
                forward_step_func=forward_step,
                data_iterator=iters if len(iters) > 1 else iters[0],
                model=self.chunks,
                num_microbatches=len(micro_batches),
                seq_length=s,
                micro_batch_size=b,
                forward_only=forward_only,
            )

    def optimizer_step(self) -> StepStats:
        """Apply the accumulated gradients (clip, Adam), then advance the LR schedule by one step."""
        ok, grad_norm, _ = self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        if ok:
            self.scheduler.step(increment=1)
        return StepStats(
            grad_norm=float(grad_norm or 0.0),
            lr=float(lr),
            skipped=not ok,
            loss_scale=float(self.optimizer.get_loss_scale()),
        )

    def broadcast_from_last_stage(
        self, tensor: torch.Tensor | None, shape: tuple, dtype: torch.dtype
    ) -> torch.Tensor:
        """Share a tensor computed on the last PP stage with the other stages of this rank's PP group."""
        g = self.groups
        if g.dims.pp == 1:
            return tensor
        if not g.is_last_stage:
            tensor = torch.empty(shape, dtype=dtype, device=g.device)
        dist.broadcast(tensor.contiguous(), src=g.pp_last_rank, group=g.pp)
        return tensor


def schedule(
    groups: ProcessGroups, config: TransformerConfig, megatron_groups: ProcessGroupCollection | None = None
) -> Callable:
    """megatron's forward/backward schedule for the layout of `groups` (no pipelining, 1F1B or interleaved
    1F1B), bound to its process groups: `megatron_groups` (default: `groups.megatron_groups()`) and a
    point-to-point communicator over `groups.pp`. Takes the schedule's other arguments."""
    dims = groups.dims
    func = get_forward_backward_func(pp_size=dims.pp, vp_size=dims.vpp if dims.vpp > 1 else None)
    return functools.partial(
        func,
        p2p_communicator=P2PCommunicator(pp_group=groups.pp, config=config),
        pg_collection=megatron_groups or groups.megatron_groups(),
    )


def check_pipeline_micro_batches(micro_batches: list[dict], pp: int, vpp: int, variable_shapes: bool) -> None:
    """Refuse micro-batches megatron's pipeline schedules would mishandle: at PP > 1 without shape exchange
    the stages size every receive buffer from the first micro-batch (a different shape is read wrongly, with
    no error), and the interleaved schedule needs a micro-batch count that is a multiple of pp."""
    if pp == 1:
        return
    first = tuple(micro_batches[0]["tokens"].shape)
    other = next((tuple(mb["tokens"].shape) for mb in micro_batches if mb["tokens"].shape != first), None)
    if other is not None and not variable_shapes:
        raise ValueError(
            f"micro-batches of shapes {first} and {other} in one pipeline-parallel call (pp={pp}): the stages "
            "would receive activations sized for the first; pad the micro-batches to one shape or set the "
            "role's config.variable_seq_lengths"
        )
    if vpp > 1 and len(micro_batches) % pp:
        raise ValueError(
            f"{len(micro_batches)} micro-batches in one interleaved pipeline call (pp={pp}, vpp={vpp}): "
            f"megatron's schedule needs a positive multiple of {pp}"
        )


def sub_optimizers(optimizer) -> list:
    """megatron's optimizers inside `optimizer` (a ChainedOptimizer's parts, or itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers megatron's `optimizer` steps (one per sub-optimizer)."""
    return [sub.optimizer for sub in sub_optimizers(optimizer)]


def use_fused_adam(optimizer) -> None:
    """Switch the torch Adam(W) inside megatron's optimizer (`torch.optim.AdamW`, foreach, without Apex or TE)
    to torch's fused single-kernel implementation. Call again after loading a state dict, which restores
    the saved param groups' flags; existing `step` counters move to the parameters' device as fused needs."""
    for inner in torch_optimizers(optimizer):
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            group["fused"], group["foreach"] = True, False
            for p in group["params"]:
                step = inner.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor):
                    inner.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)
