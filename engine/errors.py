"""User errors: bad input (config, data, checkpoints, reward functions) as opposed to bugs in the engine.

A `UserError`'s message names the key/file/row/field and a fix; `engine.train` prints it once, without a
traceback, and exits with `exit_status` (2: configuration, 1: everything else). Hydra's own composition
errors (unknown key, wrong type, unknown preset, unparsable override) are reported the same way, with status 2.
Any other exception is a bug and keeps its traceback; `HYDRA_FULL_ERROR=1` keeps it for user errors too.

Under torchrun every rank runs the same validation, so an error that every rank meets is printed by rank 0
while the others wait briefly and exit with the same status (torchrun stops them when rank 0 exits; a
rank that is still alive after the grace period prints it itself, so the message is never lost). An error
met by one rank only (`rank_local`, e.g. a reward function that raised on that rank's responses) is printed
at once by that rank.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable

from parallel.launch import read_launch_env

CONFIG_STATUS = 2
OTHER_RANKS_GRACE_S = 10.0
_FULL_ERROR_BY_USER = "ENGINE_USER_SET_HYDRA_FULL_ERROR"


class UserError(Exception):
    """Bad input; the message names what is wrong and the fix."""

    exit_status = 1
    rank_local = False


class DataError(UserError, ValueError):
    """A data file, row or field (or the tokenizer) that cannot be used."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """A data file that does not exist."""


class RewardFnError(UserError, ValueError):
    """A reward function that cannot be loaded or returned something unusable."""


class RewardFnCallError(RewardFnError):
    """A reward function that raised or returned a bad value on this rank's responses."""

    rank_local = True


def report_user_errors(entry: Callable[[], None], rank: int, world_size: int) -> None:
    """Run `entry` (the Hydra main); a user error it raises (Hydra's composition errors included) becomes
    one message on stderr and `sys.exit(status)`. Wrap the task function in `exit_on_user_error` too, so that
    Hydra does not print its own line for errors raised inside it."""
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ[_FULL_ERROR_BY_USER] = "1" if full_error else "0"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra then re-raises instead of printing its own report
    try:
        entry()
    except Exception as exc:
        described = describe_user_error(exc)
        if described is None or full_error:
            raise
        _exit(*described, rank, world_size)


def exit_on_user_error(task: Callable[..., None]) -> Callable[..., None]:
    """Decorate a Hydra task function: a user error raised in it is printed once and ends the process."""

    @functools.wraps(task)
    def run(*args, **kwargs) -> None:
        try:
            task(*args, **kwargs)
        except UserError as exc:
            if os.environ.get(_FULL_ERROR_BY_USER) == "1":
                raise
            launch = read_launch_env()
            _exit(str(exc), exc.exit_status, exc.rank_local, launch.rank, launch.world_size)

    return run


def _exit(message: str, status: int, rank_local: bool, rank: int, world_size: int) -> None:
    if rank != 0 and world_size > 1 and not rank_local:
        time.sleep(OTHER_RANKS_GRACE_S)  # rank 0 prints it; torchrun stops this rank when rank 0 exits
    prefix = f"[rank {rank}] " if world_size > 1 and rank != 0 else ""
    print(f"error: {prefix}{message}", file=sys.stderr, flush=True)
    sys.exit(status)


def describe_user_error(exc: BaseException) -> tuple[str, int, bool] | None:
    """(message, exit status, rank_local) for a user error, None for a bug."""
    if isinstance(exc, UserError):
        return str(exc), exc.exit_status, exc.rank_local
    from hydra.errors import HydraException

    if isinstance(exc, HydraException):
        return _hydra_message(exc), CONFIG_STATUS, False
    return None


def _hydra_message(exc: BaseException) -> str:
    """Hydra's composition errors as key, value, rule and fix."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    from engine.config import unknown_key_message

    cause = exc.__cause__
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file and exc.options:
        group, _, name = exc.missing_cfg_file.rpartition("/")
        return (
            f"{group}={name}: no such preset in conf/{group}/. Fix: use one of "
            f"{', '.join(f'{group}={option}' for option in exc.options)}"
        )
    if isinstance(exc, OverrideParseException):
        text = str(exc).split("\nSee https://")[0]
        return (
            f"{text}\nFix: write each override as key=value; quote values with special characters, e.g. "
            "'data.train_files=\"/path with spaces/train.parquet\"'"
        )
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        key, value = cause.full_key, _override_value(str(exc), cause.full_key)
        if isinstance(cause, (ConfigKeyError, AttributeError)):
            import yaml

            return unknown_key_message(key, yaml.safe_load(value))
        return _wrong_type_message(key, value, cause)
    return "\n".join(part for part in (str(exc), str(cause) if cause else "") if part)


def _override_value(text: str, key: str) -> str:
    """The value of `key=value` in Hydra's message (it quotes the override), else '?'."""
    start = text.find(f"{key}=")
    if start < 0:
        return "?"
    return text[start + len(key) + 1 :].split("\n")[0].split(" ")[0].rstrip("'.")


def _wrong_type_message(key: str, value: str, cause: BaseException) -> str:
    from omegaconf import OmegaConf

    from engine.config import TrainConfig

    default = OmegaConf.select(OmegaConf.structured(TrainConfig), key, default=None)
    rule = str(getattr(cause, "msg", cause)).split("\n")[0]
    fix = f"give {key} a value of its type, e.g. its default {key}={default}" if default is not None else ""
    return f"{key}={value}: {rule}. Fix: {fix or 'see engine/config.py for the type of ' + key}"
