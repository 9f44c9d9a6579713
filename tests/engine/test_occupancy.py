"""engine/rollout/occupancy.py: programs per SM and the register cap that raises them without spilling, by hand
(H100/H200 limits: 65,536 registers, 228 KB of shared memory, 64 warps and 32 blocks per SM). The real
compiler's counts: tests/scripts/test_bench_kernel_registers.py; the engine's use: scripts/bench/rollout.py's
`native_occupancy` on a GPU."""

from engine.rollout.occupancy import SmLimits, cap_for, occupancy_cap, programs_per_sm

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


def test_occupancy_cap_takes_the_first_cap_without_spills_under_a_threshold():
    # The 1.5B variant of Triton 3.6: 160 registers (3 per SM); 128 spills 8 B, 120 none (4 per SM); every cap
    # for 5 per SM (96, 88, 80) spills: 120, and nothing below 80 is compiled
    compiler = Compiler(160, {128: 8, 96: 16, 88: 40, 80: 40})
    assert occupancy_cap(compiler, 4, SM) == 120
    assert compiler.asked == [None, 128, 120, 96, 88, 80]


def test_occupancy_cap_climbs_while_caps_do_not_spill():
    # 75 registers, 20 KB shared (6 per SM; shared memory allows 10): 72 (7), 64 (8), 56 (9) clean, 48 (10) and
    # the two below it spill -> 56
    compiler = Compiler(75, {48: 8, 40: 8, 32: 16}, shared=20480)
    assert occupancy_cap(compiler, 4, SM) == 56
    assert programs_per_sm(56, 4, 20480) == 9


def test_occupancy_cap_leaves_a_kernel_alone_where_nothing_is_gained():
    # shared memory already binds (71,680 B: 3 per SM): nothing is compiled beyond the uncapped kernel
    at_ceiling = Compiler(80, {}, shared=71680)
    assert occupancy_cap(at_ceiling, 4, SM) is None and at_ceiling.asked == [None]
    # a kernel that spills uncapped is not capped further
    assert occupancy_cap(lambda cap: (255, 64, 38912), 4, SM) is None
    # the next occupancy spills at every try: None
    assert occupancy_cap(Compiler(117, {96: 8, 88: 8, 80: 16}), 4, SM) is None
