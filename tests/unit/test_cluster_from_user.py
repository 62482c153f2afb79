"""The cluster a command joins is the user's, never one a file it reads names.

A run directory's ``config.yaml`` (or the one beside a checkpoint store) may sit in a folder
others can write; were its ``cluster.address`` followed, ``ringtrain eval /shared/run`` would
join that cluster with the user's token and unpickle what its workers send back. A checkpoint's
meta is someone else's data too: its keys pass an allow-list of model fields, as values.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ringtrain import cli, config
from ringtrain.actors.resume import checkpoint_meta
from ringtrain.checkpoint import open_store
from ringtrain.commands.eval_source import _job_of_meta, resolve_source
from ringtrain.errors import ConfigError
from ringtrain.telemetry.rundir import RunDir

SHAPE = ["model.vocab_size=96", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2"]


class Listener:
    """A socket on 127.0.0.1 that counts the connections it accepts, from a thread that gives up
    after ``timeout_s``."""

    def __init__(self, timeout_s: float = 20.0) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._timeout_s = timeout_s
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        waited = 0.0
        while not self._stop.is_set() and waited < self._timeout_s:
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                waited += 0.2
                continue
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def hostile() -> Iterator[Listener]:
    listener = Listener()
    yield listener
    listener.close()


def _shared_run(run_dir: Path, address: str) -> None:
    """A run directory as another user could leave it: a valid checkpoint, and a config.yaml
    naming their cluster."""
    job = config.load(None, [*SHAPE, f"run_dir={run_dir}", f"cluster.address={address}"])
    run = RunDir(run_dir)
    run.write_config(job)
    run.close()
    assert f"address: {address}" in (run_dir / config.RUN_CONFIG).read_text()
    open_store((run_dir / "checkpoints").as_uri()).save(10, {"rank-0": b"weights"}, checkpoint_meta(job))


def test_a_run_directorys_config_never_names_the_cluster(tmp_path: Path, hostile: Listener) -> None:
    _shared_run(tmp_path / "run", hostile.address)
    from_run = resolve_source(str(tmp_path / "run"))
    beside_store = resolve_source((tmp_path / "run" / "checkpoints").as_uri())
    assert from_run.job.cluster == beside_store.job.cluster == config.ClusterConfig()
    assert from_run.job.model.dim == 64  # the model is still the run's


def test_a_cluster_override_of_the_user_still_counts(tmp_path: Path) -> None:
    _shared_run(tmp_path / "run", "127.0.0.1:1")
    source = resolve_source(str(tmp_path / "run"))
    assert config.merge(source.job, ["cluster.address=127.0.0.1:2"]).cluster.address == "127.0.0.1:2"


def test_eval_of_a_shared_run_joins_the_users_cluster_only(
    tmp_path: Path, hostile: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ringtrain eval`` end to end up to ray.init, which records where it was sent and fails
    like an unreachable cluster: nothing starts, and the hostile address is never dialled."""
    import ray

    _shared_run(tmp_path / "run", hostile.address)
    rows = tmp_path / "rows.npy"
    np.save(rows, np.arange(2 * 16).reshape(2, 16) % 90)
    users = Listener()
    joined: list[Any] = []

    def init(*args: Any, **kwargs: Any) -> None:
        joined.append(kwargs.get("address"))
        raise ConnectionError("no cluster in this test")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setenv("RAY_ADDRESS", users.address)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    try:
        code = cli.main(["eval", str(tmp_path / "run"), "--data", str(rows)])
    finally:
        users.close()
    assert code == cli.EXIT_FAILED  # "cannot reach the Ray cluster", as an unreachable one would
    assert joined == [users.address]
    assert hostile.connections == 0


def test_a_checkpoint_meta_key_outside_the_model_fields_is_ignored() -> None:
    base = {"vocab_size": 96, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}
    for meta in (
        {"model_config": {**base, "hf=/elsewhere": "x", "hf": "/elsewhere"}},
        {"model": {**base, "hf=/elsewhere": "x"}},  # an older checkpoint's shape
        {"model_config": {**base, "dim=64 model.hf": "/elsewhere", "cluster": {"address": "10.0.0.1:6379"}}},
    ):
        job = _job_of_meta(meta)
        assert job.model.hf == "" and job.model.dim == 64
        assert job.cluster == config.ClusterConfig()


def test_a_checkpoint_meta_value_is_a_value_never_override_text() -> None:
    """A string that an override would read as a mapping stays a string (and is refused as one):
    the meta gives values, not text for the dotlist parser."""
    meta = {"model_config": {"vocab_size": 96, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                             "rope_scaling": "{rope_type: linear, factor: 8.0}"}}  # fmt: skip
    with pytest.raises(ConfigError, match="SOURCE: the checkpoint's meta") as caught:
        _job_of_meta(meta)
    assert "model.rope_scaling" in str(caught.value)
