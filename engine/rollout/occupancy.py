"""How many programs (thread blocks) of a kernel an NVIDIA SM holds at once, and the register cap that makes a
launch's programs fit in fewer waves: `DecodeKernels.attention_occupancy`.

Why: a decode step's attention launches rows x KV groups x key splits programs of near-equal work; when they
need more waves than the GPU's SMs x programs per SM hold at once, the last wave runs on a part of the GPU.
Registers bound the programs per SM first for the decode attention's wider variants (0.5B, 512 rows, the
group's prompt read from one row, RoPE inside: 126 registers, 4 per SM, 1,024 programs in 2 waves on 132 SMs).
Triton's `maxnreg` launch option caps the registers. Measured on an H200 (scripts/bench/README.md, "Rollout"):
more programs per SM alone gains nothing (caps to 5 and 7 per SM at that launch: 2 waves still, +0-2%), one
wave fewer does (a cap of 64: 8 per SM, 1 wave, 32 B spilled: 3.3-4.4% faster rollouts), and spilling more for
the same waves costs (56: 9 per SM, 56 B: 5% slower than 64). So each variant gets a ladder of caps, one per
occupancy above its own that a cap reaches with at most `MAX_SPILL_BYTES` spilled (`occupancy_ladder`), and
each launch takes the highest cap of the ladder that needs the fewest waves for its program count, or none
where no cap saves a wave (`launch_cap`). On by default since the rule itself was measured on an H100: 2.5-2.7%
faster rollouts at 0.5B and 1.5B, fixed and long-tailed; no workload slower.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

WARP = 32


@dataclass(frozen=True)
class SmLimits:
    """An SM's resources (H100/H200 defaults); `from_device` reads a CUDA device's."""

    registers: int = 65536
    shared_bytes: int = 228 * 1024
    warps: int = 64
    blocks: int = 32

    @staticmethod
    def from_device(device) -> SmLimits:
        import torch

        props = torch.cuda.get_device_properties(device)
        return SmLimits(
            registers=props.regs_per_multiprocessor,
            shared_bytes=props.shared_memory_per_multiprocessor,
            warps=props.max_threads_per_multi_processor // WARP,
        )


def programs_per_sm(regs: int, warps: int, shared: int, sm: SmLimits = SmLimits()) -> int:
    """Resident programs per SM: registers are allocated per warp in units of 256 (a thread's count rounded up
    to 8); shared memory takes 1 KB per block beyond the kernel's own; and the SM's warp and block limits."""
    by_regs = sm.registers // (math.ceil(regs / 8) * 8 * WARP * warps)
    by_shared = sm.shared_bytes // (shared + 1024)
    return min(by_regs, by_shared, sm.warps // warps, sm.blocks)


def cap_for(programs: int, warps: int, sm: SmLimits = SmLimits()) -> int:
    """The most registers per thread at which `programs` programs of `warps` warps fit an SM's registers."""
    return sm.registers // (programs * WARP * warps) // 8 * 8


CAP_TRIES = 3
"""Caps tried per occupancy: the threshold and two steps of 8 below it (ptxas can spill at a threshold and not
8 under it: the 1.5B paged variant spills 8 B at 128 and none at 120 with Triton 3.6)."""

MAX_SPILL_BYTES = 32
"""Spilled bytes per thread a ladder's cap may have (local memory, served from L1): 32 B measured a net win
where it saved a wave, 56 B a loss against it at the same waves."""


def occupancy_ladder(
    compile_with: Callable[[int | None], tuple[int, int, int]], warps: int, sm: SmLimits
) -> list[tuple[int, int | None]]:
    """[(programs per SM, register cap)] of one kernel variant, from its own occupancy uncapped (cap None) up:
    `compile_with(cap)` (None: uncapped) gives its (registers, spilled bytes, shared bytes). Each occupancy up
    to what shared memory and the warps allow is tried at caps `cap_for(programs)` and up to two steps of 8
    below; the first with at most `MAX_SPILL_BYTES` spilled joins the ladder, and the first occupancy that
    every try spills more at ends it."""
    regs, spills, shared = compile_with(None)
    now = programs_per_sm(regs, warps, shared, sm)
    ladder: list[tuple[int, int | None]] = [(now, None)]
    if spills:  # (a kernel that spills uncapped is left alone)
        return ladder
    ceiling = programs_per_sm(8, warps, shared, sm)  # what shared memory and the warp/block limits allow
    for programs in range(now + 1, ceiling + 1):
        top = cap_for(programs, warps, sm)
        tries = [cap for cap in range(top, top - 8 * CAP_TRIES, -8) if cap >= 24]
        cap = next((c for c in tries if compile_with(c)[1] <= MAX_SPILL_BYTES), None)
        if cap is None:
            break
        ladder.append((programs, cap))
    return ladder


def waves(programs: int, per_sm: int, sms: int) -> int:
    """Rounds of `programs` equal programs on `sms` SMs that hold `per_sm` each at once."""
    return math.ceil(programs / (sms * per_sm))


def launch_cap(ladder: list[tuple[int, int | None]], programs: int, sms: int) -> int | None:
    """The cap for a launch of `programs` programs: the ladder's highest cap (fewest programs per SM) among
    those that need the fewest waves, or None where no cap needs fewer waves than the uncapped kernel."""
    fewest = min(waves(programs, per_sm, sms) for per_sm, _ in ladder)
    return next(cap for per_sm, cap in ladder if waves(programs, per_sm, sms) == fewest)


class VariantLadders:
    """Per compiled variant of one Triton kernel (device, dtype, constexprs, warps, stages): its
    `occupancy_ladder` built from its own compiled counts (Triton's `warmup` compiles without launching; the
    driver reports registers and local memory once the binary is loaded), the counts of every cap compiled,
    and the caps its launches took, by program count. The first call's integer specialisation of a variant
    stands for its later calls."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.found: dict[tuple, dict] = {}

    def variant(self, args: tuple, constexprs: dict, grid: tuple, warps: int, stages: int, like) -> dict:
        """The record of the variant that `kernel[grid](*args, **constexprs)` would launch (`like`: a tensor on
        its device, in its dtype)."""
        key = (like.device, like.dtype, *sorted(constexprs.items()), warps, stages)
        if key not in self.found:
            counts = {}

            def compile_with(cap: int | None) -> tuple[int, int, int]:
                capped = {} if cap is None else {"maxnreg": cap}
                kernel = self.kernel.warmup(
                    *args, grid=grid, **constexprs, num_warps=warps, num_stages=stages, **capped
                )
                kernel._init_handles()  # loads the binary: the driver reports registers and local memory
                counts[cap] = (kernel.n_regs, 4 * kernel.n_spills, kernel.metadata.shared)  # (4-byte words)
                return counts[cap]

            ladder = occupancy_ladder(compile_with, warps, SmLimits.from_device(like.device))
            self.found[key] = dict(constexprs=constexprs, ladder=ladder, counts=counts, caps_by_programs={})
        return self.found[key]

    def cap(self, args: tuple, constexprs: dict, grid: tuple, warps: int, stages: int, like, sms: int):
        """`launch_cap` for the launch `kernel[grid](*args, **constexprs)` on `sms` SMs, from its variant's
        ladder (built on the variant's first launch), cached per program count."""
        record, programs = self.variant(args, constexprs, grid, warps, stages, like), grid[0] * grid[1]
        if programs not in record["caps_by_programs"]:
            record["caps_by_programs"][programs] = launch_cap(record["ladder"], programs, sms)
        return record["caps_by_programs"][programs]

    def report(self, names: tuple[str, ...]) -> list[dict]:
        """One entry per variant: its constexprs among `names` (lower case), its ladder (programs per SM, cap,
        registers, spilled bytes per rung) and the cap each launch size took (None: uncapped)."""
        return [
            {
                **{k.lower(): v for k, v in rec["constexprs"].items() if k in names},
                "ladder": [
                    dict(programs_per_sm=p, cap=c, regs=rec["counts"][c][0], spill_bytes=rec["counts"][c][1])
                    for p, c in rec["ladder"]
                ],
                "caps_by_programs": dict(sorted(rec["caps_by_programs"].items())),
            }
            for rec in self.found.values()
        ]


def launched_kernels(prefix: str = "engine.") -> list[dict]:
    """Every Triton kernel of the loaded modules under `prefix` compiled in this process (on a GPU), one entry
    per compiled variant: its constexprs, warps, stages, register cap, and the registers, spills (Triton's
    `n_spills`), shared memory and programs per SM the driver reports for it."""
    import sys

    import torch
    from triton.runtime.jit import JITFunction

    found = []
    for module in [m for name, m in list(sys.modules.items()) if name.startswith(prefix)]:
        for name, fn in sorted(vars(module).items()):
            if not isinstance(fn, JITFunction) or fn.__module__ != module.__name__:
                continue
            for device, caches in fn.device_caches.items():
                sm = SmLimits.from_device(torch.device("cuda", device))
                for kernel in list(caches[0].values()):
                    kernel = kernel.result() if hasattr(kernel, "result") else kernel
                    kernel._init_handles()
                    meta, names = kernel.metadata, fn.arg_names
                    constants = {
                        names[k[0]]: v for k, v in kernel.src.constants.items() if names[k[0]].isupper()
                    }
                    found.append(
                        dict(
                            kernel=f"{module.__name__}.{name}",
                            constexprs=constants,
                            warps=meta.num_warps,
                            stages=meta.num_stages,
                            maxnreg=getattr(meta, "maxnreg", None),
                            regs=kernel.n_regs,
                            spills=kernel.n_spills,
                            shared=meta.shared,
                            programs_per_sm=programs_per_sm(kernel.n_regs, meta.num_warps, meta.shared, sm),
                        )
                    )
    return found
