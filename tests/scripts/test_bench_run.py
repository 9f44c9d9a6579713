"""scripts/bench/run.sh without a GPU: its help, and its dry run checked against the benchmark scripts (every
job's script exists and takes every option the suite passes), the lanes, the errors and the .whl/ installs."""

import os
import re
import shlex
import shutil
import subprocess

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RUN = os.path.join(ROOT, "scripts", "bench", "run.sh")
PURPOSES = (
    "e2e",
    "rollout",
    "reshard",
    "update",
    "logprobs",
    "decode_attention",
    "attention_widths",
    "sampler",
    "decode_phases",
    "decode_gemms",
    "decode_mlp",
    "decode_overlap",
    "baselines",
    "verl",
    "compare",
    "vllm",
    "vllm_cost",
    "gpu_tests",
    "two_nodes",
)
JOB = re.compile(r"^job (\S+) \[lane (\d+), GPUs ([\d,]+)\]: timeout (\d+) (.*)> (\S+)$")


def run(*args: str, root: str = ROOT) -> subprocess.CompletedProcess:
    script = os.path.join(root, "scripts", "bench", "run.sh")
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "CUDA_VISIBLE_DEVICES")}
    return subprocess.run(["bash", script, *args], capture_output=True, text=True, env=env, timeout=30)


def jobs(*args: str) -> list[dict]:
    proc = run("--dry-run", "--no-install", "--out", "/o", *args)  # a checkout's own .whl/ must not matter
    assert proc.returncode == 0, proc.stderr
    found = []
    for line in proc.stdout.splitlines():
        m = JOB.match(line)
        assert m, line
        name, lane, gpus, secs, cmd, out = m.groups()
        found.append(dict(name=name, lane=int(lane), gpus=gpus, cmd=shlex.split(cmd), out=out))
    return found


def script_options(path: str) -> set[str]:
    """The --options a bench script declares, with workload.py's shared step options where it adds them."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    options = set(re.findall(r'add_argument\(\s*"(--[\w-]+)"', text))
    if "add_step_args(" in text and not path.endswith("workload.py"):
        options |= script_options("scripts/bench/workload.py")
    return options


def check_command(cmd: list[str]) -> None:
    """The job's script exists and declares every --option the job passes it."""
    if cmd[0] == "env":
        cmd = [c for c in cmd[1:] if "=" not in c]
    if cmd[0] == "torchrun":
        cmd = cmd[next(i for i, c in enumerate(cmd) if i and not c.startswith("--")) :]
    if cmd[0] in ("python3", "python"):
        cmd = cmd[1:]
    if cmd[0] == "-m":
        assert cmd[1] in ("pytest", "engine.train"), cmd
        for path in (c for c in cmd if c.endswith(".py")):
            assert os.path.isfile(os.path.join(ROOT, path)), path
        return
    if cmd[0] == "bash":
        assert os.path.isfile(os.path.join(ROOT, cmd[1])), cmd
        return
    assert cmd[0].startswith("scripts/bench/") and cmd[0].endswith(".py"), cmd
    known = script_options(cmd[0])
    passed = {c.split("=")[0] for c in cmd[1:] if c.startswith("--")}
    assert passed <= known, f"{cmd[0]} does not take {sorted(passed - known)}"


def test_help_lists_every_purpose():
    proc = run("--help")
    assert proc.returncode == 0, proc.stderr
    for purpose in PURPOSES:
        assert re.search(rf"^  {purpose} ", proc.stdout, re.M), purpose


def test_dry_run_of_every_purpose_matches_the_scripts():
    for purpose in PURPOSES:
        found = jobs(purpose, "--devices", "0,1,2,3", "--profile")
        assert found, purpose
        for job in found:
            check_command(job["cmd"])
            assert job["out"].startswith(f"/o/{job['name']}."), job


def test_lanes_presets_backends_tag_and_args():
    found = jobs(
        "e2e", "--devices", "0,1", "--backends", "native,vllm", "--tag", "x", "--", "--max-tokens", "4096"
    )
    assert [(j["name"], j["lane"], j["gpus"]) for j in found] == [
        ("e2e_0_5b_x", 0, "0"),
        ("e2e_0_5b_vllm_x", 1, "1"),
        ("e2e_1_5b_x", 0, "0"),
        ("e2e_1_5b_vllm_x", 1, "1"),
    ]
    assert found[1]["cmd"][-4:] == ["--backend", "vllm", "--max-tokens", "4096"]
    (job,) = jobs("e2e", "--presets", "qwen2_5_7b", "--gpus", "2", "--devices", "0,1")
    assert job["gpus"] == "0,1" and job["cmd"][job["cmd"].index("--gpus") + 1] == "2"
    (job,) = jobs("reshard", "--presets", "none", "--devices", "0,1,2,3", "--", "--layers", "4")
    assert "--preset" not in job["cmd"] and job["cmd"][-2:] == ["--layers", "4"]


def test_compare_runs_ours_and_both_trl_modes_on_one_workload():
    found = jobs("compare", "--presets", "qwen2_5_0_5b", "--devices", "0,1,2,3", "--lengths", "long_tail")
    assert [(j["name"], j["lane"]) for j in found] == [
        ("e2e_0_5b_long_tail", 0),
        ("e2e_0_5b_vllm_long_tail", 1),
        ("trl_0_5b_long_tail", 2),
        ("trl_0_5b_vllm_long_tail", 3),
    ]
    for job in found:
        cmd = job["cmd"]
        assert cmd[cmd.index("--lengths") + 1] == "long_tail", cmd
    assert "--vllm" in found[3]["cmd"] and "--vllm" not in found[2]["cmd"]
    assert found[1]["cmd"][found[1]["cmd"].index("--backend") + 1] == "vllm"


def test_errors_name_the_bad_value():
    for args, said in (
        (("nope",), "unknown purpose 'nope'"),
        (("e2e", "--presets", "qwen9"), "unknown preset 'qwen9'"),
        (("reshard", "--devices", "0,1"), "takes 4 GPUs (--gpus) but --devices has 2"),
        (("two_nodes", "--devices", "0"), "needs 2 GPUs"),
        (("e2e", "--gpus", "two"), "--gpus must be a positive integer"),
        (("e2e", "--bogus"), "unknown option '--bogus'"),
        (("update", "--lengths", "long_tail"), "update takes no --lengths"),
        (("e2e", "--lengths", "lognormal"), "--lengths must be fixed or long_tail, got 'lognormal'"),
    ):
        proc = run("--dry-run", *args)
        assert proc.returncode == 2 and said in proc.stderr, (args, proc.stderr)


def test_installs_what_whl_carries(tmp_path):
    """The device machine's recipe: vLLM parts first, then the base wheels, then TRL, then verl's parts (stashed
    until the call that carries c3 installs them); nothing without .whl/."""
    shutil.copytree(os.path.join(ROOT, "scripts", "bench"), tmp_path / "scripts" / "bench")
    shutil.copytree(os.path.join(ROOT, "conf", "model"), tmp_path / "conf" / "model")
    root = str(tmp_path)
    assert "install" not in run("logprobs", "--dry-run", root=root).stdout
    for path in (
        ".whl/install-on-gpu.sh",
        ".whl/base/a.whl",
        ".whl/trl/b.whl",
        ".whl/vllm/c1/slim.whl.part00",
    ):
        os.makedirs(os.path.dirname(tmp_path / path), exist_ok=True)
        (tmp_path / path).write_text("")
    lines = run("logprobs", "--dry-run", root=root).stdout.splitlines()
    assert lines[:3] == [f"install: bash .whl/install-on-gpu.sh {kind}" for kind in ("vllm", "base", "trl")]
    assert not lines[3].startswith("install")
    os.makedirs(tmp_path / ".whl" / "verl" / "c1")
    (tmp_path / ".whl" / "verl" / "c1" / "ray.whl.part00").write_text("")
    assert run("logprobs", "--dry-run", root=root).stdout.splitlines()[3] == (
        "install: bash scripts/bench/install_verl_on_gpu.sh stash"
    )
    os.makedirs(tmp_path / ".whl" / "verl" / "c3")
    (tmp_path / ".whl" / "verl" / "c3" / "verl.whl").write_text("")
    assert run("logprobs", "--dry-run", root=root).stdout.splitlines()[3] == (
        "install: bash scripts/bench/install_verl_on_gpu.sh install"
    )
    assert "install" not in run("logprobs", "--dry-run", "--no-install", root=root).stdout


def readme_commands() -> list[list[str]]:
    """Every `run.sh` command of scripts/bench/README.md: code lines (with their continuations) and inline."""
    with open(os.path.join(ROOT, "scripts", "bench", "README.md")) as f:
        text = f.read()
    found = []
    for line in re.findall(r"^bash scripts/bench/run\.sh ((?:.*\\\n)*.*)$", text, re.M):
        found.append(line.replace("\\\n", " ").split(" #")[0].rstrip(" &"))
    found += re.findall(r"`(?:bash scripts/bench/)?run\.sh ([a-z][^`]*)`", text)
    return [shlex.split(c) for c in found]


def test_every_readme_command_runs_dry():
    commands = readme_commands()
    assert len(commands) > 20
    for cmd in commands:
        for job in jobs("--devices", "0,1,2,3,4,5,6,7", *cmd):
            check_command(job["cmd"])
