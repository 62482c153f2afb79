"""A real MLflow tracking server on loopback (sqlite backend, a local artifact folder), for the
tests and the bench that log to one; stopped by its PID afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ringtrain_dev.ray_head import free_ports

# The server answers /health after about 12 s on two cores; more while other tests compete.
START_TIMEOUT_S = 120.0


@dataclass
class MlflowServer:
    uri: str
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        """Ends the server and the workers it started (its own process group), by PID."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def start_mlflow(folder: Path) -> MlflowServer:
    """A server keeping its database, artifacts and log in ``folder``, once it answers /health
    (the mlflow package must be installed: pip install -e '.[test]')."""
    (port,) = free_ports(1)
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "server.log"
    command = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
        "--backend-store-uri", f"sqlite:///{folder / 'db.sqlite'}", "--artifacts-destination", str(folder / "artifacts"),
        "--workers", "1",
    ]  # fmt: skip
    # Without job execution: MLflow 3 otherwise starts five job-queue consumers beside the
    # server, each importing mlflow and polling, CPU the tests' training runs need.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=folder, env=env)
    server = MlflowServer(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mlflow server exited {process.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{server.uri}/health", timeout=2) as answer:
                if answer.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"mlflow server not healthy within {START_TIMEOUT_S} s: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def running_mlflow(folder: Path) -> Iterator[MlflowServer]:
    """``start_mlflow(folder)``, stopped when the context ends."""
    server = start_mlflow(folder)
    try:
        yield server
    finally:
        server.stop()
