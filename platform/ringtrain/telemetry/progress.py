"""Console output while a run goes: one line per step, a line per incident, and a short summary at the end."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO


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


class Progress:
    def __init__(self, total_steps: int, *, enabled: bool = True, every: int = 1, out: TextIO = sys.stdout) -> None:
        self.total_steps = total_steps
        self.enabled = enabled
        self.every = every
        self.out = out

    def step(self, record: dict[str, Any]) -> None:
        if self.enabled and (record["step"] % self.every == 0 or record["step"] == self.total_steps):
            print(step_line(record, self.total_steps), file=self.out, flush=True)

    def message(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def summary(self, summary: dict[str, Any]) -> None:
        for line in summary_lines(summary):
            print(line, file=self.out, flush=True)
