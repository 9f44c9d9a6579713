"""The step's statistics over all DP replicas: rewards, response lengths, the reward function's extras,
throughput and MFU. Every statistic counts each replica's rows once, so it does not depend on the DP size."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.models.shared_prompt_attention import SHARED_CALLS
from engine.roles.shared_prompts import prompt_groups
from engine.step.batch import REWARD_EXTRA, Experience, response_lengths
from engine.step.perf import mfu, shared_prompt_train_flops, train_flops
from parallel.state import ProcessGroups

if TYPE_CHECKING:
    from engine.setup import Components


def dp_stats(values: torch.Tensor, groups: ProcessGroups) -> tuple[float, float, float, float]:
    """Mean, std, min, max of `values` (any shape, possibly empty on some replica) over all DP replicas
    (each replica counted once); all four NaN when every replica's `values` is empty (a mean of nothing
    logged as 0.0 would read as a measured zero, e.g. an extra that no row of the step returned)."""
    v = values.double().flatten()
    moments = torch.tensor(
        [float(v.sum()), float((v * v).sum()), float(v.numel())], dtype=torch.float64, device=groups.device
    )
    ext = torch.tensor(
        [float(-v.min()) if v.numel() else -torch.inf, float(v.max()) if v.numel() else -torch.inf],
        dtype=torch.float64,
        device=groups.device,
    )
    dist.all_reduce(moments, group=groups.dp)
    dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=groups.dp)
    total, sq, count = moments.tolist()
    if count == 0:
        return (float("nan"),) * 4
    mean = total / count
    return mean, max(sq / count - mean * mean, 0.0) ** 0.5, -float(ext[0]), float(ext[1])


def rollout_metrics(
    exp: Experience, groups: ProcessGroups, rollout_log_probs: bool, max_response_len: int
) -> dict[str, float]:
    """`reward/*`, `response_length/*`, `rollout/logprob_mean` (when the rollout returns log-probs) and the
    reward function's extras.

    `response_length/mean|std|min|max` count the trained (generated) tokens of each response (verl's count a
    multi-turn episode's tool tokens too).
    `response_length/clip_ratio` is verl's: the fraction of responses whose length equals `max_response_len`,
    the configured most tokens of one response (engine/config_rules.py `max_response_tokens`: rollout.max_new_tokens,
    or with multi-turn rollout.multi_turn.max_total_tokens, against the episode's length with its tool turns,
    as verl's response width holds a whole episode). Only that global maximum counts: a response cut earlier by
    its prompt's own `max_new_tokens` (the dataset column) or an episode ended for want of room for a tool turn
    is not in it. `response_length/truncated_ratio` is: the fraction of responses that ended without a stop
    token (finish reason "length"), whichever limit cut them."""
    out = {}
    for name, values in (
        ("reward", exp.tensors["scores"]),
        ("response_length", exp.response_mask.sum(-1)),
    ):
        mean, std, lo, hi = dp_stats(values, groups)
        out.update({f"{name}/mean": mean, f"{name}/std": std, f"{name}/min": lo, f"{name}/max": hi})
    at_max = (response_lengths(exp.response_mask) == max_response_len).float()
    out["response_length/clip_ratio"] = dp_stats(at_max, groups)[0]
    out["response_length/truncated_ratio"] = dp_stats(1.0 - exp.tensors["finished"], groups)[0]
    if "overlong_penalty" in exp.tensors:
        out["reward/overlong_penalty_mean"] = dp_stats(exp.tensors["overlong_penalty"], groups)[0]
    if "staleness" in exp.tensors:  # split placement: how far behind the update its rows were generated
        mean, _, _, hi = dp_stats(exp.tensors["staleness"], groups)
        out.update({"rollout/staleness_mean": mean, "rollout/staleness_max": hi})
    if rollout_log_probs:
        mask = exp.response_mask.bool()
        out["rollout/logprob_mean"] = dp_stats(exp.tensors["rollout_log_probs"][mask], groups)[0]
    out.update(reward_extra_metrics(exp, groups))
    return out


def multi_turn_metrics(totals: dict[str, float], groups: ProcessGroups) -> dict[str, float]:
    """`multi_turn/*` of the step's training episodes (StepContext.add_episodes) over all DP replicas:
    `episodes` (every dynamic-sampling round counted), `turns_mean` (assistant turns per episode),
    `tool_calls_mean` (per episode), `tool_error_frac` (of the calls: unknown tool, malformed call, failure,
    time limit) and `tool_s` (this rank's seconds in tool calls, like `timing/*`)."""
    keys = ("episodes", "turns", "tool_calls", "tool_errors")
    sums = torch.tensor([totals.get(k, 0.0) for k in keys], dtype=torch.float64, device=groups.device)
    dist.all_reduce(sums, group=groups.dp)
    episodes, turns, calls, errors = sums.tolist()
    return {
        "multi_turn/episodes": episodes,
        "multi_turn/turns_mean": turns / max(episodes, 1.0),
        "multi_turn/tool_calls_mean": calls / max(episodes, 1.0),
        "multi_turn/tool_error_frac": errors / max(calls, 1.0),
        "multi_turn/tool_s": totals.get("tool_s", 0.0),
    }


def reward_extra_metrics(exp: Experience, groups: ProcessGroups) -> dict[str, float]:
    """`reward/extra/<key>`: mean over the DP replicas' rows of each numeric extra of a dict-returning
    reward function (the union of the replicas' keys: a replica without one contributes no rows, nor does a
    row whose output lacked the key, NaN there: engine/rewards/reward_fn.py)."""
    keys = sorted(k.removeprefix(REWARD_EXTRA) for k in exp.tensors if k.startswith(REWARD_EXTRA))
    if groups.dims.dp > 1:
        gathered = [None] * groups.dims.dp
        dist.all_gather_object(gathered, keys, group=groups.dp)
        keys = sorted(set().union(*gathered))
    out = {}
    for k in keys:
        values = exp.tensors.get(f"{REWARD_EXTRA}{k}", torch.zeros(0))
        out[f"reward/extra/{k}"] = dp_stats(values[~values.isnan()], groups)[0]
    return out


def perf_metrics(
    c: Components,
    exp: Experience,
    seconds: dict[str, float],
    peak_gb: dict[str, float],
    update_tokens: tuple[int, int, int, int] = (0, 0, 0, 0),
) -> dict[str, float]:
    """`perf/*`: tokens, tokens/s per GPU of the job, the actor update's MFU (on the training ranks), the
    step's peak memory (CUDA), and from this replica's `update_tokens` (real, processed, micro-batches and the
    rows' tokens of the update's forwards), summed over DP: `perf/padding_fraction` (padding over the tokens
    processed), with trainer.share_prompts `perf/shared_prompt_fraction` (the rows' tokens not computed) and
    `perf/shared_split_fraction` and `perf/shared_cudnn_fraction` (the shares of the step's shared-prompt
    attention calls, every role's, split at the prompt, and of those through cuDNN:
    engine/models/shared_prompt_split.py), and
    `perf/tokens_per_micro_batch` (on a GPU, micro-batches of a few thousand tokens leave it waiting on the
    host's launches: scripts/bench/README.md, "Update"); where the layers run from CUDA graphs
    (trainer.cuda_graphs), the share of the actor's layer calls this step replayed,
    `perf/cuda_graph_replayed_fraction`."""
    g = c.groups
    graphs = c.actor.layer_graphs  # trainer.cuda_graphs
    graph_calls = graphs.counts_since_last() if graphs is not None else (0, 0, 0)
    shared_calls = SHARED_CALLS.since_last()
    response_lens = exp.response_mask.sum(-1).long()
    seq_lens = exp.prompt_lens + response_lens
    # the actor's head is "response": logits at response positions only
    if c.share_prompts:  # the prompts computed once (engine/roles/shared_prompts.py)
        groups = prompt_groups(exp, list(range(exp.num_rows)))
        flops = shared_prompt_train_flops(c.shape, exp.prompt_lens, response_lens, groups)
    else:
        flops = train_flops(c.shape, seq_lens, response_lens)
    flops *= c.cfg.algorithm.ppo_epochs
    sums = torch.tensor(
        [
            float(seq_lens.sum()),
            flops,
            *map(float, update_tokens),
            *map(float, (*graph_calls, *shared_calls)),
        ],
        dtype=torch.float64,
        device=g.device,
    )
    dist.all_reduce(sums, group=g.dp)
    tokens, flops, real, processed, micro_batches, row_tokens, *calls = sums.tolist()
    graph_calls, (cudnn, flash, gathered) = calls[:3], calls[3:]
    world = g.dims.world_size  # the training ranks, where the actor's update runs
    out = {
        "perf/total_tokens": tokens,
        "perf/padding_fraction": 1.0 - real / processed if processed else 0.0,
        "perf/tokens_per_micro_batch": processed / micro_batches if micro_batches else 0.0,
        # every GPU of the job: split placement's rollout and critic ranks count, as in a colocated run
        "perf/tokens_per_s_per_gpu": tokens / seconds["step"] / dist.get_world_size(),
        "perf/mfu/actor": 0.0,
    }
    if c.share_prompts:
        out["perf/shared_prompt_fraction"] = 1.0 - real / row_tokens if row_tokens else 0.0
        shared_calls = max(cudnn + flash + gathered, 1.0)
        out["perf/shared_split_fraction"] = (cudnn + flash) / shared_calls
        out["perf/shared_cudnn_fraction"] = cudnn / shared_calls
    if graphs is not None:  # the actor's layer calls (its forwards and update) replayed from CUDA graphs
        out["perf/cuda_graph_replayed_fraction"] = graph_calls[2] / max(sum(graph_calls), 1.0)
    if g.device.type == "cuda":
        peak = c.cfg.cluster.peak_tflops
        out["perf/mfu/actor"] = mfu(flops, seconds["update_actor"], world, peak)
        # PhaseTimer resets the peak at each phase start: the step's peak is the largest of the phases'
        # and of what ran since the last one started
        since_last = torch.cuda.max_memory_allocated(g.device) / 2**30
        out["perf/max_memory_allocated_gb"] = max([since_last, *peak_gb.values()])
    return out
