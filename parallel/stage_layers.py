"""How megatron-core assigns transformer layers to pipeline stages and their virtual chunks.

Pure integers and ranges; must not import torch. Layers per stage (`stage_layer_counts`) follow megatron-core's
uneven pipeline: the first and last stage may hold other counts than the equal middle stages, so layer counts
that pp * vpp does not divide work; every mapping from layers to stages (`parallel/layout.py`,
`parallel/hybrid_layout.py`) goes through that one function.
"""

from __future__ import annotations

from functools import cache


def check_stage_layer_keys(pp: int, vpp: int, first_stage_layers: int, last_stage_layers: int) -> None:
    """ValueError naming the key unless `parallel.first_stage_layers` / `parallel.last_stage_layers` are 0
    (automatic) or a positive multiple of parallel.vpp at parallel.pp > 1."""
    for key, value in (
        ("parallel.first_stage_layers", first_stage_layers),
        ("parallel.last_stage_layers", last_stage_layers),
    ):
        if value < 0:
            raise ValueError(f"{key}={value} must be >= 0 (0 = automatic). Fix: set {key}=0")
        if value and pp == 1:
            raise ValueError(
                f"{key}={value} needs parallel.pp > 1 (one stage holds every layer). Fix: set {key}=0"
            )
        if value % vpp:
            raise ValueError(
                f"{key}={value} must be a multiple of parallel.vpp={vpp} (each virtual chunk of a stage holds "
                f"the same number of layers). Fix: set {key} to a multiple of {vpp} or 0"
            )


@cache  # pure; called per parameter by the reshard checks
def stage_layer_counts(
    num_layers: int, pp: int, vpp: int = 1, first_stage_layers: int = 0, last_stage_layers: int = 0
) -> tuple[int, ...]:
    """Transformer layers of each pipeline stage (all its virtual chunks together), or a ValueError naming
    the keys and a fix.

    megatron-core splits layers evenly, or, with `num_layers_in_first/last_pipeline_stage`, gives the first
    and last stage their own counts and the middle stages equal shares. Every stage holds a multiple of `vpp`
    layers (one equal share per virtual chunk). `first_stage_layers` / `last_stage_layers` fix those two
    counts (`parallel.first_stage_layers` / `parallel.last_stage_layers`, 0 = automatic).

    The automatic rule: the most layers on any stage is as small as possible (ceil(L / pp) in units of vpp:
    the pipeline runs at the pace of its slowest stage); among such splits the last stage gets the fewest
    layers, because it also runs the output layer (a vocabulary-sized matmul) and the loss, then the first
    stage, which holds the most micro-batches in flight under 1F1B. A layer count that pp * vpp divides
    gives the even split.
    """
    check_stage_layer_keys(pp, vpp, first_stage_layers, last_stage_layers)
    if num_layers % vpp:
        raise ValueError(
            f"num_layers={num_layers} is not divisible by parallel.vpp={vpp}: every stage holds a multiple of "
            f"parallel.vpp layers. Fix: set parallel.vpp to a divisor of {num_layers}"
        )
    if pp == 1:
        return (num_layers,)
    units = num_layers // vpp
    if units < pp:
        raise ValueError(
            f"num_layers={num_layers} gives fewer than one layer per virtual chunk at parallel.pp={pp}, "
            f"parallel.vpp={vpp} (needs >= {pp * vpp}). Fix: lower parallel.pp or parallel.vpp"
        )
    best = _best_split(units, pp, first_stage_layers // vpp, last_stage_layers // vpp)
    if best is None:
        rule = (
            f"the two stages must add up to {num_layers}"
            if pp == 2
            else f"the {pp - 2} middle stages get equal shares: num_layers - first - last must be a positive "
            f"multiple of {(pp - 2) * vpp}"
        )
        raise ValueError(
            f"num_layers={num_layers} cannot be split over parallel.pp={pp} stages (parallel.vpp={vpp}) with "
            f"parallel.first_stage_layers={first_stage_layers}, parallel.last_stage_layers={last_stage_layers}: "
            f"{rule}. Fix: set both to 0 (automatic) or to counts that follow this rule"
        )
    first, middle, last = (n * vpp for n in best)
    if vpp > 1 and pp == 2 and first != last:
        raise ValueError(
            f"num_layers={num_layers} needs uneven stages ({first}, {last}), which megatron-core cannot place "
            f"with the interleaved schedule at parallel.pp=2 (its layer offset divides by the number of middle "
            f"stages, here 0). Fix: set parallel.vpp=1, or parallel.pp >= 3, or a layer count that "
            f"parallel.pp * parallel.vpp = {pp * vpp} divides"
        )
    return (first, *[middle] * (pp - 2), last)


def _best_split(units: int, pp: int, first: int, last: int) -> tuple[int, int, int] | None:
    """(first, middle, last) units of the automatic rule (see `stage_layer_counts`); fixed where non-zero."""
    candidates = []
    for f in [first] if first else range(1, units + 1):
        for lst in [last] if last else range(1, units + 1):
            rest = units - f - lst
            if pp == 2 and rest == 0:
                candidates.append((f, 0, lst))
            elif pp > 2 and rest > 0 and rest % (pp - 2) == 0:
                candidates.append((f, rest // (pp - 2), lst))
    return min(candidates, key=lambda c: (max(c), c[2], c[0]), default=None)


def chunk_layers(counts: tuple[int, ...], vpp: int, stage: int) -> list[range]:
    """Megatron's assignment: virtual chunk v of `stage` holds the layers after chunk v of the earlier stages,
    i.e. [v*L/vpp + sum(n_s for s < stage), +n_stage), n_s = counts[s] / vpp."""
    per_chunk = [c // vpp for c in counts]
    row = sum(per_chunk)  # layers of one virtual chunk over all stages, L / vpp
    start = sum(per_chunk[:stage])
    return [range(v * row + start, v * row + start + per_chunk[stage]) for v in range(vpp)]
