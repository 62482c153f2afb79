"""ringtrain's Grafana dashboards, built from the metric registry with fixed uids.

``DASHBOARDS`` maps each checked-in file name to the function that builds its dashboard JSON
(``telemetry.panels`` holds the building blocks; the alert rules are ``telemetry.alerts``).
Every expression is written from ``Metric.exported``, so a renamed metric breaks here, at build
time, not on a live panel.
"""

from __future__ import annotations

from collections.abc import Callable

from ringtrain import metrics as m
from ringtrain.telemetry.alerts import LOW_GOODPUT
from ringtrain.telemetry.panels import Json, Query, Row, dashboard, graph, per_run, stat

TRAINING_UID = "ringtrain-training"


RELIABILITY_UID = "ringtrain-reliability"


def training() -> Json:
    step_time = Query(per_run(m.STEP_TIME, "rank"), "{{run_id}} rank {{rank}}")
    memory = Query(per_run(m.MEMORY_BYTES, "rank"), "{{run_id}} rank {{rank}}")
    world = f"{per_run(m.DP_SIZE)} * {per_run(m.CP_SIZE)}"
    rows = [
        Row(
            4,
            (
                stat("Step", per_run(m.STEP), m.STEP.help, decimals=0),
                stat("Loss", per_run(m.LOSS), m.LOSS.help, decimals=3),
                stat("Tokens/s", per_run(m.TOKENS_PER_SECOND), m.TOKENS_PER_SECOND.help),
                stat(
                    "MFU",
                    per_run(m.MFU),
                    m.MFU.help,
                    unit="percentunit",
                    decimals=1,
                    thresholds=((None, "red"), (0.2, "orange"), (0.35, "green")),
                ),
                stat("DP replicas", per_run(m.DP_SIZE), m.DP_SIZE.help, decimals=0),
                stat("CP degree", per_run(m.CP_SIZE), m.CP_SIZE.help, decimals=0),
            ),
        ),
        Row(
            8,
            (
                graph("Loss", [Query(per_run(m.LOSS))], m.LOSS.help),
                graph("Tokens/s", [Query(per_run(m.TOKENS_PER_SECOND))], m.TOKENS_PER_SECOND.help, min=0),
            ),
        ),
        Row(
            8,
            (
                graph("MFU", [Query(per_run(m.MFU))], m.MFU.help, unit="percentunit", min=0, max=1),
                graph("Step time by rank", [step_time], m.STEP_TIME.help, unit="s", min=0),
            ),
        ),
        Row(
            8,
            (
                graph(
                    "DP and CP over time",
                    [
                        Query(per_run(m.DP_SIZE), "dp {{run_id}}"),
                        Query(per_run(m.CP_SIZE), "cp {{run_id}}"),
                        Query(world, "GPUs {{run_id}}"),
                    ],
                    "Data-parallel replicas, context-parallel degree, and their product (GPUs in use)",
                    decimals=0,
                    min=0,
                    stepped=True,
                ),
                graph("Memory by rank", [memory], m.MEMORY_BYTES.help, unit="bytes", min=0),
            ),
        ),
    ]
    return dashboard(
        TRAINING_UID,
        "ringtrain / training",
        "Loss, throughput, MFU, per-rank step time and memory, and the mesh of ringtrain runs",
        rows,
    )


def reliability() -> Json:
    steps_at_risk = f"{per_run(m.STEP)} - {per_run(m.LAST_DURABLE_STEP)}"
    rows = [
        Row(
            4,
            (
                stat(
                    "Goodput",
                    per_run(m.GOODPUT),
                    m.GOODPUT.help,
                    unit="percentunit",
                    decimals=1,
                    thresholds=((None, "red"), (LOW_GOODPUT, "orange"), (0.9, "green")),
                ),
                stat("Time to recover (last)", per_run(m.RECOVERY_SECONDS), m.RECOVERY_SECONDS.help, unit="s"),
                stat("Recoveries", per_run(m.RECOVERIES), m.RECOVERIES.help, decimals=0),
                stat(
                    "Lost steps",
                    per_run(m.LOST_STEPS),
                    m.LOST_STEPS.help,
                    decimals=0,
                    thresholds=((None, "green"), (1, "orange")),
                ),
                stat(
                    "SDC failures",
                    per_run(m.SDC_FAILURES),
                    m.SDC_FAILURES.help,
                    decimals=0,
                    thresholds=((None, "green"), (1, "red")),
                ),
                stat(
                    "Hang verdicts",
                    per_run(m.HANG_VERDICTS),
                    m.HANG_VERDICTS.help,
                    decimals=0,
                    thresholds=((None, "green"), (1, "orange")),
                ),
            ),
        ),
        Row(
            8,
            (
                graph(
                    "Incidents by kind",
                    [Query(per_run(m.INCIDENTS, "kind"), "{{kind}} {{run_id}}")],
                    m.INCIDENTS.help + ", running totals",
                    decimals=0,
                    min=0,
                    stepped=True,
                ),
                graph("Goodput", [Query(per_run(m.GOODPUT))], m.GOODPUT.help, unit="percentunit", min=0, max=1),
            ),
        ),
        Row(
            8,
            (
                graph(
                    "Time to recover (MTTR)",
                    [Query(per_run(m.RECOVERY_SECONDS))],
                    m.RECOVERY_SECONDS.help,
                    unit="s",
                    min=0,
                    stepped=True,
                ),
                graph(
                    "Recoveries and lost steps",
                    [
                        Query(per_run(m.RECOVERIES), "recoveries {{run_id}}"),
                        Query(per_run(m.LOST_STEPS), "lost steps {{run_id}}"),
                    ],
                    "Recoveries completed and completed steps redone after incidents, running totals",
                    decimals=0,
                    min=0,
                    stepped=True,
                ),
            ),
        ),
        Row(
            8,
            (
                graph(
                    "Snapshot and persist latency",
                    [
                        Query(per_run(m.SNAPSHOT_SECONDS), "snapshot {{run_id}}"),
                        Query(per_run(m.PERSIST_SECONDS), "persist {{run_id}}"),
                    ],
                    "Latency of the last in-memory snapshot (off the critical path) and of the last "
                    "durable checkpoint write",
                    unit="s",
                    min=0,
                    width=8,
                ),
                graph(
                    "Snapshot size",
                    [Query(per_run(m.SNAPSHOT_BYTES))],
                    m.SNAPSHOT_BYTES.help,
                    unit="bytes",
                    min=0,
                    width=8,
                ),
                graph(
                    "Last durable step vs current step",
                    [
                        Query(per_run(m.STEP), "step {{run_id}}"),
                        Query(per_run(m.LAST_DURABLE_STEP), "durable {{run_id}}"),
                        Query(steps_at_risk, "at risk {{run_id}}"),
                    ],
                    "The last completed step, the newest step in the durable store, and the steps "
                    "a loss of the whole cluster would cost",
                    decimals=0,
                    min=0,
                    stepped=True,
                    width=8,
                ),
            ),
        ),
        Row(
            8,
            (
                graph(
                    "SDC probes and failures",
                    [
                        Query(per_run(m.SDC_PROBES), "probes {{run_id}}"),
                        Query(per_run(m.SDC_FAILURES), "failures {{run_id}}"),
                    ],
                    "Silent-data-corruption probe rounds run and rounds that found a mismatch, "
                    "running totals",
                    decimals=0,
                    min=0,
                    stepped=True,
                ),
                graph(
                    "Hang verdicts",
                    [Query(per_run(m.HANG_VERDICTS))],
                    m.HANG_VERDICTS.help + ", running total",
                    decimals=0,
                    min=0,
                    stepped=True,
                ),
            ),
        ),
        Row(
            8,
            (
                graph(
                    "Rank slowdown (stragglers)",
                    [Query(per_run(m.RANK_SLOWDOWN, "rank"), "{{run_id}} rank {{rank}}")],
                    m.RANK_SLOWDOWN.help + "; controllers.straggler_factor marks a straggler",
                    decimals=2,
                    min=0,
                    width=24,
                ),
            ),
        ),
    ]
    return dashboard(
        RELIABILITY_UID,
        "ringtrain / reliability",
        "Incidents, recoveries, goodput, checkpoints and corruption probes of ringtrain runs",
        rows,
    )


DASHBOARDS: dict[str, Callable[[], Json]] = {"training.json": training, "reliability.json": reliability}
