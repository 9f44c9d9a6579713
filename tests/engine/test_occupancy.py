"""engine/rollout/occupancy.py: programs per SM, the ladder of register caps and each launch's cap, by hand
(H100/H200 limits: 65,536 registers, 228 KB of shared memory, 64 warps and 32 blocks per SM). The real
compiler's counts: tests/scripts/test_bench_kernel_registers.py; the engine's use: scripts/bench/rollout.py's
`native_uncapped` against the default on a GPU."""

from engine.rollout.occupancy import SmLimits, cap_for, launch_cap, occupancy_ladder, programs_per_sm, waves

SM = SmLimits()


def test_programs_per_sm_by_hand():
    # 4 warps: 160 regs -> 160 x 32 x 4 = 20,480 of 65,536 -> 3; 120 -> 15,360 -> 4; 75 rounds up to 80 -> 6;
    # 170 rounds up to 176 -> 22,528 -> 2 (unrounded it would be 3)
    assert programs_per_sm(160, 4, 38912) == 3
    assert programs_per_sm(120, 4, 38912) == 4
    assert programs_per_sm(75, 4, 20480) == 6
    assert programs_per_sm(170, 4, 20480) == 2
    # shared memory binds: 71,680 + 1,024 per program in 228 KB -> 3 (registers would allow 6)
    assert programs_per_sm(80, 4, 71680) == 3
    # warps bind: 64 per SM, 16 warps a program -> 4
    assert programs_per_sm(32, 16, 1024) == 4
    assert (
        programs_per_sm(120, 4, 38912, SmLimits(shared_bytes=100 * 1024)) == 2
    )  # another GPU's shared memory


def test_cap_for_by_hand():
    assert cap_for(4, 4) == 128  # 65,536 / (4 x 32 x 4)
    assert cap_for(5, 4) == 96  # 102.4 -> a multiple of 8 below
    assert cap_for(8, 2) == 128 and cap_for(3, 4) == 168  # 170.7 -> 168


class Compiler:
    """A kernel variant's counts per cap, as ptxas would report them: (registers, spilled bytes, shared)."""

    def __init__(self, uncapped, spills_at, shared=38912):
        self.uncapped, self.spills_at, self.shared, self.asked = uncapped, spills_at, shared, []

    def __call__(self, cap):
        self.asked.append(cap)
        if cap is None:
            return self.uncapped, 0, self.shared
        return min(cap, self.uncapped), self.spills_at.get(cap, 0), self.shared


def test_the_ladder_takes_the_first_cap_within_the_spill_allowance_under_each_threshold():
    # Triton 3.6's 1.5B paged variant: 160 registers (3 per SM); 128 spills 8 B (allowed): 4 per SM; every cap
    # for 5 per SM spills more than 32 B (96: 40, 88: 40, 80: 48): the ladder stops, and nothing below 80 is
    # compiled
    compiler = Compiler(160, {128: 8, 96: 40, 88: 40, 80: 48})
    assert occupancy_ladder(compiler, 4, SM) == [(3, None), (4, 128)]
    assert compiler.asked == [None, 128, 96, 88, 80]
    # 96 spilling 40 B but 88 none: 88 is the rung
    assert occupancy_ladder(Compiler(160, {96: 40}), 4, SM) == [(3, None), (4, 128), (5, 88)]


def test_the_ladder_climbs_to_what_shared_memory_allows():
    # 0.5B's variant: 126 registers, 20 KB shared (4 per SM; shared memory allows 10): 96 (5), 80 (6), 72 (7),
    # 64 (8: 32 B spilled, allowed), then 56 B at 56 and more below: the ladder ends at 8 per SM
    compiler = Compiler(126, {72: 8, 64: 32, 56: 56, 48: 88, 40: 120}, shared=20480)
    assert occupancy_ladder(compiler, 4, SM) == [(4, None), (5, 96), (6, 80), (7, 72), (8, 64)]
    assert programs_per_sm(8, 4, 20480) == 10


def test_the_ladder_leaves_a_kernel_alone_where_nothing_is_gained():
    # shared memory already binds (71,680 B: 3 per SM): nothing is compiled beyond the uncapped kernel
    at_ceiling = Compiler(80, {}, shared=71680)
    assert occupancy_ladder(at_ceiling, 4, SM) == [(3, None)] and at_ceiling.asked == [None]
    # a kernel that spills uncapped is not capped further
    assert occupancy_ladder(lambda cap: (255, 64, 38912), 4, SM) == [(2, None)]


def test_a_launch_takes_the_highest_cap_that_needs_the_fewest_waves():
    ladder = [(4, None), (5, 96), (6, 80), (7, 72), (8, 64)]
    # 0.5B at 512 rows: 1,024 programs on 132 SMs: 2 waves at 4-7 per SM, 1 at 8 -> 64 (measured 3.3-4.4%
    # faster on an H200; 96 and 72, which save no wave, measured nothing or a loss)
    assert waves(1024, 4, 132) == 2 and waves(1024, 7, 132) == 2 and waves(1024, 8, 132) == 1
    assert launch_cap(ladder, 1024, 132) == 64
    # 640 programs: 2 waves at 4 per SM (528), 1 at 5 (660) -> 96, the highest cap with one wave
    assert launch_cap(ladder, 640, 132) == 96
    # 500 programs fit one wave uncapped; 3,000 need 6 waves at 4 per SM, 5 at 5 (3,000 / 660 = 4.5 -> 5),
    # 4 at 6 and 7, 3 at 8 -> 64
    assert launch_cap(ladder, 500, 132) is None
    assert launch_cap(ladder, 3000, 132) == 64
    # 1,400 programs: 3 waves at 4 (528 each), 3 at 5 (660), 2 at 6 (792) -> 80
    assert launch_cap(ladder, 1400, 132) == 80
    assert launch_cap([(3, None)], 1024, 132) is None
