"""The user's reward function in a child process, so that `reward.timeout_s` can stop a batch that never ends.

A Python thread cannot be stopped from outside, and an alarm signal reaches only the main thread and waits
for C code to return; a process can always be killed. One child per rank is started when the reward is
built (spawn: a fresh interpreter that imports the function by its `reward.fn` name, so user functions stay
plain functions in a file, and nothing of the trainer's threads or process groups is inherited), it
announces when the function is imported, then scores one batch per request. What crosses the pipe per batch
is the texts and the scores (pickled), so the cost per step is small next to rollout. The child keeps the
index of the response it is on in shared memory; when a batch overruns, the parent kills the child and
names the function and that response. The child dies with its parent (Linux parent-death signal), so a
killed rank leaves no user code running. The built-in rule rewards never come here.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Sequence

from engine.errors import RewardFnCallError, RewardFnError
from engine.rewards.reward_fn import RewardFn, load_user_fn, user_fn_name

STARTUP_TIMEOUT_S = 300.0
"""Longest wait for the child to import the reward function (not counted in reward.timeout_s)."""
_ERROR_TYPES = {"RewardFnError": RewardFnError, "RewardFnCallError": RewardFnCallError}
"""Errors the child reports by class name, raised again here (anything else: RewardFnCallError)."""


class ProcessRewardFn(RewardFn):
    """A RewardFn whose user function runs in a child process; a batch longer than `timeout_s` fails."""

    def __init__(self, fn_spec: str, timeout_s: float):
        super().__init__(fn=None, name=user_fn_name(fn_spec))
        self.fn_spec, self.timeout_s = fn_spec.strip(), timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._proc = None
        self._start()

    def _start(self) -> None:
        self._conn, child_conn = self._ctx.Pipe()
        self._progress = self._ctx.Value("i", -1, lock=False)  # index of the response being scored
        self._proc = self._ctx.Process(
            target=_serve,
            args=(self.fn_spec, child_conn, self._progress, os.getpid()),
            name="reward_fn",
            daemon=True,
        )
        self._proc.start()
        child_conn.close()
        self._ready = False

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._conn.poll(1.0):
            if not self._proc.is_alive() or time.monotonic() > deadline:
                code = self._proc.exitcode
                self.close()
                raise RewardFnCallError(
                    f"{self.name}: the reward process "
                    + (
                        f"exited (code {code})"
                        if code is not None
                        else f"did not start in {STARTUP_TIMEOUT_S:g} s"
                    )
                    + " before importing the function. Fix: check that the function imports cleanly "
                    "(python -m engine.reward_check), or set reward.timeout_s=0 to run it in the trainer process"
                )
        message = self._receive("while importing the function", -1, [])
        if message[0] == "raised":
            self.close()
            raise _ERROR_TYPES.get(message[1], RewardFnCallError)(message[2])
        self._ready = True

    def _score_lists(
        self,
        data_sources: Sequence[str],
        responses: Sequence[str],
        ground_truths: Sequence[str],
        extra_infos: Sequence[dict],
    ) -> tuple[list[float], list[dict[str, float]]]:
        if self._proc is None:
            self._start()
        if not self._ready:
            self._wait_ready()
        self._progress.value = -1
        self._conn.send((list(data_sources), list(responses), list(ground_truths), list(extra_infos)))
        if not self._conn.poll(self.timeout_s):
            index = self._progress.value
            self.close()
            raise RewardFnCallError(
                f"{self.name} did not finish a batch of {len(responses)} responses within reward.timeout_s="
                f"{self.timeout_s:g} s: it was on response {_where(index, data_sources)} when stopped. Fix: make "
                f"the function return sooner (look at that response), or raise reward.timeout_s (0 = no limit)"
            )
        message = self._receive("while scoring", self._progress.value, data_sources)
        if message[0] == "raised":
            raise _ERROR_TYPES.get(message[1], RewardFnCallError)(message[2])
        return message[1], message[2]

    def _receive(self, doing: str, index: int, data_sources: Sequence[str]) -> tuple:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            code = self._proc.exitcode
            self.close()
            where = f" on response {_where(index, data_sources)}" if index >= 0 else ""
            raise RewardFnCallError(
                f"{self.name}: the reward process exited (code {code}) {doing}{where}. Fix: the function must "
                "return a score, not exit the process or crash the interpreter"
            ) from None

    def close(self) -> None:
        """Stop the child (killed: user code may ignore SIGTERM); the next batch starts a new one."""
        if self._proc is None:
            return
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(5)
        self._conn.close()
        self._proc, self._ready = None, False

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the daemon child is reaped anyway
            pass


def _where(index: int, data_sources: Sequence[str]) -> str:
    if 0 <= index < len(data_sources):
        return f"{index} (data_source={data_sources[index]!r})"
    return f"{index}"


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies; exit now if the parent is already gone."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(0)


def _serve(fn_spec: str, conn, progress, parent_pid: int) -> None:
    """Child: import the function, say ("ready",), then answer each batch with ("scored", scores, extras)."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops this process
    try:
        fn = load_user_fn(fn_spec)
    except Exception as exc:
        conn.send(("raised", type(exc).__name__, str(exc)))
        return

    def counted(**kwargs):
        progress.value += 1
        return fn(**kwargs)

    reward = RewardFn(counted, user_fn_name(fn_spec))
    conn.send(("ready",))
    while True:
        try:
            batch = conn.recv()
        except EOFError:  # the parent closed the pipe: done
            return
        try:
            scores, extras = reward._score_lists(*batch)
        except Exception as exc:
            conn.send(("raised", type(exc).__name__, str(exc)))
            continue
        conn.send(("scored", scores, extras))
