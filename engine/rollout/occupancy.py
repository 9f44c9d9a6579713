"""How many programs (thread blocks) of a kernel an NVIDIA SM holds at once, and the register cap that raises it
without spilling: `DecodeKernels.attention_occupancy`.

Why: a decode step's attention is latency-bound, so the loads in flight bound it, and those scale with the
programs resident per SM; registers bound that first for the decode attention's wider variants (1.5B and 7B,
paged cache, the group's prompt read from one row, RoPE inside: 160 registers, 3 programs per SM against 4
for the same kernel with RoPE apart; scripts/bench/README.md, "Rollout"). Triton's `maxnreg` launch option
caps the registers; a blanket cap is not neutral (ptxas fills up to it, and the leaner variants lose
programs), so the cap is chosen per compiled variant from its own counts: the highest occupancy that some cap
reaches with no bytes spilled, or none.
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
8 under it: the 1.5B variant above spills 8 B at 128 and none at 120 with Triton 3.6)."""


def occupancy_cap(
    compile_with: Callable[[int | None], tuple[int, int, int]], warps: int, sm: SmLimits
) -> int | None:
    """The register cap for one kernel variant: `compile_with(cap)` (None: uncapped) gives its (registers,
    spilled bytes, shared bytes). Each occupancy above the uncapped one, up to what shared memory and the warps
    allow, is tried in turn at caps `cap_for(programs)` and up to two steps of 8 below; the last with no spills
    wins, and the first occupancy that every try spills at ends the search. None: no cap raises occupancy
    without spilling (or the uncapped kernel spills already)."""
    regs, spills, shared = compile_with(None)
    if spills:
        return None
    now = programs_per_sm(regs, warps, shared, sm)
    ceiling = programs_per_sm(8, warps, shared, sm)  # what shared memory and the warp/block limits allow
    chosen = None
    for programs in range(now + 1, ceiling + 1):
        top = cap_for(programs, warps, sm)
        found = None
        for cap in range(top, max(top - 8 * CAP_TRIES, 23), -8):
            if cap >= 24 and compile_with(cap)[1] == 0:
                found = cap
                break
        if found is None:
            break
        chosen = found
    return chosen


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
