"""The Triton kernels (rollout and update) on the CPU: tests/engine/interpreted_triton.py and
interpreted_training_kernels.py run under Triton's interpreter in a subprocess (TRITON_INTERPRET=1 must be
set before the kernels are defined, and this process has defined them already), so CI, which has no GPU, checks the kernels the GPU decodes and trains with against
independent references.

Needs the `triton` package (the [test] extra installs it on Linux x86_64; a CUDA build of torch brings its own).
Triton releases before 3.9 cannot interpret with numpy >= 2.4 (their interpreter turns one-element arrays into
Python scalars, which numpy 2.4 refuses): skipped there, with the reason. Under CI (CI=true) a missing Triton
fails instead of skipping, so a broken install cannot hide the kernels' tests."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import numpy
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _why_not() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install -e .[test] installs it on Linux x86_64)"
    triton_version = importlib.metadata.version("triton")
    if _version(triton_version) < (3, 9) and _version(numpy.__version__) >= (2, 4):
        return f"triton {triton_version}'s interpreter fails with numpy {numpy.__version__} (needs triton >= 3.9)"
    return None


def test_triton_kernels_under_the_interpreter():
    reason = _why_not()
    if reason is not None:
        if os.environ.get("CI") == "true" and "not installed" in reason:
            pytest.fail(f"CI: {reason}")
        pytest.skip(reason)
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))),
    }
    cmd = [
        sys.executable,
        "-W",
        "ignore",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "interpreted_triton.py",
        "interpreted_training_kernels.py",
    ]
    run = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout, run.stdout[-3000:]
