"""The `python` tool: run model-written code in a child process with limits, and return its output.

What holds, on Linux without root:
- CPU time (RLIMIT_CPU), address space (RLIMIT_AS), processes (RLIMIT_NPROC), file size (RLIMIT_FSIZE),
  set in the child before exec and inherited by everything it starts;
- a wall-clock limit: the whole process tree is killed (its own process group, and with namespaces the PID
  namespace, whose processes all die with its first process);
- a fresh temporary working directory, removed afterwards; the interpreter runs isolated (`-I`: no user
  site, no PYTHON* variables) with an empty environment.
Where unprivileged user namespaces are allowed (`unshare --user --map-root-user` works; probed once), the
child also gets empty network and PID namespaces (no interface but a down loopback: no network at all), and a
mount namespace in which every mount is remounted read-only except the temporary directory: a write outside it
fails. Without them (some hardened kernels and containers) network is refused only at the Python level
(`socket` replaced in the child, which a determined program can get around with ctypes) and writes outside the
directory are NOT contained; `namespaces_available()` tells which case holds, and the tool says so once.
"""

from __future__ import annotations

import asyncio
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings

from engine.multi_turn.tool import Tool

_MAX_OUTPUT_CHARS = 4000

# Runs inside the namespaces (as the mapped root of the user namespace): remount everything read-only but
# the working directory, then run the code with the interpreter given as $1.
_CONTAIN = r"""
set -e
work="$PWD"
mount --bind "$work" "$work"
cd "$work"  # the bind mount, not the directory under it that the old cwd still points at
for m in $(awk '{print $2}' /proc/self/mounts | sort -r); do
  case "$m" in "$work"|/proc|/proc/*) ;; *) mount -o remount,bind,ro "$m" 2>/dev/null || true ;; esac
done
exec "$1" -I code.py
"""

# Without namespaces: refuse sockets at the Python level, then run the code.
_NO_SOCKET_PREAMBLE = """\
import socket as _s
def _refuse(*a, **k):
    raise OSError("network is disabled in this sandbox")
_s.socket = _s.create_connection = _s.socketpair = _refuse
del _s, _refuse
"""


@functools.cache
def namespaces_available() -> bool:
    """Whether `unshare` can give the child its own user, mount, network and PID namespaces here."""
    if not shutil.which("unshare"):
        return False
    try:
        probe = subprocess.run(
            ["unshare", "-rmn", "--pid", "--fork", "--kill-child", "true"], capture_output=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def _limits(cpu_s: int, memory_bytes: int, max_processes: int, max_file_bytes: int):
    def apply() -> None:
        os.setsid()  # own process group: the wall-clock kill reaches every descendant
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_NPROC, (max_processes, max_processes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    return apply


class PythonTool(Tool):
    """Runs `code` with the limits of the module docstring; returns stdout (and stderr, and the exit status
    when it is not 0), cut to a few thousand characters."""

    name = "python"
    description = (
        "Run Python code and return what it prints (no network; files only in its working directory)."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "a Python program"}},
        "required": ["code"],
    }

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 512, max_processes: int = 64):
        self.timeout_s, self.memory_mb, self.max_processes = timeout_s, memory_mb, max_processes
        self._warned = False

    def _command(self, workdir: str) -> list[str]:
        if namespaces_available():
            return [
                "unshare",
                "-rmn",
                "--pid",
                "--fork",
                "--kill-child",
                "sh",
                "-c",
                _CONTAIN,
                "sh",
                sys.executable,
            ]
        if not self._warned:
            warnings.warn(
                "python tool: unprivileged user namespaces are unavailable, so network is refused only inside "
                "Python and writes outside the working directory are not contained (engine/multi_turn/sandbox.py)",
                stacklevel=2,
            )
            self._warned = True
        return [sys.executable, "-I", "code.py"]

    async def call(self, args: dict) -> str:
        code = str(args["code"])
        workdir = tempfile.mkdtemp(prefix="tool-python-")
        try:
            if not namespaces_available():
                code = _NO_SOCKET_PREAMBLE + code
            with open(os.path.join(workdir, "code.py"), "w") as f:
                f.write(code)
            return await self._run(workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    async def _run(self, workdir: str) -> str:
        cpu_s = max(1, int(self.timeout_s + 0.999))
        proc = await asyncio.create_subprocess_exec(
            *self._command(workdir),
            cwd=workdir,
            env={"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=_limits(cpu_s, self.memory_mb * 2**20, self.max_processes, 64 * 2**20),
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            _kill_tree(proc.pid)
            await proc.wait()
            return f"error: the program ran longer than {self.timeout_s:g} s and was stopped"
        finally:
            _kill_tree(proc.pid)  # leftovers (background children) of a program that returned
        text = out.decode(errors="replace")
        if proc.returncode != 0:
            reason = _signal_name(proc.returncode)
            text += err.decode(errors="replace")[-_MAX_OUTPUT_CHARS:] + f"\n(exit status {reason})"
        return text[-_MAX_OUTPUT_CHARS:]


def _kill_tree(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_name(returncode: int) -> str:
    if returncode < 0:
        return f"{-returncode}, killed by {signal.Signals(-returncode).name}"
    return str(returncode)
