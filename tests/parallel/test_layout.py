"""Golden tests for parallel/layout.py, parallel/hybrid_layout.py and parallel/stage_layers.py: pure rank math,
no processes (world size: none)."""

from fractions import Fraction

import pytest
import torch
from megatron.core.parallel_state import RankGenerator

from parallel.hybrid_layout import HybridLayout, ParamSpec, RolloutLayout, validate_rollout
from parallel.layout import PartitionKind, TrainLayout
from parallel.stage_layers import stage_layer_counts

KINDS = list(PartitionKind)


def _divisors(n):
    return [x for x in range(1, n + 1) if n % x == 0]


def _all_layouts(max_world=16):
    for t in range(1, max_world + 1):
        for p in range(1, max_world // t + 1):
            for d in range(1, max_world // (t * p) + 1):
                for vpp in (1, 2) if p > 1 else (1,):
                    for t_g in _divisors(t):
                        for p_g in _divisors(p):
                            yield HybridLayout(TrainLayout(t, p, d, vpp), RolloutLayout(t_g, p_g))


ALL_LAYOUTS = list(_all_layouts())


def _megatron_shard(full, kind, tp, tp_rank):
    """How megatron shards a full tensor over `tp` ranks (fc1 full tensor is [gate; up])."""
    if kind == PartitionKind.REPLICATED:
        return full
    if kind == PartitionKind.COLUMN:
        return full.chunk(tp, dim=0)[tp_rank]
    if kind == PartitionKind.ROW:
        return full.chunk(tp, dim=1)[tp_rank]
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]])


def _full_tensor(kind, tp, generator):
    shape = {
        PartitionKind.REPLICATED: (3,),
        PartitionKind.COLUMN: (2 * tp, 3),
        PartitionKind.ROW: (3, 2 * tp),
        PartitionKind.COLUMN_GATED: (4 * tp, 3),
    }[kind]
    return torch.randn(shape, generator=generator)


def _partition(groups, world_size):
    return sorted(r for g in groups for r in g) == list(range(world_size))


def test_exhaustive_groups_and_coordinates():
    assert len(ALL_LAYOUTS) > 500
    for layout in ALL_LAYOUTS:
        train, n = layout.train, layout.train.world_size
        generator = RankGenerator(tp=train.tp, ep=1, dp=train.dp, pp=train.pp, cp=1, order="tp-cp-ep-dp-pp")
        assert train.tp_groups() == generator.get_ranks("tp")
        assert train.pp_groups() == generator.get_ranks("pp")
        assert train.dp_groups() == generator.get_ranks("dp")
        for rank in range(n):
            c = train.coords(rank)
            assert train.rank(c.tp_rank, c.pp_rank, c.dp_rank) == rank
        sizes = {
            "rollout_tp": (layout.rollout_tp_groups(), layout.rollout.tp),
            "rollout_pp": (layout.rollout_pp_groups(), layout.rollout.pp),
            "rollout_dp": (layout.rollout_dp_groups(), layout.rollout_dp_size),
            "micro_dp": (layout.micro_dp_groups(), layout.micro_dp_size),
        }
        for name, (groups, size) in sizes.items():
            assert _partition(groups, n), (layout, name)
            assert all(len(g) == size for g in groups), (layout, name)
        coords = [layout.rollout_coords(r) for r in range(n)]
        assert all([coords[r].tp_rank for r in g] == list(range(len(g))) for g in layout.rollout_tp_groups())
        assert all([coords[r].pp_rank for r in g] == list(range(len(g))) for g in layout.rollout_pp_groups())
        assert all([coords[r].dp_rank for r in g] == list(range(len(g))) for g in layout.rollout_dp_groups())
        for group in layout.micro_dp_groups():
            assert group == sorted(group)
            assert [coords[r].micro_dp_rank for r in group] == list(range(len(group)))
            # one rollout shard per micro-DP group: all members share rollout tp and pp ranks
            assert len({(coords[r].tp_rank, coords[r].pp_rank) for r in group}) == 1
        # a rollout replica (fixed dp_rank) is one full rollout model: t_g * p_g distinct shards
        for dp_rank in range(layout.rollout_dp_size):
            replica = {(c.tp_rank, c.pp_rank) for c in coords if c.dp_rank == dp_rank}
            assert len(replica) == layout.rollout.tp * layout.rollout.pp


def test_exhaustive_layer_ownership():
    for layout in ALL_LAYOUTS:
        train = layout.train
        num_layers = 2 * train.pp * train.vpp
        held = sorted(i for s in range(train.pp) for chunk in train.layers(s, num_layers) for i in chunk)
        assert held == list(range(num_layers))
        for group in layout.micro_dp_groups():
            rollout_layers = {i for chunk in layout.rollout_layers(group[0], num_layers) for i in chunk}
            members = {
                i for r in group for chunk in train.layers(train.coords(r).pp_rank, num_layers) for i in chunk
            }
            assert rollout_layers == members
            for layer in rollout_layers:
                owners = [group[pos] for pos in layout.owner_positions(group[0], layer, num_layers)]
                assert [train.coords(r).tp_rank % layout.tp_ratio for r in owners] == list(
                    range(layout.tp_ratio)
                )
                for r in owners:
                    assert any(layer in chunk for chunk in train.layers(train.coords(r).pp_rank, num_layers))


@pytest.mark.parametrize(
    "num_layers, pp, vpp, first, last",
    [
        (16, 1, 1, 0, 0),
        (16, 2, 1, 0, 0),
        (16, 4, 1, 0, 0),
        (16, 2, 2, 0, 0),
        (16, 4, 2, 0, 0),
        (16, 2, 4, 0, 0),
        # uneven: megatron's num_layers_in_first/last_pipeline_stage, as engine/models/builder.py sets them
        (3, 2, 1, 0, 0),
        (28, 3, 1, 0, 0),
        (80, 3, 1, 0, 0),
        (30, 4, 1, 0, 0),
        (9, 4, 1, 0, 0),
        (10, 3, 2, 0, 0),
        (14, 4, 2, 0, 0),
        (8, 2, 1, 3, 0),
        (12, 4, 2, 2, 2),
    ],
)
def test_layers_match_megatron_offsets(num_layers, pp, vpp, first, last):
    """Our ranges equal megatron's own offsets and layer counts for the config our builder makes."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from engine.config import ModelConfig
    from engine.models.builder import resolve_shape, transformer_config
    from parallel.dims import ParallelDims

    dims = ParallelDims(world_size=pp, pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
    shape = resolve_shape(ModelConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=2), 16, 1)
    config = transformer_config(shape, dims, init_std=0.02, recompute=False, on_cpu=True)
    train = dims.train_layout()
    held = sorted(i for s in range(pp) for chunk in train.layers(s, num_layers) for i in chunk)
    assert held == list(range(num_layers))
    for stage in range(pp):
        for v, chunk in enumerate(train.layers(stage, num_layers)):
            vp_stage = v if vpp > 1 else None
            start = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=stage)
            count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=stage)
            assert chunk == range(start, start + count)
            assert all(train.stage_of_layer(i, num_layers) == stage for i in chunk)


def test_stage_layer_counts_rule():
    """Uneven counts: the busiest stage as light as possible, then the last stage lightest, then the first."""
    assert stage_layer_counts(3, 2) == (2, 1)
    assert stage_layer_counts(28, 3) == (10, 10, 8)  # Qwen2.5-7B at PP=3
    assert stage_layer_counts(80, 3) == (27, 27, 26)
    assert stage_layer_counts(30, 4) == (8, 8, 8, 6)
    assert stage_layer_counts(5, 4) == (2, 1, 1, 1)
    assert stage_layer_counts(10, 3, vpp=2) == (4, 4, 2)
    assert stage_layer_counts(16, 4, vpp=2) == (4, 4, 4, 4)
    assert stage_layer_counts(8, 2, 1, 3) == (3, 5)  # parallel.first_stage_layers
    assert stage_layer_counts(8, 3, 1, 0, 2) == (3, 3, 2)  # parallel.last_stage_layers
    for num_layers in range(1, 41):
        for pp in range(1, 9):
            for vpp in (1, 2, 3) if pp > 1 else (1,):
                uneven_interleaved_pp2 = pp == 2 and vpp > 1 and num_layers % (pp * vpp)
                if num_layers % vpp or num_layers < pp * vpp or uneven_interleaved_pp2:
                    with pytest.raises(ValueError, match="parallel.vpp|parallel.pp"):
                        stage_layer_counts(num_layers, pp, vpp)
                    continue
                counts = stage_layer_counts(num_layers, pp, vpp)
                assert sum(counts) == num_layers and all(c > 0 and c % vpp == 0 for c in counts)
                assert len(set(counts[1:-1])) <= 1  # megatron: equal middle stages
                if num_layers % (pp * vpp) == 0:
                    assert set(counts) == {num_layers // pp}
                units = num_layers // vpp
                if units > (pp - 1) * -(-units // pp):  # the last stage can take the shortfall alone
                    assert max(counts) == vpp * -(-units // pp)
                assert counts[-1] <= counts[0]  # swapping first and last is always a valid split


@pytest.mark.parametrize(
    "args, needle",
    [
        ((3, 2, 2), "parallel.vpp=2"),  # 3 layers do not split into 2 equal virtual chunks
        ((3, 4), "parallel.pp=4"),  # fewer layers than stages
        ((4, 1, 1, 2), "parallel.first_stage_layers=2 needs parallel.pp > 1"),
        ((8, 2, 2, 3), "parallel.first_stage_layers=3 must be a multiple of parallel.vpp=2"),
        ((8, 2, 1, 8), "the two stages must add up to 8"),
        ((8, 4, 1, 1, 2), "must be a positive multiple of 2"),
        ((8, 2, 1, -1), "parallel.first_stage_layers=-1 must be >= 0"),
        ((6, 2, 2), "cannot place with the interleaved schedule at parallel.pp=2"),
    ],
)
def test_stage_layer_counts_errors_name_the_key(args, needle):
    with pytest.raises(ValueError, match="Fix:") as err:
        stage_layer_counts(*args)
    assert needle in str(err.value)


def test_uneven_layer_ownership_and_rollout_layers():
    """Uneven stages: every layer has one owner, and a rollout stage holds exactly its training stages'
    layers (contiguous per virtual chunk), for every (p, vpp, p_g) and every splittable layer count."""
    for pp in (2, 3, 4, 6):
        for vpp in (1, 2) if pp > 2 else (1,):
            for num_layers in range(pp * vpp, 4 * pp * vpp + 1, vpp):
                train = TrainLayout(tp=1, pp=pp, dp=1, vpp=vpp)
                owners = {i: s for s in range(pp) for chunk in train.layers(s, num_layers) for i in chunk}
                assert sorted(owners) == list(range(num_layers))
                assert all(train.stage_of_layer(i, num_layers) == s for i, s in owners.items())
                for p_g in _divisors(pp):
                    layout = HybridLayout(train, RolloutLayout(1, p_g))
                    for rank in range(pp):
                        s = layout.rollout_coords(rank).pp_rank
                        held = [i for chunk in layout.rollout_layers(rank, num_layers) for i in chunk]
                        assert held == sorted(held) or vpp > 1
                        assert set(held) == {i for i, o in owners.items() if o // layout.pp_ratio == s}


def test_exhaustive_slices_tile_rollout_shards():
    generator = torch.Generator().manual_seed(0)
    seen = set()
    for layout in ALL_LAYOUTS:
        t, t_g = layout.train.tp, layout.rollout.tp
        if (t, t_g) in seen:  # slicing depends only on (t, t_g); groups are checked on the first layout
            continue
        seen.add((t, t_g))
        coords = {r: layout.rollout_coords(r) for r in range(layout.train.world_size)}
        for kind in KINDS:
            full = _full_tensor(kind, t, generator)
            for group in layout.micro_dp_groups():
                for stage_positions in {
                    layout.stage_positions(layout.train.coords(r).pp_rank) for r in group
                }:
                    members = [group[pos] for pos in stage_positions]
                    expected = _megatron_shard(full, kind, t_g, coords[members[0]].tp_rank)
                    rollout = torch.full_like(expected, float("nan"))
                    hits = torch.zeros_like(expected)
                    for rank in members:
                        tp_rank = layout.train.coords(rank).tp_rank
                        shard = _megatron_shard(full, kind, t, tp_rank)
                        placement = layout.placement(
                            rank, kind, full.shape[1 if kind == PartitionKind.ROW else 0]
                        )
                        assert placement.train_size == shard.shape[placement.dim]
                        assert placement.rollout_size == expected.shape[placement.dim]
                        for block in placement.blocks:
                            src = shard.narrow(placement.dim, block.src.start, len(block.src))
                            rollout.narrow(placement.dim, block.dst.start, len(block.dst)).copy_(src)
                            hits.narrow(placement.dim, block.dst.start, len(block.dst)).add_(1)
                            assert torch.equal(
                                src, full.narrow(placement.dim, block.full.start, len(block.full))
                            )
                        if kind == PartitionKind.REPLICATED:
                            assert torch.equal(shard, expected)  # own tensor already is the rollout tensor
                    assert torch.equal(hits, torch.ones_like(hits)), (layout, kind)
                    assert torch.equal(rollout, expected), (layout, kind)


def test_own_shard_is_one_block_for_column_and_row_two_for_gated():
    layout = HybridLayout(TrainLayout(tp=4, pp=1, dp=1), RolloutLayout(tp=2))
    column = layout.placement(3, "column", 16)
    assert column.blocks[0].src == range(0, 4) and column.blocks[0].dst == range(4, 8)
    assert column.blocks[0].full == range(12, 16) and column.rollout_size == 8
    row = layout.placement(1, PartitionKind.ROW, 16)
    assert row.dim == 1 and row.blocks[0].dst == range(4, 8) and row.blocks[0].full == range(4, 8)
    gated = layout.placement(1, PartitionKind.COLUMN_GATED, 32)  # ffn_hidden 16: [gate; up] = 32 rows
    assert [(b.src, b.dst, b.full) for b in gated.blocks] == [
        (range(0, 4), range(4, 8), range(4, 8)),
        (range(4, 8), range(12, 16), range(20, 24)),
    ]
    assert layout.placement(1, "replicated", 5).blocks == ()


def test_qkv_interleaved_per_query_group_concatenates():
    num_groups, heads_per_group, head_dim, hidden = 4, 2, 3, 5
    q = torch.randn(num_groups, heads_per_group, head_dim, hidden)
    k, v = torch.randn(num_groups, 1, head_dim, hidden), torch.randn(num_groups, 1, head_dim, hidden)
    full = torch.cat([q, k, v], dim=1).reshape(-1, hidden)  # megatron: [q_g; k_g; v_g] per query group

    def qkv_of_groups(groups):
        return torch.cat([q[groups], k[groups], v[groups]], dim=1).reshape(-1, hidden)

    layout = HybridLayout(TrainLayout(tp=4, pp=1, dp=1), RolloutLayout(tp=2))
    for j in range(2):
        rollout = torch.empty(full.shape[0] // 2, hidden)
        for rank in range(2 * j, 2 * j + 2):
            shard = full.chunk(4)[rank]
            (block,) = layout.placement(rank, "column", full.shape[0]).blocks
            rollout[block.dst.start : block.dst.stop] = shard[block.src.start : block.src.stop]
        assert torch.equal(rollout, qkv_of_groups(slice(2 * j, 2 * j + 2)))


def test_paper_example():
    layout = HybridLayout(TrainLayout(tp=4, pp=1, dp=2), RolloutLayout(tp=2))
    assert layout.rollout_tp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.micro_dp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.micro_dp_size == 2 and layout.rollout_dp_size == 4
    assert layout.rollout_dp_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_pipeline_example():
    # t=2, p=4, d=1 -> t_g=1, p_g=2: k=2, q=2; rank = tp + 2*pp
    layout = HybridLayout(TrainLayout(tp=2, pp=4, dp=1), RolloutLayout(tp=1, pp=2))
    assert layout.micro_dp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.rollout_pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.rollout_tp_groups() == [[r] for r in range(8)]
    assert layout.rollout_layers(5, 8) == [range(4, 8)]
    assert layout.owner_positions(5, 6, 8) == range(2, 4)
    with pytest.raises(ValueError, match="does not hold layer"):
        layout.owner_positions(0, 6, 8)


@pytest.mark.parametrize(
    "make, key",
    [
        (
            lambda: validate_rollout(TrainLayout(4, 1, 2), RolloutLayout(3)),
            r"rollout\.tp=3 must divide parallel\.tp=4",
        ),
        (
            lambda: HybridLayout(TrainLayout(2, 4, 1), RolloutLayout(1, 3)),
            r"rollout\.pp=3 .*try rollout\.pp in",
        ),
        (lambda: HybridLayout(TrainLayout(2, 1, 1), RolloutLayout(4)), r"rollout\.tp=4"),
        (lambda: RolloutLayout(0), r"rollout\.tp=0"),
        (lambda: TrainLayout(0, 1, 1), r"parallel\.tp=0"),
        (lambda: TrainLayout(1, -1, 1), r"parallel\.pp=-1"),
        (lambda: TrainLayout(2, 1, 1, vpp=2), r"parallel\.vpp=2 needs parallel\.pp > 1"),
        (lambda: TrainLayout.from_world_size(6, tp=4, pp=1), r"parallel\.tp \* parallel\.pp"),
        (lambda: TrainLayout(1, 2, 1, vpp=2).layers(0, 5), r"num_layers=5 .*parallel\.vpp=2"),
        (
            lambda: HybridLayout(TrainLayout(4, 1, 1), RolloutLayout(2)).placement(0, "column_gated", 12),
            "parallel.tp",
        ),
    ],
)
def test_invalid_layouts_name_the_key(make, key):
    with pytest.raises(ValueError, match=key):
        make()


def test_communication_matches_hybridflow_formula():
    for layout in ALL_LAYOUTS:
        t, p, t_g, p_g = layout.train.tp, layout.train.pp, layout.rollout.tp, layout.rollout.pp
        stage_bytes = 64 * t  # every stage holds the same bytes; divisible by t
        params = [
            ParamSpec(stage_bytes // 4 * (1 + (i % 2)), kind, stage)
            for stage in range(p)
            for i, kind in enumerate([PartitionKind.COLUMN, PartitionKind.ROW, PartitionKind.COLUMN_GATED])
        ]
        model_bytes = sum(x.num_bytes for x in params)
        for rank in range(layout.train.world_size):
            received = layout.received_bytes(rank, params)
            assert received == Fraction(t * p - t_g * p_g, t_g * p_g * t * p) * model_bytes, layout
            assert layout.rollout_weight_bytes(rank, params) == Fraction(model_bytes, t_g * p_g)
            assert layout.naive_received_bytes(rank, params) == model_bytes - Fraction(model_bytes, t * p)


def test_replicated_parameters_cost_nothing_on_own_stage():
    layout = HybridLayout(TrainLayout(tp=2, pp=2, dp=1), RolloutLayout(tp=1, pp=1))
    norms = [ParamSpec(10, PartitionKind.REPLICATED, 0), ParamSpec(10, PartitionKind.REPLICATED, 1)]
    assert [layout.received_bytes(r, norms) for r in range(4)] == [10, 10, 10, 10]
    assert layout.rollout_weight_bytes(0, norms) == 20
