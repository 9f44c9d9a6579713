"""Report user errors raised while Hydra composes and runs the job: a `UserError`, or one of Hydra's own
composition errors (unknown key, wrong type, unknown preset, unparsable override) turned into the same
key, value, rule and fix message with status 2 (engine/errors.py prints and exits)."""

from __future__ import annotations

import os
from collections.abc import Callable

from engine.config import TrainConfig
from engine.config_load import unknown_key_message
from engine.errors import CONFIG_STATUS, FULL_ERROR_BY_USER, UserError, exit_with_message


def report_user_errors(entry: Callable[[], None], rank: int, world_size: int) -> None:
    """Run `entry` (the Hydra main); a user error it raises (Hydra's composition errors included) becomes
    one message on stderr and `sys.exit(status)`. Wrap the task function in `exit_on_user_error` too, so that
    Hydra does not print its own line for errors raised inside it."""
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ[FULL_ERROR_BY_USER] = "1" if full_error else "0"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra then re-raises instead of printing its own report
    try:
        entry()
    except Exception as exc:
        described = describe_user_error(exc)
        if described is None or full_error:
            raise
        exit_with_message(*described, rank, world_size)


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

    default = OmegaConf.select(OmegaConf.structured(TrainConfig), key, default=None)
    rule = str(getattr(cause, "msg", cause)).split("\n")[0]
    fix = f"give {key} a value of its type, e.g. its default {key}={default}" if default is not None else ""
    return f"{key}={value}: {rule}. Fix: {fix or 'see engine/config.py for the type of ' + key}"
