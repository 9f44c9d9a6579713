"""The experts an MoE rollout's routers chose, recorded per generated row and sequence position, for routing
replay (`algorithm.router_replay`, engine/roles/router_replay.py).

Row r's record is laid out as the training sequence is: position i of [prompt, response]. Prompt positions
come from the prefill of the row's prompt (shared by its n samples); response token j's from the decode step
that fed it, so the training forward, which routes token j at position len(prompt) + j, replays exactly what
the rollout computed. The last response token is never fed to a decode step: its record stays -1, as does
padding, and the training router chooses freely there (its output reaches no trained log-prob).
"""

from __future__ import annotations

import torch

NO_ROUTE = -1
"""Record of a position the rollout did not route."""


class RouteRecorder:
    """Expert choices of one native `generate` call: (rows + 1 scratch row, positions, layers, top_k) int16."""

    def __init__(self, model, prompts: list[list[int]], n: int, max_new_tokens: int, device: torch.device):
        moe = model.shape.moe
        num_rows = len(prompts) * n
        width = max(len(p) for p in prompts) + max_new_tokens
        self.model = model
        self.routes = torch.full(
            (num_rows + 1, width, model.shape.num_layers, moe.top_k),
            NO_ROUTE,
            dtype=torch.int16,
            device=device,
        )
        lens = [len(prompts[r // n]) for r in range(num_rows)] + [0]
        self.prompt_lens = torch.tensor(lens, dtype=torch.long, device=device)  # (rows + 1,)
        model.routes = []

    @staticmethod
    def for_call(model, prompts, sampling, continued, device: torch.device) -> RouteRecorder | None:
        """The recorder of a native `generate` call's expert choices when `sampling.routed_experts` asks for
        them (not for continued prompts)."""
        if not sampling.routed_experts:
            return None
        if model.shape.moe is None or continued is not None:
            raise ValueError(
                "SamplingParams.routed_experts: only MoE models record routes, and not for continued prompts "
                "(multi-turn); set algorithm.router_replay=false"
            )
        return RouteRecorder(model, prompts, sampling.n, sampling.max_new_tokens, device)

    def _take(self) -> torch.Tensor:
        """(tokens, layers, top_k) of the model's forward since the last call."""
        out = torch.stack(self.model.routes, dim=1).to(torch.int16)
        self.model.routes = []
        return out

    def prefill(self, chunk, uniq: list[int], first_row: list[int], a: int, b: int, prompts) -> None:
        """After the prefill of distinct prompts uniq[a:b] (left-padded to a common length): copy each one's
        routes to the rows of its samples (`chunk` rows first_row[u]:first_row[u + 1] hold prompt uniq[u])."""
        routes = self._take()
        routes = routes.view(b - a, -1, *routes.shape[1:])  # (prompts, padded length, layers, k)
        plen = routes.shape[1]
        for u in range(a, b):
            length = len(prompts[uniq[u]])
            rows = [chunk[r][0] for r in range(first_row[u], first_row[u + 1])]
            self.routes[rows, :length] = routes[u - a, plen - length :]

    def decode(self, row_of: torch.Tensor, alive: torch.Tensor, step: int) -> None:
        """After the decode step that fed response token `step` of the live slots (`row_of`, `alive`: the
        step's slots' output rows and liveness)."""
        routes = self._take()  # (slots, layers, k)
        rows = row_of[alive]
        self.routes[rows, self.prompt_lens[rows] + step] = routes[alive]

    def result(self) -> torch.Tensor:
        """(rows, positions, layers, top_k) int16 on the CPU; stops recording."""
        self.model.routes = None
        return self.routes[:-1].cpu()


def cat_routes(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Row-wise concatenation of route records of different widths (padded with NO_ROUTE); None when any
    part is None."""
    if not parts or any(p is None for p in parts):
        return None
    width = max(p.shape[1] for p in parts)
    padded = [torch.nn.functional.pad(p, (0, 0, 0, 0, 0, width - p.shape[1]), value=NO_ROUTE) for p in parts]
    return torch.cat(padded)


def routes_for_sequences(routes: torch.Tensor, seq: int) -> torch.Tensor:
    """(rows, seq, layers, top_k): `routes` cut or padded (NO_ROUTE) to `seq` positions."""
    if routes.shape[1] >= seq:
        return routes[:, :seq]
    return torch.nn.functional.pad(routes, (0, 0, 0, 0, 0, seq - routes.shape[1]), value=NO_ROUTE)
