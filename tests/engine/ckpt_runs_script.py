"""Checkpoint, resume, crash, offload and HF export checks on whole training runs, in one process group.

    torchrun --nproc_per_node=1 tests/engine/ckpt_runs_script.py ROOT    (world size 1)
    torchrun --nproc_per_node=4 tests/engine/ckpt_runs_script.py ROOT    (world size 4: TP=2, PP=2 x VPP=2,
                                                                          PP=2 with 3 layers)

Each scenario builds the components exactly as `python -m engine.train` does (engine.setup) and runs
`Trainer.fit`; megatron's parallel state is rebuilt when the layout changes. Runs are compared through their
metrics.jsonl: every key except timing/* and perf/* must be equal (bit-exact float32 CPU math; the brief's
bound is 1e-6). Every rank reads the files and asserts the same things, so a failure stops all ranks together.
Rank 0 prints `RESULT {json}` lines that the pytest side (tests/engine/test_checkpoint.py) reads.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from megatron.core import tensor_parallel

import engine.checkpoint.checkpoint as checkpoint
from engine.checkpoint.run_dir import OutputDirError, claimed_output_dir
from engine.config import register_configs
from engine.config_load import to_dataclass
from engine.models.hf import HFCheckpoint
from engine.models.hf_config import read_hf_config
from engine.roles.offload import PARTS, device_bytes, offloaded
from engine.setup import build_components
from engine.tools.export import export_checkpoint, unwrap
from engine.tools.export import main as export_main
from engine.tools.parity import ParityConfig, compare_logits
from engine.trainer import Trainer
from engine.validate import validate
from parallel.state import destroy_distributed, destroy_model_parallel_groups, init_distributed

START = time.perf_counter()
ROOT = sys.argv[1]
CONF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "conf")
SHORT = [
    "trainer.total_steps=4",
    "optim.lr_decay=linear",  # the LR changes every step: a resume must land on the right point of it
    "trainer.progress_bar=false",
    "trainer.loggers=[jsonl]",
    "data.batch_size=8",
    "rollout.n=4",
    "trainer.micro_batch_size=4",
    "cluster.timeout_s=120",
]
# The KL-in-reward coefficient is controller state that must survive a resume.
KL_CTRL = ["algorithm.kl_in_reward=true", "algorithm.kl_ctrl=adaptive", "algorithm.kl_reward_coef=0.01"]
EXPORT_TOL = 5e-5  # float32 logits; TP=2 sums in another order (HF parity measures <= 1.5e-5)

register_configs()
_groups = None


def result(**fields) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            "RESULT " + json.dumps({**fields, "elapsed_s": round(time.perf_counter() - START, 2)}), flush=True
        )


def groups_for(cfg):
    """Process groups for cfg's layout (megatron's parallel state rebuilt when it changes)."""
    global _groups
    dims = validate(cfg, dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"]))
    if _groups is None or _groups.dims != dims:
        destroy_model_parallel_groups()
        _groups = init_distributed(dims, "cpu", cfg.cluster.timeout_s, cfg.trainer.seed)
    return _groups


def run(name: str, overrides: list[str], expect: type[BaseException] | None = None):
    """Build and fit one run in ROOT/name (as engine.train does); the components, or the expected error."""
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base="1.3"):
        cfg = to_dataclass(compose("train", [*SHORT, f"trainer.output_dir={ROOT}/{name}", *overrides]))
    groups = groups_for(cfg)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.trainer.seed)  # as a fresh process starts
    try:
        with claimed_output_dir(f"{ROOT}/{name}", cfg.trainer, groups):
            c = build_components(cfg, groups, f"{ROOT}/{name}")
            Trainer(c).fit()
    except BaseException as err:
        if expect is None or not isinstance(err, expect):
            raise
        dist.barrier()
        return err
    assert expect is None, f"{name}: expected {expect.__name__}"
    dist.barrier()  # rank 0 has written metrics.jsonl
    return c


def metrics(name: str) -> list[dict]:
    with open(f"{ROOT}/{name}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def assert_same_steps(ref: list[dict], got: list[dict], steps: list[int], what: str) -> float:
    """Rows of `steps` equal in every key but timing/perf; returns the largest difference (0 if exact)."""
    by_step = {r["step"]: r for r in ref}
    rows = {r["step"]: r for r in got}
    assert sorted(rows) == steps, f"{what}: logged steps {sorted(rows)}, want {steps}"
    worst = 0.0
    for step in steps:
        a, b = by_step[step], rows[step]
        keys = {k for k in a if not k.startswith(("timing/", "perf/"))}
        assert keys == {k for k in b if not k.startswith(("timing/", "perf/"))}, (what, step)
        for key in keys:
            diff = abs(a[key] - b[key])
            assert diff <= 1e-6, f"{what}: step {step} {key}: {a[key]} vs {b[key]}"
            worst = max(worst, diff)
    for key in ("reward/mean", "actor/grad_norm", "actor/pg_loss"):
        assert key in rows[steps[0]], key
    return worst


def ckpt_dirs(name: str) -> list[str]:
    return sorted(os.listdir(f"{ROOT}/{name}/checkpoints"))


def latest(name: str) -> str:
    with open(f"{ROOT}/{name}/checkpoints/latest") as f:
        return f.read().strip()


def fail_saving_at(step: int, ranks: set[int]):
    """Make `write_rank_file` (as engine.checkpoint.checkpoint calls it) raise on `ranks` when saving `step` (after the other ranks wrote theirs)."""
    real = checkpoint.write_rank_file

    def flaky(path, state):
        if state["step"] == step and dist.get_rank() in ranks:
            raise OSError(f"simulated crash while saving step {step}")
        real(path, state)

    checkpoint.write_rank_file = flaky
    return real


def export_parity(c, name: str) -> float:
    """Logits of the live actor vs transformers on its end-of-run export (collective)."""
    chunks = [unwrap(chunk) for chunk in c.actor.chunks]
    parity = ParityConfig(batch=2, seq_len=12, tol=EXPORT_TOL, seed=0)
    report = compare_logits(chunks, c.shape, f"{ROOT}/{name}/hf_actor", c.groups, parity)
    assert report["ok"], report
    return report["max_abs_logit_diff"]


# ---- world size 1 ----------------------------------------------------------------------------------------
def single_process() -> None:
    # uninterrupted: a checkpoint after every step, all kept, HF export at the end
    ref = run("ref", [*KL_CTRL, "trainer.save_freq=1", "trainer.max_checkpoints=0", "trainer.export_hf=true"])
    assert ckpt_dirs("ref") == [f"global_step_{s}" for s in (1, 2, 3, 4)] + ["latest"], ckpt_dirs("ref")
    assert latest("ref") == "global_step_4"
    meta = checkpoint.read_meta(f"{ROOT}/ref/checkpoints/global_step_2")
    assert meta["layout"] == {
        "world_size": 1,
        "tp": 1,
        "pp": 1,
        "vpp": 1,
        "dp": 1,
        "distributed_optimizer": False,
    }, meta["layout"]
    assert meta["step"] == 2 and meta["model"]["vocab_size"] == ref.shape.vocab_size
    result(check="export_parity", world=1, max_abs_diff=export_parity(ref, "ref"))

    # offload: device bytes drop to 0 and come back, values bit-identical
    before = {p: device_bytes(ref.actor, (p,)) for p in PARTS}
    flat = torch.cat([p.detach().reshape(-1) for ch in ref.actor.chunks for p in ch.parameters()]).clone()
    with offloaded(ref.actor):
        during = {p: device_bytes(ref.actor, (p,)) for p in PARTS}
    after = {p: device_bytes(ref.actor, (p,)) for p in PARTS}
    assert all(before.values()) and not any(during.values()) and after == before, (before, during, after)
    assert torch.equal(
        flat, torch.cat([p.detach().reshape(-1) for ch in ref.actor.chunks for p in ch.parameters()])
    )
    result(check="offload_bytes", before=before, during=during)

    # resume from a path at step 2: steps 3-4 equal the uninterrupted run's
    run("resumed", [*KL_CTRL, f"trainer.resume={ROOT}/ref/checkpoints/global_step_2"])
    worst = assert_same_steps(metrics("ref"), metrics("resumed"), [3, 4], "resume from path")
    result(check="resume_path", world=1, max_abs_diff=worst)
    resume_with_changed_config()

    # the trainer with both offloads on (and saving through them) trains bit-identically
    run(
        "offload",
        [*KL_CTRL, "trainer.offload_reference=true", "trainer.offload_optimizer=true", "trainer.save_freq=2"],
    )
    worst = assert_same_steps(metrics("ref"), metrics("offload"), [1, 2, 3, 4], "offload")
    result(check="offload_training", max_abs_diff=worst)

    # crash while saving step 4 (after step 2 was saved): latest still names step 2, nothing half-written is
    # visible; a killed save's leftover directory is ignored; resume=auto continues from step 2
    real = fail_saving_at(4, {0})
    err = run(
        "crash",
        [*KL_CTRL, "trainer.save_freq=2", "trainer.max_checkpoints=1"],
        expect=checkpoint.CheckpointError,
    )
    checkpoint.write_rank_file = real
    assert "failed on rank(s) [0]" in str(err) and "still names the previous" in str(err), err
    assert latest("crash") == "global_step_2" and ckpt_dirs("crash") == ["global_step_2", "latest"], (
        ckpt_dirs("crash")
    )
    killed = f"{ROOT}/crash/checkpoints/global_step_4.tmp-0123abcd"
    os.makedirs(killed)
    with open(f"{killed}/rank_0.pt", "wb") as f:
        f.write(b"half a file")
    run("crash", [*KL_CTRL, "trainer.save_freq=2", "trainer.max_checkpoints=1", "trainer.resume=auto"])
    rows = metrics("crash")
    # the crashed run logged step 3 past its step-2 checkpoint; the resumed run dropped that line, logged 3 again
    assert [r["step"] for r in rows] == [1, 2, 3, 4], [r["step"] for r in rows]
    worst = assert_same_steps(metrics("ref"), rows[2:], [3, 4], "resume=auto after a crash")
    # keep-last-1 pruned step 2 and the killed save's directory
    assert ckpt_dirs("crash") == ["global_step_4", "latest"] and latest("crash") == "global_step_4"
    result(check="crash_resume_auto", world=1, max_abs_diff=worst)

    # a fresh run in ref's directory is refused (its metrics and checkpoints would mix with ref's)
    err = run("ref", ["trainer.total_steps=1"], expect=OutputDirError)
    assert "holds an earlier run's outputs" in str(err) and "trainer.overwrite=true" in str(err), err
    result(check="fresh_refused", message=str(err))

    # the newest checkpoint's shard is truncated: resume=auto says so and continues from the one before
    shutil.copytree(f"{ROOT}/ref/checkpoints", f"{ROOT}/damaged/checkpoints")
    shard = f"{ROOT}/damaged/checkpoints/global_step_4/rank_0.pt"
    os.truncate(shard, os.path.getsize(shard) // 2)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        run("damaged", [*KL_CTRL, "trainer.save_freq=0", "trainer.resume=auto"])
    assert f"skipped {ROOT}/damaged/checkpoints/global_step_4: rank_0.pt is truncated" in said.getvalue(), (
        said.getvalue()
    )
    worst = assert_same_steps(metrics("ref"), metrics("damaged"), [4], "resume past a truncated checkpoint")
    result(check="damaged_newest_skipped", max_abs_diff=worst)

    # resume=auto with nothing saved: a fresh start; the optimizer layout must match
    run("fresh", ["trainer.total_steps=1", "trainer.resume=auto"])
    err = run(
        "mismatch",
        [
            *KL_CTRL,
            f"trainer.resume={ROOT}/ref/checkpoints/global_step_2",
            "optim.distributed_optimizer=true",
        ],
        expect=checkpoint.CheckpointError,
    )
    assert "differs in distributed_optimizer" in str(err) and "engine.export" in str(err), err
    result(check="layout_mismatch", world=1, message=str(err))

    # the export CLI (its own process group) writes the same files from the step-4 checkpoint as the
    # end-of-run export wrote from the live model
    destroy_distributed()
    global _groups
    _groups = None
    export_main([f"{ROOT}/ref", f"{ROOT}/cli_export"])  # a run's output_dir: its latest checkpoint
    with HFCheckpoint(f"{ROOT}/ref/hf_actor") as a, HFCheckpoint(f"{ROOT}/cli_export") as b:
        assert set(a.file_of) == set(b.file_of)
        assert all(torch.equal(a.tensor(n), b.tensor(n)) for n in a.file_of)
    assert read_hf_config(f"{ROOT}/ref/hf_actor") == read_hf_config(f"{ROOT}/cli_export")
    assert os.path.isfile(f"{ROOT}/cli_export/tokenizer.json")
    result(check="export_cli", tensors=len(a.file_of))


def resume_with_changed_config() -> None:
    """A 2-step PPO run resumed with trainer.total_steps=4 and other optim.* follows the current config: the
    actor's and critic's LR at steps 3-4 equal a fresh 4-step run's with that config (linear decay; two
    mini-batches per step where the saved run had one: the schedule's position is counted in the new
    run's optimizer steps, it was left at the saved count), the param groups hold its betas/eps/weight
    decay, and the resume message names every changed key."""
    ppo = ["algorithm=ppo", "trainer.save_freq=2", "optim.lr_decay=linear"]
    changed = ["optim.lr=0.002", "optim.adam_beta1=0.8", "optim.adam_eps=1e-06", "optim.weight_decay=0.01"]
    changed.append("algorithm.num_mini_batches=2")
    run("two_steps", [*ppo, "trainer.total_steps=2"])
    run("fresh_changed", [*ppo, *changed])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        c = run("extended", [*ppo, *changed, f"trainer.resume={ROOT}/two_steps/checkpoints/global_step_2"])
    want = {r["step"]: r for r in metrics("fresh_changed")}
    got = {r["step"]: r for r in metrics("extended")}
    assert sorted(got) == [3, 4], sorted(got)
    lrs = {}
    for key in ("actor/lr", "critic/lr"):
        lrs[key] = [got[step][key] for step in (3, 4)]
        assert lrs[key] == [want[step][key] for step in (3, 4)] and min(lrs[key]) > 0, (key, got, want)
    for role in (c.actor, c.critic):
        for group in role.optimizer.param_groups:
            assert group["betas"] == (0.8, 0.999) and group["eps"] == 1e-06, group
            assert group["weight_decay"] == 0.01 * group["wd_mult"], group
    text = printed.getvalue()
    for line in (
        "trainer.total_steps: 2 -> 4",
        "optim.lr: 0.001 -> 0.002",
        "optim.adam_beta1: 0.9 -> 0.8",
        "optim.adam_eps: 1e-08 -> 1e-06",
        "optim.weight_decay: 0.0 -> 0.01",
        "algorithm.num_mini_batches: 1 -> 2",
    ):
        assert line in text, (line, text)
    result(check="resume_changed_config", lrs=lrs, message=text.strip().splitlines()[-8:])


# ---- world size 4 ----------------------------------------------------------------------------------------
TP2 = ["parallel.tp=2", "rollout.tp=2", "optim.distributed_optimizer=true"]  # dp=2
PP2 = ["parallel.pp=2", "parallel.vpp=2", "model.num_layers=4"]  # dp=2, interleaved schedule


def four_ranks() -> None:
    # TP=2 x DP=2 with the distributed optimizer: resume from a path; HF export gathers the TP shards
    ref = run("tp2", [*TP2, "trainer.save_freq=2", "trainer.export_hf=true"])
    result(check="export_parity", world=4, layout="tp2", max_abs_diff=export_parity(ref, "tp2"))
    run("tp2_resumed", [*TP2, f"trainer.resume={ROOT}/tp2/checkpoints/global_step_2"])
    worst = assert_same_steps(metrics("tp2"), metrics("tp2_resumed"), [3, 4], "tp2 resume")
    result(check="resume_path", world=4, layout="tp2", max_abs_diff=worst)

    # PP=2 x VPP=2: ranks 2 and 3 fail while saving step 3; resume=auto continues from step 2
    run("pp2", [*PP2, "trainer.save_freq=2", "trainer.max_checkpoints=0"])
    real = fail_saving_at(3, {2, 3})
    err = run("pp2_crash", [*PP2, "trainer.save_freq=1"], expect=checkpoint.CheckpointError)
    checkpoint.write_rank_file = real
    assert "failed on rank(s) [2, 3]" in str(err), err
    assert latest("pp2_crash") == "global_step_2", latest("pp2_crash")
    run("pp2_crash", [*PP2, "trainer.save_freq=1", "trainer.resume=auto"])
    worst = assert_same_steps(
        metrics("pp2"), metrics("pp2_crash")[2:], [3, 4], "pp2 resume=auto after a crash"
    )
    assert ckpt_dirs("pp2_crash") == ["global_step_3", "global_step_4", "latest"], ckpt_dirs("pp2_crash")
    result(check="crash_resume_auto", world=4, layout="pp2vpp2", max_abs_diff=worst)

    # a TP=2 checkpoint under PP=2: refused on every rank, naming the layouts and the way out
    err = run(
        "wrong_layout",
        [*PP2, f"trainer.resume={ROOT}/tp2/checkpoints/global_step_2"],
        expect=checkpoint.CheckpointError,
    )
    assert "differs in tp, pp, vpp" in str(err) and "model.path=" in str(err), err
    result(check="layout_mismatch", world=4, message=str(err))
    uneven_stages()


PP2_UNEVEN = ["parallel.pp=2", "model.num_layers=3"]  # dp=2; megatron's uneven stages: 2 layers, then 1


def uneven_stages() -> None:
    """PP=2 with 3 layers: resume from a path equals the uninterrupted run; the end-of-run HF export matches
    the live model in transformers, and the export from the step-4 checkpoint equals it bit-exact."""
    ref = run("pp2_uneven", [*PP2_UNEVEN, "trainer.save_freq=2", "trainer.export_hf=true"])
    assert [len(unwrap(c).decoder.layers) for c in ref.actor.chunks] == [2 if ref.groups.pp_rank == 0 else 1]
    diff = export_parity(ref, "pp2_uneven")
    run("pp2_uneven_resumed", [*PP2_UNEVEN, f"trainer.resume={ROOT}/pp2_uneven/checkpoints/global_step_2"])
    worst = assert_same_steps(metrics("pp2_uneven"), metrics("pp2_uneven_resumed"), [3, 4], "uneven resume")
    # export_checkpoint is the CLI's body (a second process group cannot be started inside one torchrun at
    # world size 4); the resumed run's groups have the checkpoint's layout
    export_checkpoint(f"{ROOT}/pp2_uneven/checkpoints/global_step_4", f"{ROOT}/pp2_uneven_cli", _groups)
    dist.barrier()
    with HFCheckpoint(f"{ROOT}/pp2_uneven/hf_actor") as a, HFCheckpoint(f"{ROOT}/pp2_uneven_cli") as b:
        assert set(a.file_of) == set(b.file_of) and "model.layers.2.mlp.up_proj.weight" in a.file_of
        assert all(torch.equal(a.tensor(n), b.tensor(n)) for n in a.file_of)
    assert read_hf_config(f"{ROOT}/pp2_uneven_cli")["num_hidden_layers"] == 3
    result(check="uneven_stages", world=4, export_max_abs_diff=diff, resume_max_abs_diff=worst)


if __name__ == "__main__":
    if int(os.environ.get("RANK", "0")) == 0:
        shutil.rmtree(ROOT, ignore_errors=True)
    try:
        (single_process if int(os.environ["WORLD_SIZE"]) == 1 else four_ranks)()
        result(check="done")
    finally:
        destroy_distributed()
