"""`jaxserve serve` as a child process: start it, wait for the URL it prints, stop it with
SIGTERM. For end-to-end tests and the serving benchmark, which must see the server as users run
it."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Sequence

_READY_PREFIX = "jaxserve: serving "


class ServerProcess:
    """`python -m jaxserve.entrypoints.cli serve ARGS` (or another entry `module` taking the same
    command line: a test's wrapper; `command`: another subcommand that prints the same ready line,
    e.g. `router`), in `env` (default this process's environment); `url` is the
    base URL (`http://HOST:PORT/v1`) once the engine is warm, `startup_lines` what stdout said until
    then (e.g. `jaxserve: gRPC on ...`). stderr (logs, compile progress) goes to `stderr` (a file)
    so the pipe can never fill and stall the server."""

    def __init__(self, args: Sequence[str], stderr: IO, *, cwd: Path | None = None,
                 ready_timeout_s: float = 600.0, module: str = "jaxserve.entrypoints.cli",
                 env: dict[str, str] | None = None, command: str = "serve"):
        self.proc = subprocess.Popen([sys.executable, "-m", module, command, *args],
                                     cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=stderr,
                                     text=True)
        self.startup_lines: list[str] = []
        try:
            self.url = self._read_url(ready_timeout_s)
        except BaseException:
            self.kill()
            raise

    def _read_url(self, timeout_s: float) -> str:
        # A thread reads stdout line by line: select() on the pipe would miss a line already
        # pulled into the reader's buffer together with the one before it. The thread keeps
        # draining stdout afterwards, so the pipe never fills.
        lines: queue.Queue = queue.Queue()

        def pump():
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        end = time.monotonic() + timeout_s
        while (left := end - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(f"the server exited with {self.proc.wait()} before serving")
            self.startup_lines.append(line)
            if line.startswith(_READY_PREFIX):
                return line.split(" at ", 1)[1].strip()
        raise TimeoutError(f"no '{_READY_PREFIX.strip()}' line within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then the exit code (a clean shutdown is 0)."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
