"""What the run directory records of the run: one metrics.jsonl line per step, and the
summary's entry for each recovery.

A step after which the job evaluated (``eval.every``) carries the result in its line under
``"eval"``: ``loss``, ``perplexity``, ``tokens``, ``by_position`` (``{start, end, loss, tokens}``
per bucket), ``passkey`` when configured, and ``seconds`` (``ringtrain.evaluation.result``
lists every key). One line per step keeps readers that replay a resumed run's steps right.
"""

from __future__ import annotations

from typing import Any

from ringtrain.status import Incident, StepReport


def step_record(reports: list[StepReport], *, dp: int, cp: int, wall_s: float) -> dict[str, Any]:
    """One line of metrics.jsonl from every rank's report of a step."""
    tokens = sum(r.num_tokens for r in reports)
    by_rank = sorted(reports, key=lambda r: r.rank)
    return {
        "step": by_rank[0].step,
        "loss": by_rank[0].loss,
        "lr": by_rank[0].lr,
        "grad_norm": by_rank[0].grad_norm,
        # Tokens attended (padding left out) and trained (a label with a loss: a chat dataset's
        # assistant turns, a window's every token but the last).
        "tokens": tokens,
        "trained_tokens": sum(r.trained_tokens for r in reports),
        "step_time_s": wall_s,
        "rank_step_time_s": [round(r.step_time_s, 6) for r in by_rank],
        # Each rank's time outside the step's collectives: a straggler's is the long one.
        "rank_compute_s": [round(r.compute_s, 6) for r in by_rank],
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "dp": dp,
        "cp": cp,
        "snapshot_step": min(r.snapshot_step for r in by_rank),
        "snapshot_s": max(r.snapshot_s for r in by_rank),
        "snapshot_bytes": sum(r.snapshot_bytes for r in by_rank),
        "rank_memory_bytes": [r.memory_bytes for r in by_rank],
        # The slowest rank's wait for its batches: what the step lost to data loading.
        "data_wait_s": max(r.data_wait_s for r in by_rank),
        # A preference objective's rewards and log-probs, the same on every rank.
        **by_rank[0].objective_metrics,
    }


def recovery_entry(incident: Incident) -> dict[str, Any]:
    keys = (
        "id", "kind", "ranks", "action", "detected_at_step", "detected_at", "detect_s",
        "recover_s", "lost_steps", "dp_before", "dp_after",
    )  # fmt: skip
    entry = {k: getattr(incident, k) for k in keys}
    entry["ranks"] = list(incident.ranks)
    return entry
