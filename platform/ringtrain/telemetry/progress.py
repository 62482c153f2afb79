"""Console output while a run goes: one line per step, a line per incident, and a short summary at the end.

Before step 1 a run can be silent for a minute on a loaded machine (Ray starting, the workers
importing torch and DeepSpeed and building the model and its ZeRO engine): ``waiting`` says
what the run waits for, and says it again with the time waited while nothing else is printed
for ``QUIET_S`` (a thread of its own ticks; tests tick by hand).
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

# Silence after which a run still waiting says so again.
QUIET_S = 15.0


def step_line(record: dict[str, Any], total_steps: int) -> str:
    return (
        f"step {record['step']:>{len(str(total_steps))}}/{total_steps}"
        f" | loss {record['loss']:.4f}"
        f" | {record['tokens_per_s']:,.0f} tok/s"
        f" | {record['step_time_s']:.2f} s/step"
        f" | lr {record['lr']:.2e}"
        f" | dp {record['dp']} x cp {record['cp']}"
    )


def incident_line(incident: dict[str, Any], path: Path) -> str:
    """An incident as first seen, and the file that holds it."""
    return (
        f"incident {incident['id']}: {incident['kind']} on ranks {list(incident['ranks'])} "
        f"at step {incident['detected_at_step']}: {incident['reason']} ({path})"
    )


def summary_lines(summary: dict[str, Any]) -> list[str]:
    lines = [f"run {summary['status']}: {summary['final_step']}/{summary['steps']} steps in {summary['wall_time_s']:.1f} s"]
    if summary.get("initial_loss") is not None:
        lines.append(f"loss {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f}")
    if summary.get("tokens_per_s"):
        lines.append(f"throughput {summary['tokens_per_s']:,.0f} tokens/s over {summary['tokens']:,} tokens")
    if summary.get("error"):
        lines.append(f"error: {summary['error']}")
    lines.append(f"run directory: {summary['run_dir']}")
    return lines


@dataclass(eq=False)  # a running console, compared by identity
class Progress:
    """One run's console on ``out``: a step's line every ``every`` steps and at the last of
    ``total_steps`` (none, nor waits, unless ``enabled``), messages and the summary; ``ticking``:
    whether a thread repeats a wait's line (off where a test ticks by hand with its ``clock``)."""

    total_steps: int
    _: KW_ONLY
    enabled: bool = True
    every: int = 1
    out: TextIO = sys.stdout
    clock: Callable[[], float] = time.monotonic
    ticking: bool = True
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _last_output: float = field(init=False)
    _waiting: Optional[tuple[str, float]] = field(default=None, init=False)  # (what, since when)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: Optional[threading.Thread] = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._last_output = self.clock()

    def step(self, record: dict[str, Any]) -> None:
        self._done_waiting()
        if self.enabled and (record["step"] % self.every == 0 or record["step"] == self.total_steps):
            self._print(step_line(record, self.total_steps))

    def message(self, text: str) -> None:
        self._print(text)

    def waiting(self, what: str) -> None:
        """Say that the run now waits for ``what`` (until the next step, or the next wait)."""
        if not self.enabled:
            return
        self._print(f"ringtrain: waiting for {what}")
        with self._lock:
            self._waiting = (what, self.clock())
        if self.ticking and self._thread is None:
            self._thread = threading.Thread(target=self._tick_until_done, name="progress-waiting", daemon=True)
            self._thread.start()

    def tick(self) -> None:
        """While a wait lasts and nothing was printed for QUIET_S: the wait again, with its time."""
        with self._lock:
            waiting, quiet = self._waiting, self.clock() - self._last_output
        if waiting is not None and quiet >= QUIET_S:
            what, since = waiting
            self._print(f"ringtrain: still waiting ({self.clock() - since:.0f} s) for {what}")

    def summary(self, summary: dict[str, Any]) -> None:
        self._done_waiting()
        self._stop.set()
        for line in summary_lines(summary):
            self._print(line)

    def _done_waiting(self) -> None:
        with self._lock:
            self._waiting = None

    def _tick_until_done(self) -> None:
        while not self._stop.wait(1.0):
            self.tick()

    def _print(self, line: str) -> None:
        with self._lock:
            self._last_output = self.clock()
        print(line, file=self.out, flush=True)
