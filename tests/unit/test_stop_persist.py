"""A stop saves the newest snapshot, and a lost writer lease stops durable checkpointing loudly:
the Controller against a scripted group, a real Persister on a real file store and its writer
lease. No Ray, no torch; the second-signal exit in a child process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from ringtrain import config
from ringtrain.actors.controller import Controller
from ringtrain.actors.persister import Persisted, Persister
from ringtrain.checkpoint import open_store
from ringtrain.checkpoint.lease import Holder, WriterLease
from ringtrain.errors import ConfigError
from ringtrain.actors.steps import StepResult
from ringtrain.telemetry.progress import Progress
from ringtrain.telemetry.rundir import RunDir
from tests.lease_checks import Clock
from tests.unit.controller_fakes import ScriptedGroup, job

REPO = Path(__file__).resolve().parents[2]


class SnapshottingGroup(ScriptedGroup):
    """Takes a snapshot every step; the step ``stop_at`` is interrupted (a SIGINT or SIGTERM lands
    while it runs); ``before_step(step)`` runs as each step starts."""

    def __init__(self, *, stop_at: Optional[int] = None) -> None:
        super().__init__()
        self.stop_at = stop_at
        self.before_step = lambda step: None

    def train_step(self, probe: bool = False, on_safe: Any = None) -> StepResult:
        self.before_step(self.step + 1)
        if self.step + 1 == self.stop_at:
            raise KeyboardInterrupt
        taken = tuple(dataclasses.replace(r, snapshot_taken=True) for r in super().train_step(probe, on_safe).reports)
        return StepResult(reports=taken)


class LocalPersister(Persister):
    """Writes the snapshot refs themselves as the shards (no Ray); ``hold`` keeps a save waiting."""

    hold: Optional[threading.Event] = None

    def _persist(self, step: int, snapshot_refs: list[Any], t0: float, timeout_s: Optional[float]) -> Persisted:
        if self.hold is not None:
            self.hold.wait(timeout=30)
        shards = {f"rank-{r:05d}": str(ref).encode() for r, ref in enumerate(snapshot_refs)}
        ref = self.store.save(step, shards, dict(self.meta, step=step), fence=self.fence)
        return Persisted(step, ref.uri, ref.num_bytes, time.perf_counter() - t0)


class Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, text: str) -> None:
        self.lines.extend(line for line in text.splitlines() if line)

    def flush(self) -> None:
        pass


def controller(tmp_path: Path, group: SnapshottingGroup, *overrides: str) -> tuple[Controller, LocalPersister, WriterLease, Lines]:
    store = open_store((tmp_path / "store").as_uri())
    lease = WriterLease(store.backend, Holder.this_process("stop", str(tmp_path)), 60)
    lease.acquire()
    persister = LocalPersister(store, {"format": "test"}, fence=lease)
    out = Lines()
    progress = Progress(6, enabled=False, out=out)  # type: ignore[arg-type]
    job_ = job("train.steps=12", "checkpoint.persist_every=5", *overrides)
    return Controller(job_, group, RunDir(tmp_path / "run"), progress, persister=persister), persister, lease, out


def stop_lines(out: Lines) -> list[str]:
    return [line for line in out.lines if line.startswith("stop: ")]


def test_a_stop_between_durable_checkpoints_saves_the_newest_snapshot(tmp_path: Path) -> None:
    group = SnapshottingGroup(stop_at=8)
    ctl, persister, lease, out = controller(tmp_path, group)
    summary = ctl.run()

    assert (summary["status"], summary["final_step"]) == ("stopped", 7)
    store = open_store((tmp_path / "store").as_uri())
    assert [ref.step for ref in store.list()] == [7, 5]  # step 5 on cadence, step 7 at the stop
    assert store.load(7).shards["rank-00001"] == b"ref-7-1"  # the snapshot of step 7, every rank's
    (line,) = stop_lines(out)
    assert line.startswith(f"stop: saved step 7 to {store.checkpoint_uri(7)} in ") and line.endswith(" s")
    assert summary["last_durable_step"] == 7
    lease.check()  # still this run's: commands/run.py releases it once nothing writes


def test_a_stop_with_the_newest_step_already_durable_writes_nothing_more(tmp_path: Path) -> None:
    group = SnapshottingGroup(stop_at=6)
    ctl, persister, _, out = controller(tmp_path, group)
    group.before_step = lambda step: persister.flush() if step == 6 else None  # step 5's save is done
    ctl.run()
    assert persister.requested == [5]
    (line,) = stop_lines(out)
    assert line == f"stop: step 5 was already saved to {persister.store.checkpoint_uri(5)}"


def test_a_stop_whose_workers_went_away_says_so_and_what_is_kept(tmp_path: Path) -> None:
    """The workers (or their cluster) gone under the stop: the line says that the snapshot could
    not be fetched from them, not that the store failed, and which step the store keeps."""
    from ray.exceptions import ActorUnavailableError

    class WorkersGone(LocalPersister):
        def _persist(self, step: int, snapshot_refs: list[Any], t0: float, timeout_s: Optional[float]) -> Persisted:
            if step == 7:
                raise ActorUnavailableError("Connection refused", None)
            return super()._persist(step, snapshot_refs, t0, timeout_s)

    ctl, persister, _, out = controller(tmp_path, SnapshottingGroup(stop_at=8))
    ctl.durable.persister = gone = WorkersGone(persister.store, persister.meta, fence=persister.fence)
    ctl.run()
    (line,) = stop_lines(out)
    assert line.startswith(
        "stop: step 7 not saved: the snapshot could not be fetched from the workers, which (or whose cluster) went "
        "away: ActorUnavailableError: The actor None is unavailable: Connection refused"
    ), line
    assert line.endswith("; the newest durable step is 5") and gone.store.uri not in line


def test_a_stop_before_any_snapshot_says_nothing_was_saved(tmp_path: Path) -> None:
    ctl, persister, _, out = controller(tmp_path, SnapshottingGroup(stop_at=1))
    ctl.run()
    assert stop_lines(out) == ["stop: nothing saved: no step since the start holds a snapshot yet"]
    assert persister.requested == []


def test_a_stop_save_that_outlasts_its_bound_is_abandoned_in_time(tmp_path: Path) -> None:
    group = SnapshottingGroup(stop_at=3)
    ctl, persister, lease, out = controller(tmp_path, group, "checkpoint.stop_persist_timeout_s=0.5")
    persister.hold = threading.Event()
    t0 = time.monotonic()
    ctl.run()
    waited = time.monotonic() - t0
    assert waited < 5, waited
    (line,) = stop_lines(out)
    assert line == "stop: step 2 not saved: not written within checkpoint.stop_persist_timeout_s=0.5; the newest durable step is 0"
    # Still writing: commands/run.py seals the lease, then leaves it to expire instead of releasing it.
    lease.seal()
    assert not persister.close(timeout_s=0.1)
    persister.hold.set()
    assert persister.close(timeout_s=10)  # the save ended at the sealed lease, writing nothing
    assert open_store((tmp_path / "store").as_uri()).list() == []


def test_stop_persist_timeout_is_checked() -> None:
    for bad in ("-1", "601", "nan"):
        with pytest.raises(ConfigError, match="checkpoint.stop_persist_timeout_s"):
            config.load(None, [f"checkpoint.stop_persist_timeout_s={bad}"])
    assert config.load(None, []).checkpoint.stop_persist_timeout_s == 20.0  # inside Kubernetes' 30 s


def test_a_lost_lease_stops_durable_checkpointing_with_an_incident(tmp_path: Path) -> None:
    """The lease taken over at step 8 (its term passed unrenewed): the run trains on, the save of
    step 10 writes nothing, one incident of kind checkpoint says so, the summary keeps the reason."""
    group = SnapshottingGroup()
    clock = Clock()
    store = open_store((tmp_path / "store").as_uri())
    lease = WriterLease(store.backend, Holder.this_process("old", str(tmp_path)), 60, clock=clock)
    lease.acquire()
    persister = LocalPersister(store, {"format": "test"}, fence=lease)

    def take_over(step: int) -> None:
        if step == 8:
            persister.flush()  # step 5's save done first: the scripted steps take no time
            clock.now += 120
            WriterLease(store.backend, Holder.this_process("new", "/elsewhere"), 60, clock=clock).acquire()

    group.before_step = take_over
    job_ = job("train.steps=12", "checkpoint.persist_every=5")
    summary = Controller(job_, group, RunDir(tmp_path / "run"), persister=persister).run()

    assert (summary["status"], summary["final_step"]) == ("finished", 12)
    assert [ref.step for ref in store.list()] == [5]
    (path,) = sorted((tmp_path / "run" / "incidents").glob("*.json"))
    incident = json.loads(path.read_text())
    assert (incident["kind"], incident["action"]) == ("checkpoint", "continue")
    assert "durable checkpointing stopped (the newest durable step is 5)" in incident["reason"] and "lapsed" in incident["reason"]
    assert summary["durable_stopped"] and "lapsed" in summary["durable_stopped"]
    assert persister.requested[:2] == [5, 10] and len(persister.errors) == 1  # one loss, reported once


SECOND_SIGNAL = """
import time
from ringtrain.commands.run import StopSignals
stop = StopSignals()
stop.install()
try:
    while True:
        time.sleep(0.05)
except KeyboardInterrupt:
    print("stopping", flush=True)
    time.sleep(60)  # a stop's save that takes its time
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_exits_at_once(signum: int) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "platform"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        [sys.executable, "-c", SECOND_SIGNAL], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        time.sleep(1.0)  # imports done, handlers installed (bounded: the assertions below say if not)
        proc.send_signal(signum)
        assert proc.stdout is not None and proc.stdout.readline() == "stopping\n"
        t0 = time.monotonic()
        proc.send_signal(signum)
        code = proc.wait(timeout=10)
        assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert code == 128 + signum
    name = signal.Signals(signum).name
    assert proc.stderr is not None
    assert proc.stderr.read() == (
        f"ringtrain: {name} again: exiting now; a save in flight is abandoned, the store's writer lease expires on its own\n"
    )
    assert os.name == "posix"
