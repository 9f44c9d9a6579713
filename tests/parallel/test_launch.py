"""parallel/launch.py and scripts/slurm/train.sbatch.

- Environment parsing, node lists, tasks per node, failure notes: no processes.
- A rank that dies or hangs (world size 2): under torchrun, and as two plain processes without a launcher's
  help, where only cluster.timeout_s stands between the survivor and a hang.
- A two-node rehearsal on one machine (world size 2, one rank per "node", so the TP=2 group spans the nodes):
  train.sbatch under a stand-in `srun` (tests/parallel/launch_fake_slurm.sh), once with one torchrun per node
  (c10d rendezvous) and once with one task per rank (SLURM variables only), against a single-node torchrun.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from distributed import run_torchrun

from parallel.launch import (
    LaunchEnv,
    LaunchError,
    cuda_device_index,
    explain_rank_failures,
    export_launch_env,
    failure_note,
    free_port,
    parse_nodelist,
    parse_tasks_per_node,
    read_launch_env,
)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEAD_RANK = os.path.join(HERE, "launch_dead_rank.py")
FAKE_SLURM = os.path.join(HERE, "launch_fake_slurm.sh")
SBATCH = os.path.join(REPO, "scripts", "slurm", "train.sbatch")
TIMEOUT_S = 3.0
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# --- parsing (no processes) ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("gpu01", ["gpu01"]),
        ("gpu[01-03,07],login5", ["gpu01", "gpu02", "gpu03", "gpu07", "login5"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("a[1,3],b[2-3].ib", ["a1", "a3", "b2.ib", "b3.ib"]),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
    ],
)
def test_parse_nodelist(nodelist, hosts):
    assert parse_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "bad", ["", "gpu[01-03", "gpu01-03]", "gpu[03-01]", "gpu[a-b]", "gpu[]", "a,,b", "n[1-[2]]"]
)
def test_parse_nodelist_rejects(bad):
    with pytest.raises(ValueError):
        parse_nodelist(bad)


@pytest.mark.parametrize(
    "spec, counts",
    [("8", [8]), ("4(x2),3", [4, 4, 3]), ("2(x1)", [2]), ("1,2,3", [1, 2, 3]), (" 4(x3) ", [4] * 3)],
)
def test_parse_tasks_per_node(spec, counts):
    assert parse_tasks_per_node(spec) == counts


@pytest.mark.parametrize("bad", ["", "x", "4(2)", "4(x)", "0", "4(x0)", "4,,2", "-1"])
def test_parse_tasks_per_node_rejects(bad):
    with pytest.raises(ValueError):
        parse_tasks_per_node(bad)


TORCHRUN = dict(
    RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="node0", MASTER_PORT="29500"
)
SLURM = dict(
    SLURM_STEP_ID="0",
    SLURM_JOB_ID="123456",
    SLURM_PROCID="9",
    SLURM_NTASKS="11",
    SLURM_LOCALID="1",
    SLURM_NODEID="2",
    SLURM_JOB_NODELIST="gpu[01-02,07]",
    SLURM_TASKS_PER_NODE="4(x2),3",
)


def test_single_process():
    assert read_launch_env({}) == LaunchEnv(0, 1, 0, 1, "127.0.0.1", 0, "single")
    # python run straight from a batch script (no srun step): one process, whatever SLURM_NTASKS says
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert read_launch_env(batch).source == "single"
    # a world of one needs no rendezvous address
    assert read_launch_env(dict(RANK="0", WORLD_SIZE="1")) == LaunchEnv(
        0, 1, 0, 1, "127.0.0.1", 0, "torchrun"
    )


def test_torchrun_env_wins_over_slurm():
    expected = LaunchEnv(3, 4, 1, 2, "node0", 29500, "torchrun")
    assert read_launch_env(TORCHRUN) == expected
    assert read_launch_env({**SLURM, **TORCHRUN}) == expected  # one torchrun per node inside srun


def test_slurm_env():
    # node 2 (gpu07) runs 3 tasks; the rendezvous is the first node on a port derived from the job id
    assert read_launch_env(SLURM) == LaunchEnv(9, 11, 1, 3, "gpu01", 23456, "slurm")
    overridden = read_launch_env({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})
    assert (overridden.master_addr, overridden.master_port) == ("head", 1234)
    # --ntasks-per-node=4 is one number for every node; the step's own list wins over the job's
    step = dict(
        SLURM, SLURM_NTASKS="8", SLURM_NTASKS_PER_NODE="4", SLURM_STEP_NODELIST="a[1-2]", SLURM_PROCID="5"
    )
    assert read_launch_env(dict(step, SLURM_NODEID="1")) == LaunchEnv(5, 8, 1, 4, "a1", 23456, "slurm")


def test_world_size_from_env(monkeypatch):
    from parallel.state import world_size_from_env

    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    assert world_size_from_env() == 11


BAD_ENV = [
    # (environment, text the message must contain)
    ({**TORCHRUN, "RANK": "4"}, "RANK=4 must be < WORLD_SIZE=4"),
    ({"RANK": "0"}, "WORLD_SIZE"),
    ({"WORLD_SIZE": "2"}, "RANK"),
    ({**TORCHRUN, "RANK": "x"}, "RANK='x' is not an integer"),
    ({**TORCHRUN, "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ({**TORCHRUN, "LOCAL_RANK": "2"}, "LOCAL_RANK=2 must be < LOCAL_WORLD_SIZE=2"),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE=8 exceeds WORLD_SIZE=4"),
    ({k: v for k, v in TORCHRUN.items() if k != "LOCAL_RANK"}, "LOCAL_RANK is not set"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, "MASTER_ADDR is not set but WORLD_SIZE=4"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, "MASTER_PORT is not set"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
    ({**SLURM, "SLURM_PROCID": "11"}, "SLURM_PROCID=11 must be < SLURM_NTASKS=11"),
    ({**SLURM, "SLURM_LOCALID": "3"}, "SLURM_LOCALID=3 must be < 3"),
    ({**SLURM, "SLURM_NODEID": "3"}, "SLURM_NODEID=3"),
    ({**SLURM, "SLURM_JOB_NODELIST": "gpu[01-02,07"}, "SLURM_JOB_NODELIST='gpu[01-02,07'"),
    ({**SLURM, "SLURM_JOB_NODELIST": "gpu[01-02]"}, "describes 3 nodes but the node list has 2"),
    ({**SLURM, "SLURM_TASKS_PER_NODE": "4(x3)"}, "adds up to 12 tasks but SLURM_NTASKS=11"),
    ({**SLURM, "SLURM_TASKS_PER_NODE": "4(2)"}, "SLURM_TASKS_PER_NODE='4(2)'"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_TASKS_PER_NODE"}, "SLURM_NTASKS_PER_NODE"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, "SLURM_JOB_NODELIST is not set"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_NODEID"}, "SLURM_NODEID is not set"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}, "MASTER_PORT is not set"),
]


@pytest.mark.parametrize("env, text", BAD_ENV)
def test_inconsistent_env_names_variable_and_fix(env, text):
    with pytest.raises(LaunchError) as err:
        read_launch_env(env)
    assert text in str(err.value)
    assert "Fix:" in str(err.value)


def test_export_launch_env_picks_a_port_for_one_process():
    environ: dict[str, str] = {}
    written = export_launch_env(read_launch_env({}), environ)
    assert written.master_port > 0 and environ["MASTER_PORT"] == str(written.master_port)
    assert read_launch_env(environ) == LaunchEnv(0, 1, 0, 1, "127.0.0.1", written.master_port, "torchrun")


def test_cuda_device_index():
    assert cuda_device_index(3, 8) == 3
    assert cuda_device_index(3, 1) == 0  # srun --gpus-per-task=1: each task sees its own GPU as cuda:0
    with pytest.raises(LaunchError, match="LOCAL_RANK=8 but this node shows 8 CUDA devices"):
        cuda_device_index(8, 8)


GLOO_RESET = "[pair.cc:537] Read error [127.0.0.1]:19154: Connection reset by peer. This is typically caused"
GLOO_TIMEOUT = "[unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete"


def test_failure_note(capsys):
    assert "another rank closed its connection" in failure_note(GLOO_RESET, 0, 2, 3.0)
    assert "cluster.timeout_s=3s" in failure_note(GLOO_TIMEOUT, 1, 4, 3.0)
    assert failure_note("shape mismatch (4, 8) vs (8, 4)", 0, 2, 3.0) is None
    with pytest.raises(RuntimeError, match="Connection reset"), explain_rank_failures(1, 2, 600):
        raise RuntimeError(GLOO_RESET)
    assert capsys.readouterr().err.startswith("rank 1 of 2: another rank closed its connection")
    with pytest.raises(RuntimeError), explain_rank_failures(0, 1, 600):
        raise RuntimeError(GLOO_RESET)  # a world of one has no other rank to blame
    assert capsys.readouterr().err == ""


def test_failure_note_names_the_side_of_a_split_run(capsys):
    """placement.mode=split: the note says whether the failing rank trains or generates."""
    with pytest.raises(RuntimeError), explain_rank_failures(2, 3, 600, "rollout"):
        raise RuntimeError(GLOO_RESET)
    assert capsys.readouterr().err.startswith("rollout rank 2 of 3: another rank closed its connection")
    assert failure_note(GLOO_TIMEOUT, 0, 3, 3.0, "training").startswith("training rank 0 of 3: a collective")


def test_cluster_slurm_preset_and_timeout_check():
    from hydra import compose, initialize_config_dir

    from engine.config import ConfigError, register_configs
    from engine.config_load import to_dataclass
    from engine.validate import validate

    register_configs()
    with initialize_config_dir(config_dir=os.path.join(REPO, "conf"), version_base="1.3"):
        slurm = to_dataclass(compose(config_name="train", overrides=["cluster=slurm"])).cluster
        no_timeout = to_dataclass(compose(config_name="train", overrides=["cluster.timeout_s=0"]))
    assert (slurm.name, slurm.device, slurm.timeout_s) == ("slurm", "cuda", 3600)
    with pytest.raises(ConfigError, match="cluster.timeout_s"):
        validate(no_timeout, world_size=1)


# --- a rank that dies or hangs (world size 2) ---------------------------------------------------------


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables (the tests may run inside torchrun or SLURM)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", **extra)


def _failed(out: str) -> dict[str, float]:
    return {name: float(s) for name, s in re.findall(r"FAILED (\w+) ([\d.]+)", out)}


def test_dead_or_hung_rank_without_launcher():
    """Two plain processes per case, no torchrun to tear them down: rank 0 must fail on its own.

    `die` pair: SLURM srun-per-task variables (rank 1 exits). `hang` pair: torchrun-style variables set by
    hand (rank 1 never joins), so each collective of rank 0 must give up after cluster.timeout_s, on
    megatron's DP group and on the default group alike.
    """
    die_port, hang_port = free_port(), free_port()
    while hang_port == die_port:
        hang_port = free_port()
    envs = {
        ("die", r): _clean_env(
            SLURM_STEP_ID="0",
            SLURM_JOB_ID="1",
            SLURM_PROCID=str(r),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(r),
            SLURM_NODEID="0",
            SLURM_JOB_NODELIST="localhost",
            SLURM_TASKS_PER_NODE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(die_port),
        )
        for r in (0, 1)
    }
    for r in (0, 1):
        envs["hang", r] = _clean_env(
            RANK=str(r),
            WORLD_SIZE="2",
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(hang_port),
        )
    procs = {
        key: subprocess.Popen(
            [sys.executable, DEAD_RANK, key[0], str(TIMEOUT_S)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for key, env in envs.items()
    }
    try:
        outs = {
            key: procs[key].communicate(timeout=60 + 3 * TIMEOUT_S)[0] for key in [("die", 0), ("hang", 0)]
        }
    finally:
        for proc in procs.values():  # the hung rank 1 sleeps until killed
            proc.kill()
            proc.wait()
    die, hang = outs["die", 0], outs["hang", 0]
    assert procs["die", 0].returncode != 0 and procs["hang", 0].returncode != 0, die + hang
    # a dead peer closes its sockets: rank 0 fails at once, well before the timeout
    assert set(_failed(die)) == {"dp", "world"} and max(_failed(die).values()) < TIMEOUT_S, die
    assert "rank 0 of 2: another rank closed its connection" in die
    # a hung peer: each collective fails after the timeout (megatron used to round it up to whole minutes)
    for group, seconds in _failed(hang).items():
        assert TIMEOUT_S - 0.2 <= seconds <= TIMEOUT_S + 2.0, (group, seconds, hang)
    assert set(_failed(hang)) == {"dp", "world"}, hang
    assert f"rank 0 of 2: a collective waited longer than cluster.timeout_s={TIMEOUT_S:g}s" in hang
    assert "Rank(s) [1] did not arrive" in hang and "Killed" not in hang  # no launcher: nobody is killed


def _torchrun_two_ranks(mode: str) -> tuple[subprocess.CompletedProcess, str, float]:
    """launch_dead_rank.py in `mode` on 2 ranks under torchrun: (process, its output, when it ended)."""
    # torchrun polls its workers every 0.1 s by default, so the survivor's note races the SIGTERM on a loaded
    # machine (CI's 2 cores lost it once, 60 ms after the death). At 1 s the survivor, whose collective fails
    # within milliseconds, always gets its note out; the timing bounds below hold either way.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--tee=3"]
    cmd.append("--monitor-interval=1")
    proc = subprocess.run(
        [*cmd, DEAD_RANK, mode, str(TIMEOUT_S)], env=_clean_env(), capture_output=True, text=True, timeout=120
    )
    return proc, proc.stdout + proc.stderr, time.time()


def test_dead_rank_under_torchrun():
    """World size 2 under torchrun: rank 1 exits with os._exit(1); torchrun must stop the job quickly."""
    proc, out, ended = _torchrun_two_ranks("die")
    died = float(re.search(r"DYING ([\d.]+)", out).group(1))
    assert proc.returncode != 0, out
    assert ended - died < TIMEOUT_S + 2.0, (
        f"torchrun took {ended - died:.1f} s after the death\n{out[-4000:]}"
    )
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*exitcode\s*:\s*1", out), out[-4000:]
    # the survivor explains itself before torchrun stops it (its collective fails within milliseconds)
    assert "rank 0 of 2: another rank closed its connection" in out, out[-4000:]


def test_stopped_rank_under_torchrun_is_named_and_the_job_ends():
    """World size 2 under torchrun: rank 1 stops itself (SIGSTOP), so it never answers torchrun's SIGTERM.
    Rank 0's collectives time out; it names rank 1, kills it (same host, same agent) and exits, so the job
    ends without torchrun's 30 s wait before SIGKILL."""
    from parallel.arrival import REPORT_GRACE_S

    proc, out, ended = _torchrun_two_ranks("stop")
    stopped = float(re.search(r"STOPPING ([\d.]+)", out).group(1))
    assert proc.returncode != 0, out
    # two collectives time out one after the other, then the reports are awaited
    assert ended - stopped < 2 * TIMEOUT_S + REPORT_GRACE_S + 5.0, f"{ended - stopped:.1f} s\n{out[-4000:]}"
    assert "Rank(s) [1] did not arrive" in out and "Killed rank(s) [1] on this host" in out, out[-4000:]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*exitcode\s*:\s*-9", out), out[-4000:]


# --- two "nodes" on one machine ------------------------------------------------------------------------

RUN = [
    "parallel.tp=2",
    "trainer.total_steps=2",
    "data.batch_size=8",
    "rollout.n=4",
    "trainer.micro_batch_size=4",
    "trainer.progress_bar=false",
]
COMPARED = ("reward/mean", "actor/grad_norm", "actor/pg_loss", "actor/entropy")


def _metrics(output_dir) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _sbatch(tmp_path, launch: str, output_dir) -> str:
    """train.sbatch as SLURM would run it on 2 nodes of 1 "GPU" each (here: CPU ranks on this machine)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("srun", "scontrol"):
        if not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(FAKE_SLURM)
    env = _clean_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        PYTHON=sys.executable,
        LAUNCH=launch,
        GPUS_PER_NODE="1",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="127.0.0.1,localhost",
        MASTER_PORT=str(free_port()),
    )
    args = ["cluster=cpu", *RUN, f"trainer.output_dir={output_dir}"]
    proc = subprocess.run(
        ["bash", SBATCH, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"train.sbatch LAUNCH={launch} failed:\n{out[-6000:]}"
    return out


def test_two_node_rehearsal_matches_one_node(tmp_path):
    """World size 2, parallel.tp=2 across two "nodes": the same metrics as one node, step by step."""
    reference = tmp_path / "one_node"
    run_torchrun("-m", 2, ["engine.train", f"trainer.output_dir={reference}", *RUN])
    expected = _metrics(reference)
    assert [row["step"] for row in expected] == [1, 2]
    for launch in ("torchrun", "tasks"):
        out = _sbatch(tmp_path, launch, tmp_path / launch)
        assert f"2 node(s) x 1 GPU(s), {launch}" in out
        rows = _metrics(tmp_path / launch)
        assert [row["step"] for row in rows] == [1, 2]
        for got, want in zip(rows, expected):
            for key in COMPARED:
                assert got[key] == pytest.approx(want[key], abs=1e-6), (launch, got["step"], key)
