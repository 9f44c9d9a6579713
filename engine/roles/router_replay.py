"""Routing replay for an MoE actor (`algorithm.router_replay`): the actor's training forwards (old log-probs,
the update) route every token to the experts the rollout chose for it (engine/rollout/routes.py) instead of
recomputing the top-k, so the policy trained is the one that generated the responses; a router that would
choose differently no longer moves log-probs discontinuously between rollout and training.

How: megatron's `topk_routing_with_score_function` asks `TopKRouter.router_replay`, when set, for each
token's top-k (`get_replay_topk(scores, topk, num_groups, group_topk, compute_topk)`). `RouterReplay` puts a
`_LayerReplay` there on every router of the role's chunks (megatron's own `RouterReplay`, behind
`moe_enable_routing_replay`, keeps its instances in a process-wide list that every model of the process
would share) and, before each micro-batch's forward of a chunk, hands each router its layer's recorded
indices (`install`). The gate weights are still computed from the current logits of the chosen experts
(megatron's formulas after the top-k: softmax over the k chosen logits, or their normalised sigmoid scores,
or the chosen entries of the full softmax), so gradients reach the router through those logits; the
load-balancing and z losses see the recomputed routing, as without replay. Positions the rollout did not
route (padding, the last response token: -1) keep the recomputed top-k.

Prompt positions replay the rollout's prefill too (the record covers [prompt, response]). The reference
policy routes freely: replay is for the actor's forwards only (verl's R3 replays the rollout's routing in
the actor's log-prob and update forwards; the reference model computes its own).

`router_replay_agreement`: the fraction of replayed tokens whose recomputed top-k (as a set) equals the
replayed one, over the actor's forwards since the last `metrics()` call; 1.0 when rollout and training
weights and numerics agree. A token of a TP group or of a recomputed forward counts once per pass, alike
for every token, so the fraction is unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.step.batch import ROUTES


class _LayerReplay:
    """What megatron's router calls for one layer's top-k; `target` (tokens, k) or None (recompute)."""

    def __init__(self, counts: torch.Tensor):
        self.counts = counts  # shared (2,): tokens whose top-k agreed, tokens replayed
        self.target: torch.Tensor | None = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, computed = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            return values, computed
        target = self.target.to(device=scores.device, dtype=torch.long)  # (tokens, k)
        if target.shape != computed.shape:
            raise RuntimeError(
                f"routing replay: {tuple(target.shape)} recorded expert indices for a router that routes "
                f"{tuple(computed.shape)} (tokens, top_k); the micro-batch's routes do not match its tokens"
            )
        recorded = (target >= 0).all(-1)  # (tokens,)
        index = torch.where(recorded[:, None], target, computed)
        same = (index.sort(-1).values == computed.sort(-1).values).all(-1) & recorded
        self.counts += torch.stack([same.sum(), recorded.sum()]).to(self.counts)
        return scores.gather(1, index), index


class RouterReplay:
    """Replay of recorded routes on every `TopKRouter` of a role's chunks; metrics over `group`."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        config,
        tp_rank: int,
        group: dist.ProcessGroup,
        device: torch.device,
    ):
        from megatron.core.transformer.moe.router import TopKRouter

        if config.moe_router_fusion:
            raise ValueError("routing replay needs megatron's unfused router (moe_router_fusion=False)")
        self.counts = torch.zeros(2, dtype=torch.float64, device=device)
        self.group = group
        # under sequence parallelism each TP rank routes its slice of the sequence
        self.seq_slice = (tp_rank, config.tensor_model_parallel_size) if config.sequence_parallel else (0, 1)
        self._routers: dict[int, list] = {}
        for chunk in chunks:
            routers = [m for m in chunk.modules() if isinstance(m, TopKRouter)]
            for router in routers:
                router.router_replay = _LayerReplay(self.counts)
            self._routers[id(chunk)] = routers

    def install(self, chunk: torch.nn.Module, mb: dict) -> None:
        """Give the routers of `chunk` (one of the role's chunks, wrapped or not) the routes of micro-batch
        `mb` (`mb[ROUTES]` (b, s, layers, k), token (row, position) as in `mb["tokens"]`; none: recompute)."""
        routers = self._routers.get(id(chunk))
        if routers is None:
            routers = self._routers[id(chunk)] = self._routers[id(getattr(chunk, "module", chunk))]
        routes = mb.get(ROUTES)
        if routes is not None:
            rank, parts = self.seq_slice
            s = routes.shape[1] // parts
            routes = routes[:, rank * s : (rank + 1) * s].transpose(
                0, 1
            )  # (s, b, layers, k): megatron's order
        for router in routers:
            replay = router.router_replay
            replay.target = (
                None
                if routes is None
                else routes[:, :, router.layer_number - 1].reshape(-1, routes.shape[-1])
            )

    def metrics(self) -> dict[str, float]:
        """{"router_replay_agreement": ...} over every rank of `group` (collective), then the counts restart."""
        counts = self.counts.clone()  # on the device: the collective's backend needs it there
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(counts, group=self.group)
        self.counts.zero_()
        if counts[1] == 0:
            return {}
        return {"router_replay_agreement": float(counts[0] / counts[1])}
