"""User errors: bad input (config, data, checkpoints, reward functions) as opposed to bugs in the engine.

A `UserError`'s message names the key/file/row/field and a fix; `engine.train` prints it once, without a
traceback, and exits with `exit_status` (2: configuration, 1: everything else). Hydra's own composition
errors are reported the same way by engine/hydra_errors.py.
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
FULL_ERROR_BY_USER = "ENGINE_USER_SET_HYDRA_FULL_ERROR"


class UserError(Exception):
    """Bad input; the message names what is wrong and the fix."""

    exit_status = 1
    rank_local = False


class DataError(UserError, ValueError):
    """A data file, row or field (or the tokenizer) that cannot be used."""


class DataFileNotFoundError(DataError, FileNotFoundError):
    """A data file that does not exist."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be written or resumed; the message names the path, the cause and a fix."""


class RewardFnError(UserError, ValueError):
    """A reward function that cannot be loaded or returned something unusable."""


class RewardFnCallError(RewardFnError):
    """A reward function that raised or returned a bad value on this rank's responses."""

    rank_local = True


def exit_on_user_error(task: Callable[..., None]) -> Callable[..., None]:
    """Decorate a Hydra task function: a user error raised in it is printed once and ends the process."""

    @functools.wraps(task)
    def run(*args, **kwargs) -> None:
        try:
            task(*args, **kwargs)
        except UserError as exc:
            if os.environ.get(FULL_ERROR_BY_USER) == "1":
                raise
            launch = read_launch_env()
            exit_with_message(str(exc), exc.exit_status, exc.rank_local, launch.rank, launch.world_size)

    return run


def exit_with_message(message: str, status: int, rank_local: bool, rank: int, world_size: int) -> None:
    """Print a user error once (rank 0 unless `rank_local`) and exit with `status`."""
    if rank != 0 and world_size > 1 and not rank_local:
        time.sleep(OTHER_RANKS_GRACE_S)  # rank 0 prints it; torchrun stops this rank when rank 0 exits
    prefix = f"[rank {rank}] " if world_size > 1 and rank != 0 else ""
    print(f"error: {prefix}{message}", file=sys.stderr, flush=True)
    sys.exit(status)
