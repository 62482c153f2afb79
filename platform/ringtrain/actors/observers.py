"""Observers: everything that follows a run from the Controller, behind one interface.

The Controller (and its RunBook) tells one ``Observers`` list what happens: the group is up, a
step's record, an incident when it is seen and each time it is brought up to date, the worker
layout, a line of news, a count or gauge of ``ringtrain.metrics``, the end of the run, the
summary. Each output is an adapter here that takes from those what it shows:

- ``RunDirObserver``: the run directory (metrics.jsonl, incidents/, workers.json, summary.json)
- ``ProgressObserver``: the console (one line per step, the news, each incident)
- ``TelemetryObserver``: Prometheus (``telemetry.prometheus.RunMetrics``)
- ``SinkObserver``: a ``Sink`` of steps and incidents (``telemetry.tensorboard``)

A new output is one more ``Observer``: subclass it, override what the output shows (every
method does nothing by default), and hand it to the Controller's ``observers`` (``commands/run.py``
builds the Controller).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence

from ringtrain.actors.protocols import Sink
from ringtrain.config import JobConfig
from ringtrain.metrics import INCIDENTS, Metric
from ringtrain.planner.devices import peak_flops
from ringtrain.status import WorkerInfo
from ringtrain.telemetry.progress import Progress, incident_line
from ringtrain.telemetry.prometheus import RunMetrics
from ringtrain.telemetry.rundir import RunDir


class Observer(Protocol):
    """What the Controller tells its outputs, in the order a run goes. Records are the dicts
    the run directory stores (metrics.jsonl lines, ``Incident`` as a dict, summary.json):
    observers read them and never change them."""

    def on_start(self, workers: Sequence[WorkerInfo]) -> None:
        """The workers are up (``workers``: rank order)."""

    def step_fields(self, record: dict[str, Any]) -> dict[str, Any]:
        """Measurements this output adds to ``record`` before any observer sees the step."""
        return {}

    def on_step(self, record: dict[str, Any]) -> None:
        """A step was kept: its metrics.jsonl record."""

    def on_incident(self, incident: dict[str, Any]) -> None:
        """An incident was seen (its first record; recovery not done yet)."""

    def on_incident_update(self, incident: dict[str, Any]) -> None:
        """An incident seen before, brought up to date (dp after, steps lost, recover_s)."""

    def on_layout(self, layout: dict[str, Any]) -> None:
        """Who runs each rank now: after the start and after every change of the world."""

    def on_message(self, text: str) -> None:
        """A line of news: a checkpoint written, a recovery done, a resize, an evaluation."""

    def on_waiting(self, what: str) -> None:
        """The run now waits for ``what`` (the workers to start, step 1), until the next step."""

    def on_count(self, metric: Metric, amount: float, **labels: str) -> None:
        """A counter of ``ringtrain.metrics`` grew by ``amount``."""

    def on_gauge(self, metric: Metric, value: float, **labels: str) -> None:
        """A gauge of ``ringtrain.metrics`` now reads ``value``."""

    def close(self) -> None:
        """The run is over, whatever ended it (the summary follows)."""

    def on_summary(self, summary: dict[str, Any]) -> None:
        """The run's summary.json content; the last call."""


class Observers(Observer):
    """The run's observers, each told in list order (a failing one stops the rest, as any
    exception in the Controller does)."""

    def __init__(self, observers: Iterable[Observer]) -> None:
        self.observers = list(observers)

    def on_start(self, workers: Sequence[WorkerInfo]) -> None:
        for o in self.observers:
            o.on_start(workers)

    def step_fields(self, record: dict[str, Any]) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for o in self.observers:
            fields.update(o.step_fields(record))
        return fields

    def on_step(self, record: dict[str, Any]) -> None:
        for o in self.observers:
            o.on_step(record)

    def on_incident(self, incident: dict[str, Any]) -> None:
        for o in self.observers:
            o.on_incident(incident)

    def on_incident_update(self, incident: dict[str, Any]) -> None:
        for o in self.observers:
            o.on_incident_update(incident)

    def on_layout(self, layout: dict[str, Any]) -> None:
        for o in self.observers:
            o.on_layout(layout)

    def on_message(self, text: str) -> None:
        for o in self.observers:
            o.on_message(text)

    def on_waiting(self, what: str) -> None:
        for o in self.observers:
            o.on_waiting(what)

    def on_count(self, metric: Metric, amount: float, **labels: str) -> None:
        for o in self.observers:
            o.on_count(metric, amount, **labels)

    def on_gauge(self, metric: Metric, value: float, **labels: str) -> None:
        for o in self.observers:
            o.on_gauge(metric, value, **labels)

    def close(self) -> None:
        for o in self.observers:
            o.close()

    def on_summary(self, summary: dict[str, Any]) -> None:
        for o in self.observers:
            o.on_summary(summary)


def run_observers(
    run_dir: RunDir,
    progress: Progress,
    telemetry: Optional[RunMetrics],
    sinks: Iterable[Sink],
    others: Iterable[Observer],
    *,
    job: JobConfig,
) -> Observers:
    """A run's observers, in the order they are told: the run directory first (a line or an
    incident is on disk before anything else shows it), the console, Prometheus when exported,
    the sinks, then any other."""
    return Observers(
        [
            RunDirObserver(run_dir),
            ProgressObserver(progress, run_dir.incident_path),
            *([TelemetryObserver(telemetry, cpu_cores=job.cluster.cpus_per_worker)] if telemetry is not None else []),
            *(SinkObserver(sink) for sink in sinks),
            *others,
        ]
    )


class RunDirObserver(Observer):
    """The run directory's files. The directory stays open: whoever opened it closes it."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir

    def on_step(self, record: dict[str, Any]) -> None:
        self.run_dir.append_metrics(record)

    def on_incident(self, incident: dict[str, Any]) -> None:
        self.run_dir.write_incident(incident)

    def on_incident_update(self, incident: dict[str, Any]) -> None:
        self.run_dir.write_incident(incident)

    def on_layout(self, layout: dict[str, Any]) -> None:
        self.run_dir.write_workers(layout)

    def on_summary(self, summary: dict[str, Any]) -> None:
        self.run_dir.write_summary(summary)


class ProgressObserver(Observer):
    """The console: each step (on ``telemetry.log_every``), the news and each incident with
    the file it was written to (``incident_path``)."""

    def __init__(self, progress: Progress, incident_path: Callable[[dict[str, Any]], Path]) -> None:
        self.progress = progress
        self.incident_path = incident_path

    def on_step(self, record: dict[str, Any]) -> None:
        self.progress.step(record)

    def on_incident(self, incident: dict[str, Any]) -> None:
        self.progress.message(incident_line(incident, self.incident_path(incident)))

    def on_message(self, text: str) -> None:
        self.progress.message(text)

    def on_waiting(self, what: str) -> None:
        self.progress.waiting(what)


class TelemetryObserver(Observer):
    """Prometheus: the step's gauges, every count and gauge, and each step's MFU (against the
    peak of the workers' device, known once they are up)."""

    def __init__(self, metrics: RunMetrics, *, cpu_cores: float) -> None:
        self.metrics = metrics
        self.cpu_cores = cpu_cores  # the peak of a CPU worker is per core

    def on_start(self, workers: Sequence[WorkerInfo]) -> None:
        if workers:
            self.metrics.peak_flops_per_worker = peak_flops(workers[0].device_name, cpu_cores=self.cpu_cores)

    def step_fields(self, record: dict[str, Any]) -> dict[str, Any]:
        return {"mfu": self.metrics.mfu(record["tokens_per_s"], record["dp"] * record["cp"])}

    def on_step(self, record: dict[str, Any]) -> None:
        self.metrics.step(record)
        self.metrics.goodput(record["goodput"])

    def on_incident(self, incident: dict[str, Any]) -> None:
        self.metrics.add(INCIDENTS, 1, kind=incident["kind"])

    def on_count(self, metric: Metric, amount: float, **labels: str) -> None:
        self.metrics.add(metric, amount, **labels)

    def on_gauge(self, metric: Metric, value: float, **labels: str) -> None:
        self.metrics.set(metric, value, **labels)

    def close(self) -> None:
        self.metrics.finish()


class SinkObserver(Observer):
    """A ``Sink``: its steps, its incidents as first seen, and its close."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    def on_step(self, record: dict[str, Any]) -> None:
        self.sink.step(record)

    def on_incident(self, incident: dict[str, Any]) -> None:
        self.sink.incident(incident)

    def close(self) -> None:
        self.sink.close()
