"""Checkpoints, resume and HF export (engine/checkpoint/checkpoint.py, engine/tools/export.py).

World sizes: the rules on disk (latest, pruning, finding, layout messages, config.json for random-init models)
are tested here without processes; whole training runs are tested by tests/engine/ckpt_runs_script.py, launched
once at world size 1 and once at world size 4 (TP=2 x DP=2 with the distributed optimizer, PP=2 x VPP=2).
Tolerances: resumed metrics equal the uninterrupted run's within 1e-6 (measured: bit-exact); exported models'
float32 logits within 5e-5 of the megatron model's in transformers (measured: 0 at TP=1, 1.2e-7 at TP=2).
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from distributed import run_torchrun

from engine.checkpoint.checkpoint import check_layout, check_shape, shape_fields
from engine.checkpoint.store import (
    complete_checkpoints,
    find_checkpoint,
    latest_checkpoint,
    prune_checkpoints,
    read_meta,
    read_rank_state,
)
from engine.config import ConfigError, ModelConfig, MoEConfig, register_configs
from engine.config_load import to_dataclass
from engine.errors import CheckpointError
from engine.models.builder import resolve_shape
from engine.models.hf_config import hf_config_from_shape, model_config_from_hf
from engine.validate import validate

SCRIPT = str(Path(__file__).with_name("ckpt_runs_script.py"))
CONF = str(Path(__file__).resolve().parents[2] / "conf")


def _results(out: str) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for line in out.splitlines():
        if "RESULT {" in line:
            row = json.loads(line.split("RESULT ", 1)[1])
            found.setdefault(row["check"], []).append(row)
    return found


@pytest.mark.slow
def test_world1_resume_crash_offload_export(tmp_path):
    """One process: resume from a path (steps 3-4 equal), a resume with a longer run and other optim.*
    (the LR follows the current config), a crash mid-save then resume=auto, keep-last-N, a fresh run
    refused in a used directory, resume=auto past a truncated newest checkpoint, a layout mismatch,
    offload in the trainer (bit-identical), HF export at the end and by the CLI."""
    found = _results(run_torchrun(SCRIPT, 1, [str(tmp_path / "runs")]))
    for check in (
        "export_parity",
        "offload_bytes",
        "resume_path",
        "resume_changed_config",
        "offload_training",
        "crash_resume_auto",
    ):
        assert check in found, f"missing {check}: {sorted(found)}"
    assert {"fresh_refused", "damaged_newest_skipped"} <= set(found), sorted(found)
    assert found["export_parity"][0]["max_abs_diff"] <= 5e-5
    assert {"layout_mismatch", "export_cli", "done"} <= set(found)


@pytest.mark.slow
def test_world4_tp2_and_pp2_resume_crash_mismatch_export(tmp_path):
    """World size 4: TP=2 (distributed optimizer) resume and HF export, PP=2 x VPP=2 crash then resume=auto,
    a TP=2 checkpoint refused under PP=2; PP=2 with 3 layers (uneven stages) resumed and exported."""
    found = _results(run_torchrun(SCRIPT, 4, [str(tmp_path / "runs")]))
    for check in (
        "export_parity",
        "resume_path",
        "crash_resume_auto",
        "layout_mismatch",
        "uneven_stages",
        "done",
    ):
        assert check in found, f"missing {check}: {sorted(found)}"
    assert found["export_parity"][0]["max_abs_diff"] <= 5e-5
    (uneven,) = found["uneven_stages"]
    assert uneven["export_max_abs_diff"] <= 5e-5 and uneven["resume_max_abs_diff"] <= 1e-6


# ---- no processes ---------------------------------------------------------------------------------------
def _fake_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    """A one-rank checkpoint with real files (a torch archive, meta.json) holding only the step."""
    path = root / f"global_step_{step}"
    path.mkdir(parents=True)
    torch.save({"step": step, "w": torch.zeros(64)}, path / "rank_0.pt")
    if complete:
        meta = {"format": 1, "step": step, "layout": {"world_size": 1}}
        (path / "meta.json").write_text(json.dumps(meta))
    return path


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def test_resume_auto_skips_an_unusable_newest_checkpoint_and_names_it(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    two, three, four = (_fake_checkpoint(root, s) for s in (2, 3, 4))
    (root / "latest").write_text("global_step_4\n")
    _truncate(four / "rank_0.pt")
    (three / "meta.json").unlink()
    skipped: list[str] = []
    assert find_checkpoint("auto", str(tmp_path / "run"), skipped) == str(two)
    assert skipped == [
        f"skipped {four}: rank_0.pt is truncated or corrupt (not a complete torch archive)",
        f"skipped {three}: meta.json is missing (the save did not complete)",
    ]


def test_resume_auto_stops_when_no_checkpoint_is_usable(tmp_path):
    """Every meta.json missing or unreadable: the run stops naming each checkpoint (it used to start fresh)."""
    root = tmp_path / "run" / "checkpoints"
    one, two = _fake_checkpoint(root, 1, complete=False), _fake_checkpoint(root, 2)
    (two / "meta.json").write_text('{"format": 1, "st')  # truncated
    with pytest.raises(CheckpointError) as err:
        find_checkpoint("auto", str(tmp_path / "run"))
    text = str(err.value)
    for needle in (
        f"{one}: meta.json is missing",
        f"{two}: meta.json is unreadable",
        "trainer.overwrite=true",
    ):
        assert needle in text, (needle, text)


def test_truncated_shard_or_meta_names_the_file_and_the_previous_checkpoint(tmp_path):
    two, three = _fake_checkpoint(tmp_path, 2), _fake_checkpoint(tmp_path, 3)
    assert read_rank_state(str(three), 0)["step"] == 3
    _truncate(three / "rank_0.pt")
    with pytest.raises(CheckpointError) as err:
        read_rank_state(str(three), 0)
    text = str(err.value)
    assert f"{three / 'rank_0.pt'} is truncated or corrupt" in text, text
    assert f"checkpoint {three} cannot be read" in text and f"trainer.resume={two}" in text, text
    _truncate(three / "meta.json")
    with pytest.raises(CheckpointError) as err:
        read_meta(str(three))
    text = str(err.value)
    assert f"{three / 'meta.json'} is truncated or corrupt" in text and f"trainer.resume={two}" in text, text


def test_disk_full_during_a_save_names_the_device_the_file_and_the_size(tmp_path, monkeypatch):
    """A world of one (gloo, in this process): the write of step 2 runs out of space (ENOSPC from the
    low-level write); the error says so, and step 1 stays the latest."""
    from trainer_jobs import SHORT, compose_config, distributed

    from engine.checkpoint.checkpoint import save_checkpoint

    state = {"step": 0, "w": torch.zeros(1024, 1024)}  # 4 MiB
    root = str(tmp_path / "checkpoints")
    os.makedirs(root)
    with distributed(compose_config(SHORT)) as groups:
        save_checkpoint(root, 1, state, {"layout": {"world_size": 1}}, groups, 2)
        real_save = torch.save

        def write_until_full(obj, f):  # torch writes part of the archive, then the device is full
            f.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(torch, "save", write_until_full)
        with pytest.raises(CheckpointError) as err:
            save_checkpoint(root, 2, state, {"layout": {"world_size": 1}}, groups, 2)
        monkeypatch.setattr(torch, "save", real_save)
    text = str(err.value)
    assert "no space left on " in text and "(mounted at " in text, text
    assert f"writing {root}/global_step_2.tmp-" in text and "rank_0.pt: this file needs about 4.0 MiB" in text
    assert "still names the previous checkpoint" in text and "needs about 4.0 MiB (all ranks' files)" in text
    assert sorted(os.listdir(root)) == ["global_step_1", "latest"]
    assert latest_checkpoint(root) == f"{root}/global_step_1"


def test_prune_keeps_newest_n_and_the_one_just_saved_and_drops_leftovers(tmp_path):
    for step in (1, 2, 3, 4):
        _fake_checkpoint(tmp_path, step)
    (tmp_path / "global_step_5.tmp-00ff").mkdir()  # a killed save
    (tmp_path / "global_step_2.old-abcd").mkdir()  # a replaced checkpoint not yet removed
    prune_checkpoints(str(tmp_path), 2, keep="global_step_4")
    assert sorted(os.listdir(tmp_path)) == ["global_step_3", "global_step_4"]
    prune_checkpoints(str(tmp_path), 1, keep="global_step_3")  # a resumed run re-saved an older step
    assert sorted(os.listdir(tmp_path)) == ["global_step_3"]
    _fake_checkpoint(tmp_path, 7)
    prune_checkpoints(str(tmp_path), 0, keep="global_step_7")  # 0 keeps all
    assert [s for s, _ in complete_checkpoints(str(tmp_path))] == [3, 7]


def test_latest_and_find(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    assert find_checkpoint("auto", str(tmp_path / "run")) is None  # nothing saved: a fresh start
    assert find_checkpoint("off", str(tmp_path / "run")) is None
    two, three = _fake_checkpoint(root, 2), _fake_checkpoint(root, 3)
    _fake_checkpoint(root, 9, complete=False)  # no meta.json: never chosen
    (root / "latest").write_text("global_step_2\n")
    assert latest_checkpoint(str(root)) == str(two)  # latest wins over a higher number
    (root / "latest").write_text("global_step_8\n")  # names nothing: the highest complete one
    assert latest_checkpoint(str(root)) == str(three)
    (root / "latest").unlink()
    assert find_checkpoint("auto", str(tmp_path / "run")) == str(three)
    (root / "latest").write_text("global_step_2\n")
    for given in (two, root, tmp_path / "run"):  # a checkpoint, a checkpoints dir, a run's output_dir
        assert find_checkpoint(str(given), "") == str(two)
    with pytest.raises(CheckpointError, match="not a checkpoint.*trainer.resume=auto"):
        find_checkpoint(str(tmp_path), "")


def test_layout_mismatch_names_both_layouts_and_the_way_out():
    saved = dict(world_size=4, tp=2, pp=1, vpp=1, dp=2, distributed_optimizer=True)
    check_layout(saved, dict(saved), "/ckpt")
    with pytest.raises(CheckpointError) as err:
        check_layout(saved, {**saved, "tp": 1, "pp": 2}, "/ckpt")
    text = str(err.value)
    for needle in (
        "tp=2 pp=1",
        "tp=1 pp=2",
        "differs in tp, pp",
        "not resharded",
        "engine.export",
        "model.path=",
    ):
        assert needle in text, (needle, text)


def test_resume_may_change_the_moe_training_settings_not_the_architecture():
    """check_shape refuses a checkpoint of another model, but not one whose MoE run differed only in the
    router losses' coefficients or the token dispatcher (the weights do not depend on them)."""
    moe = MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=32, aux_loss_coef=0.001)
    m = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, moe=moe)
    saved = json.loads(json.dumps(shape_fields(resolve_shape(m, 101, tp=1))))  # as meta.json reads back
    training = replace(moe, aux_loss_coef=0.0, z_loss_coef=0.01, token_dispatcher="allgather")
    check_shape(saved, resolve_shape(replace(m, moe=training), 101, tp=1), "/ckpt")
    with pytest.raises(CheckpointError, match="the model differs from the checkpoint's"):
        check_shape(saved, resolve_shape(replace(m, moe=replace(moe, num_experts=8)), 101, tp=1), "/ckpt")


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # llama-style: untied, no bias
        {"tie_embeddings": True, "head_dim": 32, "rope_scaling_factor": 8.0, "rope_theta": 500000.0},
        {"qkv_bias": True, "tie_embeddings": True},  # qwen2
        {"qk_norm": True},  # qwen3
        {"qk_norm": True, "moe": MoEConfig(num_experts=4, top_k=2, ffn_hidden_size=32, aux_loss_coef=0.001)},
        {  # qwen2_moe: gated shared expert, top-k weights not renormalised
            "qkv_bias": True,
            "moe": MoEConfig(
                num_experts=4,
                top_k=2,
                ffn_hidden_size=32,
                shared_expert_ffn_hidden_size=48,
                shared_expert_gate=True,
                norm_topk_prob=False,
            ),
        },
    ],
)
def test_random_init_config_json_reads_back_as_the_same_shape(overrides, tmp_path):
    m = ModelConfig(**{"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, **overrides})
    shape = resolve_shape(m, 101, tp=1)
    cfg = hf_config_from_shape(shape, {"eos_token_id": 3, "bos_token_id": None})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    back = resolve_shape(ModelConfig(**model_config_from_hf(str(tmp_path))), 101, tp=1)
    assert back == shape
    assert cfg["eos_token_id"] == 3 and "bos_token_id" not in cfg
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(str(tmp_path))
    assert loaded.num_key_value_heads == shape.num_query_groups and loaded.head_dim == shape.head_dim
    assert torch.float32 in (loaded.dtype, getattr(loaded, "torch_dtype", None))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.max_checkpoints=-1"], "trainer.max_checkpoints=-1: must be >= 0"),
        (["trainer.resume=auto"], "trainer.resume='auto': looks for checkpoints in trainer.output_dir"),
        ([f"trainer.resume={CONF}", "trainer.overwrite=true"], "trainer.overwrite=True: has no effect"),
    ],
)
def test_checkpoint_keys_are_validated(overrides, message):
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = to_dataclass(compose(config_name="train", overrides=overrides))
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=1)
    assert message in str(err.value)


def test_export_replaces_an_earlier_export_and_refuses_foreign_files(tmp_path):
    """World size 1, in this process: a sharded export (index.json + several files), then a single-file
    export of other weights into the same directory: the directory reads back the second export's weights
    and holds only its files. A directory holding a file no export writes is refused and left as it was."""
    from trainer_jobs import built_job

    from engine.models.hf import INDEX_FILE, SINGLE_FILE, HFCheckpoint, save_hf_checkpoint
    from engine.models.hf_config import HFCheckpointError
    from engine.tools.export import export_actor, unwrap

    out = str(tmp_path / "hf")
    with built_job([], str(tmp_path / "run")) as c:
        chunks = [unwrap(chunk) for chunk in c.actor.chunks]
        save_hf_checkpoint(chunks, c.shape, c.groups, out, None, {}, max_shard_bytes=4096)
        assert os.path.isfile(os.path.join(out, INDEX_FILE))
        norm = chunks[0].decoder.final_layernorm.weight
        with torch.no_grad():
            norm.add_(1.0)
        export_actor(c, out)
        with HFCheckpoint(out) as ckpt:  # the engine's loader prefers an index.json when there is one
            assert ckpt.source == os.path.join(out, SINGLE_FILE)
            assert torch.equal(ckpt.tensor("model.norm.weight"), norm.detach())
        assert not [f for f in os.listdir(out) if f.startswith("model-") or f == INDEX_FILE]
        assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f or ".old-" in f]

        with open(os.path.join(out, "notes.txt"), "w") as f:
            f.write("not an export's")
        before = sorted(os.listdir(out))
        with pytest.raises(HFCheckpointError, match=r"holds 'notes.txt'.*Fix: export into a new or empty"):
            export_actor(c, out)
        assert sorted(os.listdir(out)) == before


def test_resume_from_an_older_checkpoint_of_the_same_dir_is_refused_unless_overwrite(tmp_path, monkeypatch):
    """World size 1, in this process: run 1 saves steps 2 and 4; trainer.resume=<its step 2> in the same
    output_dir is refused before anything changes (a later resume=auto would take run 1's step 4 while
    metrics.jsonl held the branch's steps). With trainer.overwrite=true the branch deletes step 4 and points
    `latest` at step 2 before its first step; killed in step 3 (before any save of its own), a resume=auto
    then continues the branch from step 2, not run 1's step 4."""
    from trainer_jobs import read_metrics, run_job

    from engine.checkpoint.checkpoint import Checkpointer

    out = tmp_path / "run"
    root = out / "checkpoints"
    run1 = ["trainer.save_freq=2", "trainer.total_steps=4"]
    run_job(run1, str(out))
    assert sorted(os.listdir(root)) == ["global_step_2", "global_step_4", "latest"]
    metrics_before = (out / "metrics.jsonl").read_text()
    two = str(root / "global_step_2")
    branch = [*run1, f"trainer.resume={two}", "optim.lr=1e-2"]
    with pytest.raises(CheckpointError) as err:
        run_job(branch, str(out))
    text = str(err.value)
    for needle in (
        two,
        "step(s) 4",
        str(root / "global_step_4"),
        "trainer.overwrite=true",
        "new trainer.output_dir",
    ):
        assert needle in text, (needle, text)
    assert (out / "metrics.jsonl").read_text() == metrics_before
    assert (root / "latest").read_text() == "global_step_4\n" and (root / "global_step_4").is_dir()

    def killed_in_step_3(self, step):  # as a SIGKILL after step 3's metrics line, before any save
        if step == 3:
            raise KeyboardInterrupt
        return real_after_step(self, step)

    real_after_step = Checkpointer.after_step
    monkeypatch.setattr(Checkpointer, "after_step", killed_in_step_3)
    with pytest.raises(KeyboardInterrupt):
        run_job([*branch, "trainer.overwrite=true"], str(out))
    monkeypatch.setattr(Checkpointer, "after_step", real_after_step)
    assert sorted(os.listdir(root)) == ["global_step_2", "latest"]
    assert (root / "latest").read_text() == "global_step_2\n"
    assert [row["step"] for row in read_metrics(str(out))] == [1, 2, 3]
    assert find_checkpoint("auto", str(out)) == two
    resumed = run_job([*run1, "trainer.resume=auto", "optim.lr=1e-2"], str(out))
    assert resumed.step == 4
    rows = read_metrics(str(out))
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert (root / "latest").read_text() == "global_step_4\n"
