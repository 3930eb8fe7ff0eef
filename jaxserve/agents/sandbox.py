"""The code sandbox: model-written Python run by a maintained isolation tool (bubblewrap by
default), never in the server's process. Host side: no JAX.

Isolation is the runtime's (`SandboxLimits.command`, argv words with placeholders, so an operator
can switch to gVisor's `runsc` or a container runtime): the default bwrap command unshares every
namespace (no network: only a loopback nobody listens on), binds the system's /usr read-only and
nothing else of the host (not the server's data directory, keys, home or repository), mounts a
fresh /tmp, /proc and /dev, and binds one private directory per run at /work, the only writable
place that outlives the run. Inside, `prlimit` sets the CPU-time, address-space, process,
file-size and open-file limits (soft = hard, so the code cannot raise them), *after* the user
namespace exists: the process limit then counts the sandbox's own processes only. The wall time
is the server's: past it, the whole sandbox is killed (bwrap's process group; --die-with-parent
takes its PID namespace along).

A server running as root runs the sandbox as an unprivileged user (`run_as_uid`): the kernel
exempts root from the process limit, and nobody is also denied whatever root-owned files a
misconfigured command might expose.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import stat
import tempfile
from dataclasses import dataclass, field

MiB = 1024 * 1024

# The bwrap command. {rundir}: the run's private directory; the limits by name (and
# {cpu_kill_s}, one second past {cpu_s}); {python}: the interpreter inside the sandbox, which
# reads the code on its stdin.
BWRAP_COMMAND = (
    "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
    "--ro-bind", "/usr", "/usr",
    "--ro-bind-try", "/lib", "/lib", "--ro-bind-try", "/lib64", "/lib64",
    "--ro-bind-try", "/bin", "/bin",
    "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
    "--bind", "{rundir}", "/work", "--chdir", "/work",
    "--", "/usr/bin/prlimit", "--cpu={cpu_s}:{cpu_kill_s}", "--as={memory_bytes}",
    "--nproc={processes}", "--fsize={file_bytes}", "--nofile={open_files}", "--core=0",
    "--", "{python}", "-I", "-",
)


@dataclass(frozen=True)
class SandboxLimits:
    """One run's limits and the runtime that enforces them (the safer defaults: a short script,
    a little memory, a handful of processes)."""

    wall_s: float = 30.0  # killed past it (the run's tool timeout may cut it sooner)
    cpu_s: int = 10
    memory_bytes: int = 512 * MiB  # address space (RLIMIT_AS) of each process
    processes: int = 16  # processes and threads of the sandbox (RLIMIT_NPROC in its namespace)
    file_bytes: int = 16 * MiB  # the largest file it may write (RLIMIT_FSIZE)
    open_files: int = 64
    output_bytes: int = 16 * 1024  # of stdout, and of stderr, returned (the rest is cut)
    max_files: int = 20  # output files listed
    file_text_bytes: int = 4096  # a listed file's text returned when it is at most this long
    code_chars: int = 20_000  # the code itself
    python: str = "/usr/bin/python3"
    run_as_uid: int = 65534  # when the server is root (nobody)
    command: tuple[str, ...] = field(default=BWRAP_COMMAND)
    workdir: str | None = None  # where run directories are made (None: the system's temp)

    def argv(self, rundir: str) -> list[str]:
        # Past cpu_s the code gets SIGXCPU (reported as the CPU limit); a second on, SIGKILL.
        values = {"rundir": rundir, "cpu_s": self.cpu_s, "cpu_kill_s": self.cpu_s + 1,
                  "memory_bytes": self.memory_bytes, "processes": self.processes,
                  "file_bytes": self.file_bytes, "open_files": self.open_files,
                  "python": self.python}
        return [word.format(**values) for word in self.command]


@dataclass(frozen=True)
class SandboxFile:
    name: str  # relative to the run directory
    bytes: int
    text: str | None  # small UTF-8 text files only


@dataclass(frozen=True)
class SandboxResult:
    exit_code: int | None  # None: killed at the wall-time limit
    signal: int | None  # the signal that ended the code, if one did
    stdout: str
    stderr: str
    files: tuple[SandboxFile, ...]
    timed_out: bool


TRUNCATED = "\n[... truncated: {} more bytes]"


async def run_code(code: str, limits: SandboxLimits) -> SandboxResult:
    """Run `code` in a fresh sandbox; the run directory is removed afterwards. Cancelling the
    caller kills the sandbox."""
    rundir = tempfile.mkdtemp(prefix="jaxserve-code-", dir=limits.workdir)
    try:
        as_root = os.geteuid() == 0
        if as_root:
            os.chown(rundir, limits.run_as_uid, limits.run_as_uid)
        drop = {"user": limits.run_as_uid, "group": limits.run_as_uid,
                "extra_groups": []} if as_root else {}
        proc = await asyncio.create_subprocess_exec(
            *limits.argv(rundir), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            # Nothing of the server's environment (keys, tokens) reaches the code; one BLAS
            # thread, or a numpy import would spend the process limit on a thread per core.
            env={"PATH": "/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8",
                 "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
            start_new_session=True, **drop)
        out, err = _Capture(limits.output_bytes), _Capture(limits.output_bytes)
        timed_out = False
        try:
            async with asyncio.timeout(limits.wall_s):
                await asyncio.gather(out.read(proc.stdout), err.read(proc.stderr),
                                     _feed(proc.stdin, code.encode()))
                await proc.wait()
        except TimeoutError:
            timed_out = True  # what it printed until then is kept
        finally:
            if proc.returncode is None:
                _kill(proc.pid)
                await proc.wait()
        status = proc.returncode
        # bwrap reports a signal-ended child as 128 + the signal; a subprocess as -signal.
        sig = -status if status < 0 else (status - 128 if status > 128 else None)
        # Off the event loop: the code may have left many files.
        files = await asyncio.to_thread(_files, rundir, limits)
        return SandboxResult(None if timed_out else status, None if timed_out else sig,
                             out.text(), err.text(), files, timed_out)
    finally:
        await asyncio.to_thread(shutil.rmtree, rundir, True)


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    try:
        stdin.write(data)
        await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the code ended (or was killed) before reading all of itself


class _Capture:
    """The first `limit` bytes of a stream, then a marker with how many more there were (read
    and dropped, so the code never blocks on a full pipe)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.kept = bytearray()
        self.more = 0

    async def read(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            room = self.limit - len(self.kept)
            self.kept += chunk[:room]
            self.more += max(0, len(chunk) - room)

    def text(self) -> str:
        text = self.kept.decode("utf-8", "replace")
        return text + TRUNCATED.format(self.more) if self.more else text


def _files(rundir: str, limits: SandboxLimits) -> tuple[SandboxFile, ...]:
    """The regular files the code left in its directory. Symbolic links are not followed (the
    server reads this directory outside the sandbox: a link could name any of its files)."""
    found = []
    for root, dirs, names in os.walk(rundir):
        dirs.sort()
        for name in sorted(names):
            if len(found) >= limits.max_files:
                return tuple(found)
            path = os.path.join(root, name)
            found.append(_file(path, os.path.relpath(path, rundir), limits))
    return tuple(f for f in found if f is not None)


def _file(path: str, name: str, limits: SandboxLimits) -> SandboxFile | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None  # a link, a FIFO gone, or unreadable
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            return None
        text = None
        if info.st_size <= limits.file_text_bytes:
            try:
                text = f.read(limits.file_text_bytes).decode("utf-8")
            except UnicodeDecodeError:
                text = None
        return SandboxFile(name, info.st_size, text)
