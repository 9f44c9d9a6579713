"""World size 4 (torchrun, gloo, CPU): HF <-> Megatron for every family and layout in one launch.

    torchrun --nproc_per_node=4 tests/engine/hf_multirank.py ROOT [cpu|cuda]   (ROOT: hf_tiny.make_all)

One process group; megatron's parallel state is rebuilt for each layout (TP, PP, VPP) in {(1,1,1),
(2,1,1), (1,2,1), (2,2,1), (1,2,2)}, DP taking the remaining ranks. For each family the layouts are
chained: layout k loads the checkpoint that layout k-1 saved (every other one sharded with an index), so
the chain HF -> M(1,1) -> HF -> M(2,1) -> ... is checked at every hop against the original:
- logits parity with transformers (float32, tol 1e-5) on the checkpoint being loaded;
- every saved tensor torch.equal to the original (names, dtypes, config.json too).
The mixture-of-experts families (Qwen3-MoE; Qwen2-MoE with a gated shared expert) run the same chain, then
load at expert-parallel layouts (tp, pp, ep) in {(1,1,2), (1,1,4), (2,1,2), (1,2,2), (2,2,2)} and export
again: files byte-equal to the EP=1 export, logits parity with transformers loading the export.
Then: the critic (value head from `score.weight`, vs transformers' token classification head, and a zero
head from a causal-LM checkpoint), a bfloat16 model's round trip, the largest tensor created while loading at TP=2, and the errors for
weights that disagree with config.json; a 3-layer Qwen2 at TP2 x PP2 (megatron's uneven stages: parity and
round trip); last the CLI (`engine.parity.main`, on the 3-layer model), which prints its JSON line.
Rank 0 prints `RESULT {json}` lines that the pytest side reads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from engine.models.builder import build_gpt_chunks
from engine.models.hf import HFCheckpoint, load_hf_weights, save_hf_checkpoint
from engine.models.hf_config import HFCheckpointError, read_hf_config
from engine.tools.parity import (
    ParityConfig,
    build_and_load,
    compare_logits,
    hf_model_shape,
    logits_on_rank0,
    random_tokens,
)
from parallel.dims import ParallelDims
from parallel.state import destroy_distributed, destroy_model_parallel_groups, init_distributed

START = time.perf_counter()  # after imports: elapsed_s times the checks
WORLD = 4
DEVICE = sys.argv[2] if len(sys.argv) > 2 else "cpu"  # cuda: the same checks on 4 GPUs with NCCL
LAYOUTS = ((1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2))
TOL = 5e-5  # float32 logits of magnitude ~6; TP=2 changes the summation order (measured <= 1e-5)
PARITY = ParityConfig(batch=2, seq_len=16, tol=TOL, seed=0)


def relayout(tp: int, pp: int, vpp: int = 1, ep: int = 1):
    destroy_model_parallel_groups()  # ~35 layouts in this launch: each one's groups must go
    return init_distributed(ParallelDims(WORLD, tp=tp, pp=pp, vpp=vpp, ep=ep), DEVICE)


def result(groups, **fields) -> None:
    if groups.rank == 0:
        fields["elapsed_s"] = round(time.perf_counter() - START, 2)
        print("RESULT " + json.dumps(fields), flush=True)


def assert_same_checkpoint(src: str, out: str) -> int:
    """Every tensor of `src` is in `out`, bit-exact, and nothing else; returns the tensor count."""
    with HFCheckpoint(src) as a, HFCheckpoint(out) as b:
        assert set(a.file_of) == set(b.file_of), (sorted(set(a.file_of) ^ set(b.file_of)), out)
        for name in a.file_of:
            ta, tb = a.tensor(name), b.tensor(name)
            assert ta.dtype == tb.dtype and torch.equal(ta, tb), (
                f"{name} differs after the round trip to {out}"
            )
    assert read_hf_config(src) == read_hf_config(out)
    return len(a.file_of)


def chain(family: str, src: str, out_root: str) -> None:
    prev = src
    for k, (tp, pp, vpp) in enumerate(LAYOUTS):
        groups = relayout(tp, pp, vpp)
        chunks, shape = build_and_load(prev, groups)
        report = compare_logits(chunks, shape, prev, groups, PARITY)
        out = os.path.join(out_root, f"{family}_tp{tp}pp{pp}vpp{vpp}")
        shard_bytes = 40_000 if k % 2 == 0 else 2 << 30  # small: several files + index.json
        save_hf_checkpoint(
            chunks, shape, groups, out, prev, read_hf_config(prev), max_shard_bytes=shard_bytes
        )
        num = assert_same_checkpoint(src, out) if groups.rank == 0 else 0
        sharded = os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
        result(
            groups, kind="layout", family=family, loaded=prev, saved_sharded=sharded, tensors=num, **report
        )
        prev = out


def same_files(a: str, b: str) -> bool:
    """Directories `a` and `b` hold the same file names with the same bytes."""
    names = sorted(os.listdir(a))
    if names != sorted(os.listdir(b)):
        return False
    for name in names:
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            if fa.read() != fb.read():
                return False
    return True


def moe_expert_parallel(family: str, src: str, out_root: str) -> None:
    """Load an MoE checkpoint with its experts split over expert-parallel ranks and export it again: the
    export's files equal the EP=1 export's (chain's first hop, also 40 kB shards) byte for byte, and
    transformers, loading the export, gives the Megatron model's logits."""
    ep1 = os.path.join(out_root, f"{family}_tp1pp1vpp1")
    for tp, pp, ep in ((1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2), (2, 2, 2)):
        groups = relayout(tp, pp, ep=ep)
        chunks, shape = build_and_load(src, groups)
        out = os.path.join(out_root, f"{family}_tp{tp}pp{pp}ep{ep}")
        save_hf_checkpoint(chunks, shape, groups, out, src, read_hf_config(src), max_shard_bytes=40_000)
        same = same_files(ep1, out) if groups.rank == 0 else None
        report = compare_logits(chunks, shape, out, groups, PARITY)
        result(groups, kind="moe_ep", family=family, same_files_as_ep1=same, **report)  # names tp, pp, ep


def critic(dirs: dict[str, str], out_root: str) -> None:
    """Value head at TP2 x PP2: loaded from score.weight (vs transformers), zero from a causal LM."""
    groups = relayout(2, 2)
    chunks, shape = build_and_load(dirs["critic"], groups, value_head=True)
    tokens = random_tokens(shape, PARITY, groups.device)
    values = logits_on_rank0(chunks, tokens, shape, groups, width=1)  # (b, s, 1)
    diff = None
    if groups.rank == 0:
        from transformers import AutoModelForTokenClassification

        hf = AutoModelForTokenClassification.from_pretrained(dirs["critic"], dtype=torch.float32)
        hf = hf.to(groups.device).eval()
        with torch.no_grad():
            diff = (values - hf(input_ids=tokens).logits).abs().max().item()
        assert diff <= TOL, diff
    out = os.path.join(out_root, "critic_tp2pp2")
    save_hf_checkpoint(chunks, shape, groups, out, dirs["critic"], read_hf_config(dirs["critic"]))
    num = assert_same_checkpoint(dirs["critic"], out) if groups.rank == 0 else 0
    result(groups, kind="critic", max_abs_value_diff=diff, tol=TOL, tensors=num)

    fresh, _ = build_and_load(dirs["qwen2"], groups, value_head=True)
    if groups.is_last_stage:
        head = fresh[-1].output_layer.weight
        assert head.shape == (1, shape.hidden_size) and not head.any(), "value head must stay zero"
    result(groups, kind="critic_fresh_head_zero", ok=True)


def bf16_round_trip(src: str, out_root: str) -> None:
    """A bfloat16 model at TP2 x PP2 from a float32 checkpoint saves exactly the bf16-rounded tensors."""
    groups = relayout(2, 2)
    shape = dataclasses.replace(hf_model_shape(src, 2), dtype=torch.bfloat16)
    chunks = build_gpt_chunks(shape, groups, init_std=0.02, recompute=False)
    load_hf_weights(chunks, src, shape, groups)
    out = os.path.join(out_root, "bf16_tp2pp2")
    save_hf_checkpoint(chunks, shape, groups, out, src, read_hf_config(src))
    if groups.rank == 0:
        with HFCheckpoint(src) as a, HFCheckpoint(out) as b:
            assert set(a.file_of) == set(b.file_of)
            for name in a.file_of:
                assert torch.equal(a.tensor(name).to(torch.bfloat16), b.tensor(name)), name
    result(groups, kind="bf16_round_trip", ok=True)


class LargestNewTensor(TorchDispatchMode):
    """Records the largest storage any torch op allocates (outputs sharing no input's storage)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = pytree.tree_leaves((args, kwargs))
        seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                if t.untyped_storage().data_ptr() not in seen:
                    self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def load_memory(path: str) -> None:
    """At TP=2: the largest tensor torch creates while loading, and the anonymous memory the load keeps."""
    groups = relayout(2, 1)
    shape = hf_model_shape(path, 2)
    chunks = build_gpt_chunks(shape, groups, init_std=0.02, recompute=False)
    biggest_shard = max(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    with HFCheckpoint(path) as ckpt:
        full = ckpt.tensor("model.embed_tokens.weight")
        biggest_full = full.numel() * full.element_size()
        with LargestNewTensor() as naive:  # the instrument sees a materialised full tensor
            full.clone()
    assert naive.largest >= biggest_full, (naive.largest, biggest_full)
    before = rss_anon_bytes()
    with LargestNewTensor() as seen:
        load_hf_weights(chunks, path, shape, groups)
    kept = rss_anon_bytes() - before
    bound = biggest_shard // 8
    assert seen.largest <= bound, f"loading created a {seen.largest}-byte tensor > bound {bound}"
    assert kept <= biggest_full // 2, f"loading kept {kept} bytes of anonymous memory"
    per_rank = [None] * WORLD
    dist.all_gather_object(per_rank, (seen.largest, kept))
    result(
        groups,
        kind="memory",
        largest_new_tensor_bytes_per_rank=[p[0] for p in per_rank],
        rss_anon_growth_bytes_per_rank=[p[1] for p in per_rank],
        bound_bytes=bound,
        biggest_param_shard_bytes=biggest_shard,
        biggest_full_tensor_bytes=biggest_full,
        naive_full_clone_bytes=naive.largest,
    )


def errors(dirs: dict[str, str]) -> None:
    """Weights that disagree with config.json: the error names the tensor and the file (every rank)."""
    groups = relayout(2, 1)
    cases = {
        "bad_shape": ("model.layers.0.mlp.gate_proj.weight", "(96, 64)", "(128, 64)"),
        "missing_layer": ("model.layers.4.input_layernorm.weight", "missing", "num_hidden_layers"),
    }
    for case, needles in cases.items():
        try:
            build_and_load(dirs[case], groups)
        except HFCheckpointError as err:
            message = str(err)
        else:
            raise AssertionError(f"{case}: loading did not fail")
        for needle in (*needles, os.path.join(dirs[case], "model.safetensors")):
            assert needle in message, (case, needle, message)
        result(groups, kind="error", case=case, message=message)


def uneven(src: str, out_root: str) -> None:
    """3 layers at TP2 x PP2 (uneven stages: 2 layers, then 1): parity and a bit-exact round trip."""
    groups = relayout(2, 2)
    chunks, shape = build_and_load(src, groups)
    assert [len(c.decoder.layers) for c in chunks] == [2 if groups.pp_rank == 0 else 1]
    report = compare_logits(chunks, shape, src, groups, PARITY)
    out = os.path.join(out_root, "qwen2_3l_tp2pp2")
    save_hf_checkpoint(chunks, shape, groups, out, src, read_hf_config(src))
    num = assert_same_checkpoint(src, out) if groups.rank == 0 else 0
    result(groups, kind="uneven", tensors=num, **report)


def cli(path: str) -> None:
    """Last: the user-facing `python -m engine.parity` entry at TP2 x PP2 (it tears the groups down)."""
    from engine.tools.parity import main as parity_main

    parallel_state.destroy_model_parallel()
    argv = [
        f"model.path={path}",
        "parallel.tp=2",
        "parallel.pp=2",
        f"parity.tol={TOL}",
        f"cluster.device={DEVICE}",
    ]
    assert parity_main(argv) == 0


def main(root: str) -> None:
    names = (
        "qwen2",
        "qwen3",
        "llama",
        "qwen3_moe",
        "qwen2_moe",
        "critic",
        "big",
        "bad_shape",
        "missing_layer",
        "qwen2_3l",
    )
    dirs = {name: os.path.join(root, name) for name in names}
    out_root = os.path.join(root, "out")
    try:
        for family in ("qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe"):
            chain(family, dirs[family], out_root)
        for family in ("qwen3_moe", "qwen2_moe"):
            moe_expert_parallel(family, dirs[family], out_root)
        critic(dirs, out_root)
        bf16_round_trip(dirs["llama"], out_root)
        load_memory(dirs["big"])
        errors(dirs)
        uneven(dirs["qwen2_3l"], out_root)
        cli(dirs["qwen2_3l"])  # 3 layers: the CLI runs uneven stages too
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
