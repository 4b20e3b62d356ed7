"""A `verispec serve` in a child process on a loopback port: for tests and benchmarks.

    server = ServerProcess(["--target", "smollm2-135m", "--drafter", "ngram"], threads=1).start()
    try:
        ...                     # the models load in the child meanwhile
        server.wait_ready()     # /health answers, or ServerStartError with the end of the server's log
        httpx.get(server.url + "/v1/models")
    finally:
        server.stop()
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


class ServerStartError(RuntimeError):
    """The server exited or did not answer /health in time; the message ends with its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m verispec.server ARGS --port P`; its output goes to a log file, removed by stop().

    args: `verispec serve` options, without --port. threads: OMP_NUM_THREADS for the server (torch's
    choice when None). port: a free one when None.
    """

    def __init__(self, args: list[str], threads: int | None = None, port: int | None = None):
        self.args = list(args)
        self.threads = threads
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="verispec-serve-", suffix=".log", delete=False)
        self.log_path = self._log.name

    def start(self) -> "ServerProcess":
        env = {**os.environ, **({"OMP_NUM_THREADS": str(self.threads)} if self.threads else {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "verispec.server", *self.args, "--port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Return once GET /health answers 200; raise ServerStartError if the server exits first or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ServerStartError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(f"the server did not answer /health within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def log_text(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_text()[-chars:]

    def stop(self, timeout: float = 15.0) -> None:
        """Terminate the server (kill it if it does not exit within `timeout`) and remove its log."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if os.path.exists(self.log_path):
            os.unlink(self.log_path)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
