"""Experiment trackers (MLflow, Weights & Biases) as sinks of the driver's metrics stream.

The driver, never a rank, logs: each metrics.jsonl record becomes one point at its own step,
each incident an event on the run's timeline, the resolved config the run's parameters, and at
the end report.html, summary.json and metrics.jsonl its files.

A tracker never stops training. The step's thread only puts a point on a bounded queue; a
thread per tracker sends it, with bounded retries. A tracker unreachable at the start, lost in
the middle, or too slow to keep up (its queue full) is written up once as an incident and a
warning, and the run goes on: metrics.jsonl keeps every point.

Exactly once. ``trackers.json`` in the run directory keeps each tracker's run id and the last
step it holds, and the run's tracker key, which every durable checkpoint's meta carries too; a
resumed, recovered or rolled-back run continues the same tracker run (one resumed from a
checkpoint into another run directory finds it by the key). A step
the tracker already holds is sent again only when its training values changed (a rollback
after corruption redid it differently); a step redone with the same values, as an exact resume
redoes the steps after its checkpoint, is already there. Steps an earlier attempt recorded
but never got to the tracker (it was lost) are sent first, from metrics.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, Union

from ringtrain.config import JobConfig
from ringtrain.config.destinations import mask_credentials
from ringtrain.telemetry.tensorboard import is_number, record_scalars
from ringtrain.telemetry.tracker_items import Event, Point, Status, is_key

if TYPE_CHECKING:
    from ringtrain.telemetry.rundir import RunDir

TRACKERS_FILE = "trackers.json"
KEY_ENTRY = "run"  # trackers.json's entry of the run's own tracker key
# The checkpoint meta's entry of the key: a run resumed elsewhere continues the same tracker runs.
META_KEY = "tracker_key"
# Files of the run directory a tracker receives at the end, as they are when the run ends.
RUN_FILES = ("report.html", "summary.json", "metrics.jsonl")
# Points waiting for a tracker: hours of steps at one a second, a few MB at most.
QUEUE_POINTS = 8192
# Points sent per call: one request for a burst (a backfill, a tracker catching up).
BATCH_POINTS = 64
RETRIES = 3  # tries of one call before the tracker counts as lost
RETRY_BACKOFF_S = 1.0  # doubled after each failed try
# How long the run's end waits for a tracker to take its last points and files.
FINISH_TIMEOUT_S = 60.0
# A step's training values: equal in two attempts of the step when the step was redone exactly.
TRAINING_KEYS = ("loss", "lr", "grad_norm", "tokens")

@dataclass(frozen=True)
class Finish:
    status: Status
    files: tuple[Path, ...]


Item = Union[Point, Event, Finish]


class Tracker(Protocol):
    """One tracker's client, called from its sink's thread only."""

    name: str  # the key of telemetry.<name> and of trackers.json
    where: str  # what the user configured it to reach, for messages

    def open(self, run_id: Optional[str], key: str, params: dict[str, str]) -> str:
        """Start or continue the tracker's run (``run_id``, else the one tagged with the run's
        ``key``, else a new one tagged with it); returns its id."""
        ...

    def log(self, points: Sequence[Point]) -> None: ...

    def event(self, event: Event) -> None: ...

    def finish(self, status: Status, files: Sequence[Path]) -> None: ...


def params_of(job: JobConfig) -> dict[str, str]:
    """The resolved config as flat ``section.key`` parameters (lists and maps as JSON), with
    credentials written into a URI masked."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value and prefix.count(".") < 1:
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
        else:
            out[prefix] = mask_credentials(value if isinstance(value, str) else json.dumps(value, sort_keys=True))

    walk("", dataclasses.asdict(job))
    return out


def training_values(record: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(record.get(key) for key in TRAINING_KEYS)


def read_history(run_dir: Path) -> dict[int, dict[str, Any]]:
    """metrics.jsonl's records by step, a later attempt's replacing an earlier one's."""
    history: dict[int, dict[str, Any]] = {}
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return history
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a half-written last line of a killed run
            if isinstance(record, dict) and is_number(record.get("step")):
                history[int(record["step"])] = record
    return history


class TrackerState:
    """trackers.json: per tracker, its run id and the last step it holds."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / TRACKERS_FILE
        self._lock = threading.Lock()
        try:
            loaded = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            loaded = {}
        self._data: dict[str, dict[str, Any]] = {k: v for k, v in loaded.items() if isinstance(v, dict)} if isinstance(loaded, dict) else {}

    def run_id(self, name: str) -> Optional[str]:
        value = self._data.get(name, {}).get("run_id")
        return value if isinstance(value, str) and value else None

    def logged_through(self, name: str) -> int:
        value = self._data.get(name, {}).get("logged_through")
        return int(value) if is_number(value) else 0

    def update(self, name: str, **fields: Any) -> None:
        with self._lock:
            self._data.setdefault(name, {}).update(fields)
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self._data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            os.replace(tmp, self.path)

    def key(self) -> str:
        """The run's tracker key: kept here, else taken from a checkpoint's meta, else new."""
        with self._lock:
            key = self._data.get(KEY_ENTRY, {}).get("key")
        if not is_key(key):
            key = uuid.uuid4().hex
            self.update(KEY_ENTRY, key=key)
        return str(key)

    def adopt_key(self, key: Any) -> None:
        """A resumed run's key, from its checkpoint, where this run directory has none yet; a
        value that is not a key (KEY_PATTERN) is not adopted."""
        if is_key(key) and not is_key(self._data.get(KEY_ENTRY, {}).get("key")):
            self.update(KEY_ENTRY, key=key)

    def meta(self) -> dict[str, str]:
        """What a durable checkpoint records of the trackers: the run's key."""
        return {META_KEY: self.key()}


class TrackerSink:
    """One tracker fed from the driver's metrics stream through a bounded queue and a thread.

    ``step`` and ``incident`` are the run's Sink calls (the controller's thread: they never
    block); ``finish`` ends the tracker's run once the run's files are final. ``trouble`` holds
    what went wrong, for the run to report on its own thread (``take_trouble``).
    """

    def __init__(
        self,
        tracker: Tracker,
        run_dir: Path,
        params: dict[str, str],
        *,
        state: Optional[TrackerState] = None,
        queue_points: int = QUEUE_POINTS,
        retries: int = RETRIES,
        backoff_s: float = RETRY_BACKOFF_S,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.tracker = tracker
        self.params = params
        self.state = state or TrackerState(run_dir)
        self.retries = retries
        self.backoff_s = backoff_s
        self.sleep = sleep
        self.run_id: Optional[str] = None
        self.lost = False
        self.num_dropped = 0
        self.num_sent = 0
        self._last_error = "no answer"
        self._trouble: list[str] = []
        self._trouble_lock = threading.Lock()
        self._queue: queue.Queue[Item] = queue.Queue(maxsize=queue_points)
        self._last_step = 0
        self._closed = False
        # What the tracker holds (or has been given) of each step, to tell a redone step's news.
        history = read_history(run_dir)
        held_through = self.state.logged_through(tracker.name)
        self._held = {step: training_values(r) for step, r in history.items() if step <= held_through}
        # An earlier attempt's steps that never reached the tracker go first, in step order.
        self._backfill = [self._point(r) for step, r in sorted(history.items()) if step > held_through]
        self._held.update((p.step, training_values(history[p.step])) for p in self._backfill)
        self._thread = threading.Thread(target=self._send_all, name=f"ringtrain-{tracker.name}", daemon=True)
        self._thread.start()

    # -- the controller's thread ---------------------------------------------------------------

    def step(self, record: dict[str, Any]) -> None:
        if self._closed or not is_number(record.get("step")):
            return
        step = int(record["step"])
        self._last_step = max(self._last_step, step)
        values = training_values(record)
        held = self._held.get(step)
        if held == values:
            return  # redone exactly: the tracker has this point already
        self._held[step] = values
        self._put(self._point(record, redone=held is not None))

    def incident(self, incident: dict[str, Any]) -> None:
        if self._closed:
            return
        step = incident.get("detected_at_step")
        self._put(Event(int(step) if is_number(step) else self._last_step, incident))

    def close(self) -> None:
        """The controller is done: nothing more comes from it (the files come with ``finish``)."""
        self._closed = True

    def finish(self, status: Status, run_dir: Path, timeout_s: float = FINISH_TIMEOUT_S) -> None:
        """Send the run's files and end the tracker's run, waiting at most ``timeout_s``."""
        self._closed = True
        files = tuple(run_dir / name for name in RUN_FILES if (run_dir / name).is_file())
        try:
            self._queue.put(Finish(status, files), timeout=timeout_s)
        except queue.Full:
            self._say(f"{self.tracker.name} at {self.tracker.where} took no new points for {timeout_s:.0f} s; its run was not ended")
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._say(f"{self.tracker.name} at {self.tracker.where} did not take the run's last points and files within {timeout_s:.0f} s")

    def take_trouble(self) -> list[str]:
        with self._trouble_lock:
            taken, self._trouble = self._trouble, []
        return taken

    def _put(self, item: Item) -> None:
        if self.lost:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1:
                self._say(
                    f"{self.tracker.name} at {self.tracker.where} is not keeping up ({self._queue.maxsize} points queued): "
                    "points are left out of it from here on; metrics.jsonl keeps every one"
                )

    @staticmethod
    def _point(record: dict[str, Any], redone: bool = False) -> Point:
        return Point(int(record["step"]), record_scalars(record), redone)

    # -- the tracker's thread ------------------------------------------------------------------

    def _send_all(self) -> None:
        self.run_id = self._call("start", lambda: self.tracker.open(self.state.run_id(self.tracker.name), self.state.key(), self.params))
        if self.run_id is None:
            self._lose("could not start its run")
            return
        self.state.update(self.tracker.name, run_id=self.run_id)
        for batch in _batches(self._backfill):
            if not self._send_points(batch):
                return
        self._backfill = []
        while True:
            item = self._queue.get()
            if isinstance(item, Finish):
                if self._call("end", lambda: self.tracker.finish(item.status, item.files)) is None:
                    self._lose("could not take the run's files and end its run")
                return
            if isinstance(item, Event):
                if self._call("incident", lambda: self.tracker.event(item)) is None:
                    self._lose("lost while logging an incident")
                    return
                continue
            batch = [item, *self._more_points()]
            if not self._send_points(batch):
                return

    def _more_points(self) -> Iterator[Point]:
        """Points already queued behind the first, up to a batch, so a backlog goes in few calls."""
        for _ in range(BATCH_POINTS - 1):
            if not self._queue.queue or not isinstance(self._queue.queue[0], Point):
                return
            item = self._queue.get_nowait()
            assert isinstance(item, Point)
            yield item

    def _send_points(self, batch: list[Point]) -> bool:
        if self._call("log", lambda: self.tracker.log(batch)) is None:
            self._lose(f"lost at step {batch[0].step}")
            return False
        self.num_sent += len(batch)
        self.state.update(self.tracker.name, logged_through=max(self.state.logged_through(self.tracker.name), max(p.step for p in batch)))
        return True

    def _call(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()``'s result (True for None), or None after ``retries`` failed tries."""
        delay = self.backoff_s
        for attempt in range(1, self.retries + 1):
            try:
                result = call()
                return True if result is None else result
            except Exception as exc:  # noqa: BLE001 - any client error: the tracker is out, training is not
                self._last_error = f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                if attempt < self.retries:
                    self.sleep(delay)
                    delay *= 2
        return None

    def _lose(self, what: str) -> None:
        self.lost = True
        self._say(
            f"{self.tracker.name} at {self.tracker.where} {what} ({self._last_error}, "
            f"{self.retries} tries): training goes on without it; metrics.jsonl keeps every point"
        )
        # Whatever is queued is dropped, so nothing waits on a tracker that is gone.
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def _say(self, text: str) -> None:
        with self._trouble_lock:
            self._trouble.append(mask_credentials(text))  # a client's error may quote the URI whole


def _batches(points: Sequence[Point]) -> Iterator[list[Point]]:
    for start in range(0, len(points), BATCH_POINTS):
        yield list(points[start : start + BATCH_POINTS])


class Trackers:
    """The run's trackers as one Sink, their troubles written up as incidents, and their end."""

    def __init__(self, sinks: Sequence[TrackerSink], run_dir: "RunDir", say: Callable[[str], None]) -> None:
        self.sinks = list(sinks)
        self.run_dir = run_dir
        self.say = say
        self._last_step = 0

    def step(self, record: dict[str, Any]) -> None:
        if is_number(record.get("step")):
            self._last_step = int(record["step"])
        for sink in self.sinks:
            sink.step(record)
        self._report()

    def incident(self, incident: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.incident(incident)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def finish(self, status: Status, timeout_s: float = FINISH_TIMEOUT_S) -> None:
        for sink in self.sinks:
            sink.finish(status, self.run_dir.path, timeout_s)
        self._report()

    def _report(self) -> None:
        for sink in self.sinks:
            for text in sink.take_trouble():
                incident = {
                    "id": self.run_dir.num_incidents() + 1,
                    "kind": TRACKER_INCIDENT,
                    "ranks": [],
                    "detected_at_step": self._last_step,
                    "detected_at": time.time(),
                    "action": "continue",
                    "reason": text,
                }
                path = self.run_dir.write_incident(incident)
                self.say(f"ringtrain: warning: {text} ({path})")


# The kind of a tracker's incident: not a fault of the training, which the policies never see.
TRACKER_INCIDENT = "tracker"
# telemetry.<name> -> the package its client needs, as `pip install 'ringtrain[<extra>]'` brings it.
TRACKER_PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}


def configured(job: JobConfig) -> list[str]:
    """The trackers the job turns on, by their telemetry key."""
    t = job.telemetry
    return [name for name, on in (("mlflow", bool(t.mlflow.tracking_uri)), ("wandb", bool(t.wandb.project))) if on]


def check_installed(job: JobConfig) -> None:
    """Bad input before any cluster starts: a tracker turned on whose client is not installed."""
    import importlib.util

    from ringtrain.errors import ConfigError

    for name in configured(job):
        package = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            key = "telemetry.mlflow.tracking_uri" if name == "mlflow" else "telemetry.wandb.project"
            raise ConfigError(key, f"is set, but the {package} package is not installed: pip install 'ringtrain[{name}]'")


def open_trackers(
    job: JobConfig, run_dir: "RunDir", say: Callable[[str], None], resume_meta: Optional[Mapping[str, Any]] = None
) -> Optional[Trackers]:
    """The job's trackers, each starting its run on its own thread; None when none is on.
    ``resume_meta``: the meta of the checkpoint the run resumes from, whose key it continues."""
    names = configured(job)
    if not names:
        return None
    params = params_of(job)
    state = TrackerState(run_dir.path)
    if resume_meta is not None:
        state.adopt_key(resume_meta.get(META_KEY))
    state.key()
    sinks = []
    for name in names:
        if name == "mlflow":
            from ringtrain.telemetry.mlflow_tracker import MlflowTracker

            tracker: Tracker = MlflowTracker(job.telemetry.mlflow, default_name=job.name)
        else:
            from ringtrain.telemetry.wandb_tracker import WandbTracker

            tracker = WandbTracker(job.telemetry.wandb, run_dir=run_dir.path, default_name=job.name)
        sinks.append(TrackerSink(tracker, run_dir.path, params, state=state))
    return Trackers(sinks, run_dir, say)


def tracker_meta(job: JobConfig, run_path: Path, resume_meta: Optional[Mapping[str, Any]]) -> dict[str, str]:
    """What each durable checkpoint of the run records of its trackers (nothing when none is on)."""
    if not configured(job):
        return {}
    run_path.mkdir(parents=True, exist_ok=True)
    state = TrackerState(run_path)
    if resume_meta is not None:
        state.adopt_key(resume_meta.get(META_KEY))
    return state.meta()
