"""User errors end `python -m engine.train` with one message and a status (2: configuration, 1: data, reward
function, checkpoint), never a traceback; under torchrun the message is printed once (world sizes 1 and 2)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run_train(args: list[str], cwd: str, env: dict | None = None, launcher: list[str] | None = None):
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", **(env or {})}
    env.pop("HYDRA_FULL_ERROR", None)
    command = [*(launcher or [sys.executable]), "-m", "engine.train", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def assert_one_message(out, status: int, needle: str) -> None:
    text = out.stdout + out.stderr
    assert out.returncode == status, text
    assert "Traceback" not in text and "Error executing job" not in text, text
    assert text.count(needle) == 1, text
    assert text.count("error: ") == 1, text


CASES = [
    # (overrides, status, text of the one message)
    (["parallel.tp=3"], 2, "parallel.tp * parallel.pp = 3 * 1 = 3 must divide the world size 1"),
    (["+trainer.totl_steps=3"], 2, "Fix: did you mean trainer.total_steps=3?"),
    (["trainer.totl_steps=3"], 2, "Fix: did you mean trainer.total_steps=3?"),
    (
        ["trainer.total_steps=abc"],
        2,
        "trainer.total_steps=abc: Value 'abc' of type 'str' could not be converted",
    ),
    (
        ["algorithm=nope"],
        2,
        "algorithm=nope: no such preset in conf/algorithm/. Fix: use one of algorithm=dapo",
    ),
    (["trainer.total_steps"], 2, "Fix: write each override as key=value"),
]
MISSING = [
    # (overrides, package): a missing optional dependency is found during validation
    (["trainer.loggers=[console,tensorboard]"], "tensorboard"),
    (["trainer.loggers=[wandb]"], "wandb"),
]


@pytest.mark.parametrize("overrides,status,needle", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_config_error_is_one_message_with_status_2(tmp_path, overrides, status, needle):
    assert_one_message(run_train(overrides, str(tmp_path)), status, needle)


@pytest.mark.parametrize("overrides,package", MISSING, ids=[p for _, p in MISSING])
def test_missing_optional_package_is_a_config_error_with_the_install_command(tmp_path, overrides, package):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    out = run_train(overrides, str(tmp_path))
    assert_one_message(out, 2, f"needs the Python package {package!r}, which is not installed")
    assert f"pip install -e '.[{package}]'" in out.stderr


def test_data_error_is_one_message_with_status_1_and_tilde_expands(tmp_path):
    """verl's syntax `data.train_files=~/...` (one path, `~` unquoted): the path is the home's; the missing
    file is a data error (status 1) naming the expanded path."""
    from engine.tasks.embedded import build_embedded_tokenizer

    tok = build_embedded_tokenizer(str(tmp_path / "tok"))
    home = tmp_path / "home"
    home.mkdir()
    out = run_train(
        [
            "data.train_files=~/gsm8k/train.parquet",
            f"model.tokenizer_path={tok}",
            "trainer.progress_bar=false",
        ],
        str(tmp_path),
        env={"HOME": str(home)},
    )
    assert_one_message(out, 1, f"data.train_files[0]={home}/gsm8k/train.parquet: file not found")


def test_torchrun_prints_the_config_error_once(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--monitor_interval=0.1"]
    out = run_train(["parallel.tp=3"], str(tmp_path), launcher=launcher)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert f"{REPO}/engine" not in text, text  # no traceback of ours (torchrun's own summary follows)
    assert text.count("must divide the world size 2") == 1, text
