"""One writer per checkpoint store, on a file store: the writer lease (tests/lease_checks.py, run
here and against S3 in tests/s3), `ringtrain run` refusing a second writer and a store holding
another run's steps before any cluster starts, and the Persister writing nothing once the lease
is lost."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Optional
from pathlib import Path

import pytest

from ringtrain.actors.persister import Persister
from ringtrain.checkpoint import CheckpointStore, open_store
from ringtrain.checkpoint.lease import Holder, LeaseLost, WriterLease
from tests.lease_checks import CHECKS, Clock

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "jobs" / "quickstart.yaml"
HEAVY_MODULES = ("torch", "ray", "deepspeed")


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_writer_lease_on_a_file_store(check: Callable[..., None], tmp_path: Path) -> None:
    check(lambda: open_store((tmp_path / "store").as_uri()))


def run_cli(tmp_path: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    """`ringtrain run` in a child whose torch, ray and deepspeed refuse to import: what is refused
    here is refused before any cluster (or training code) starts."""
    poison = tmp_path / "poison"
    for name in HEAVY_MODULES:
        (poison / name).mkdir(parents=True, exist_ok=True)
        (poison / name / "__init__.py").write_text(f"raise ImportError('{name} imported before the input was checked')\n")
    env = {**os.environ, "HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"}
    env["PYTHONPATH"] = os.pathsep.join([str(poison), str(REPO / "platform"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "ringtrain", "run", str(QUICKSTART), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def store_files(root: Path) -> dict[str, bytes]:
    """Every file of the store but the empty lock file a lease leaves (flock's, never removed: a
    lock file removed while another process waits on it would let two holders in)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".writer.lease.lock"
    }


def test_a_second_writer_on_a_live_store_exits_2_naming_the_holder(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    holder = WriterLease(open_store(store_dir.as_uri()).backend, Holder("live-run-id", "first", "/runs/first", "node-a", 4242), 600)
    holder.acquire()
    before = store_files(store_dir)
    run_dir = tmp_path / "run"
    proc = run_cli(tmp_path, [f"checkpoint.uri={store_dir.as_uri()}", f"run_dir={run_dir}", "checkpoint.resume=auto"])
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, proc.stderr
    assert line.startswith(f"ringtrain: config error: checkpoint.uri: {store_dir.as_uri()} is being written by run 'first' "
                           "(pid 4242 on node-a, run directory /runs/first), whose lease runs until "), line
    assert store_files(store_dir) == before  # the holder's lease untouched
    holder.check()
    assert not run_dir.exists()


def test_resume_none_on_a_store_of_another_run_exits_2_and_touches_nothing(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    other = open_store(store_dir.as_uri())
    for step in (10, 20):
        other.save(step, {"rank-00000": bytes([step]) * 32}, {"format": "x", "step": step})
    before = store_files(store_dir)
    run_dir = tmp_path / "run"
    proc = run_cli(tmp_path, [f"checkpoint.uri={store_dir.as_uri()}", f"run_dir={run_dir}"])
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, proc.stderr
    assert line == (f"ringtrain: config error: checkpoint.uri: {store_dir.as_uri()} holds another run's checkpoints "
                    "(steps 20, 10), which checkpoint.resume=none would replace and delete: resume that run "
                    "(checkpoint.resume=auto), or give this run another checkpoint.uri")
    assert store_files(store_dir) == before  # the steps, and no lease left behind
    assert not run_dir.exists()


class Saver(Persister):
    """Writes its own one-byte shard instead of fetching workers' snapshots."""

    def _persist(self, step: int, snapshot_refs: list[object], t0: float, timeout_s: Optional[float]) -> object:
        return self.store.save(step, {"rank-00000": b"x"}, {"step": step}, fence=self.fence)


def test_the_persister_writes_nothing_once_the_lease_is_lost(tmp_path: Path) -> None:
    clock = Clock()
    store: CheckpointStore = open_store((tmp_path / "store").as_uri())
    lease = WriterLease(store.backend, Holder.this_process("mine", "/runs/mine"), 60, clock=clock)
    lease.acquire()
    persister = Saver(store, {}, fence=lease)
    persister.submit(1, [])
    persister.flush()
    assert [ref.step for ref in store.list()] == [1] and persister.errors == []
    clock.now += 120  # never renewed
    WriterLease(store.backend, Holder.this_process("other", "/runs/other"), 60, clock=clock).acquire()
    persister.submit(2, [])
    persister.flush()
    assert [ref.step for ref in store.list()] == [1]
    assert len(persister.errors) == 1 and "LeaseLost" in persister.errors[0]
    assert persister.stopped is not None and "lapsed" in persister.stopped
    with pytest.raises(LeaseLost):
        lease.check()
    persister.submit(3, [])  # durable checkpointing has stopped: nothing more is even tried
    persister.flush()
    assert persister.requested == [1, 2] and len(persister.errors) == 1
    assert persister.close(timeout_s=0)
