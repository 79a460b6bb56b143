"""A real tandemd for the Python tests: `tandemd --foreground` on a socket in a temp dir, its output in a log file
there. Used by the pytest fixtures (conftest.py, cpu backend) and by the GPU entry point (run_gpu.py, cuda backend);
it imports nothing but the standard library, so the GPU entry point needs no pytest.
"""

from __future__ import annotations

import os
import signal
import socket as pysocket
import subprocess
import tempfile
import time
from pathlib import Path


class Daemon:
    """tandemd --foreground on a socket in a temp dir; its output goes to a log file there. `config`: YAML text for
    --config (written into the temp dir); `tandemd`: the binary (default: $TANDEMD)."""

    def __init__(self, extra_args=(), backend="cpu", config: str | None = None, tandemd: str | None = None):
        self.dir = tempfile.mkdtemp(prefix="tandem-py-")
        self.socket = os.path.join(self.dir, "tandemd.sock")
        self.log_path = os.path.join(self.dir, "tandemd.log")
        argv = [tandemd or os.environ["TANDEMD"], "--foreground", "--socket", self.socket, *extra_args]
        if config is not None:
            config_path = os.path.join(self.dir, "tandemd.yaml")
            Path(config_path).write_text(config)
            argv += ["--config", config_path]
        if backend:
            argv += ["--backend", backend]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not self._accepts():
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandemd exited with {self.proc.returncode} before serving:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"tandemd did not serve {self.socket} within 20 s:\n{self.log()}")
            time.sleep(0.005)  # polling for readiness with a deadline, as tests/support/harness.hpp does

    def _accepts(self) -> bool:
        s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
        try:
            s.connect(self.socket)
            return True
        except OSError:
            return False
        finally:
            s.close()

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=20)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=20)
        self._log.close()
        return self.proc.returncode
