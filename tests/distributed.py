"""Run a script under torchrun on CPU (gloo) from a test; one launch costs ~10 s, so group checks."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _with_root(env: dict[str, str]) -> dict[str, str]:
    """`env` with the checkout first on PYTHONPATH: a child process (torchrun's ranks run scripts from
    tests/) imports this checkout's packages whether or not it is pip-installed (measured on the GPU
    machine: `pip install -e .` there left torchrun's ranks without `engine`)."""
    path = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": ROOT + (os.pathsep + path if path else "")}


def run_torchrun(script: str, nproc: int, args: list[str] | None = None, timeout: float = 600) -> str:
    """Launch `script` (a path, or "-m" with the module first in `args`) on `nproc` local CPU ranks;
    fail the test with the ranks' output if any rank fails."""
    env = _with_root(dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore"))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "--tee=3",
        script,
        *(args or []),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {script} x{nproc} failed (rc={proc.returncode}):\n{out[-8000:]}")
    return out


_LAUNCH_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
)


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment without the launch variables an in-process test may have exported (a
    world of one exports MASTER_PORT; a child reusing it finds the port taken), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    return _with_root({**env, "OMP_NUM_THREADS": "1", **extra})
