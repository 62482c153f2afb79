"""ringtrain's Grafana-managed alert rules, and the body the provisioning API takes for one.

The rules watch every run, so they use no template variables and group by the run. Every
expression is written from ``Metric.exported``, as the dashboards' are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ringtrain import metrics as m

Json = dict[str, Any]

EXPRESSION_DATASOURCE = "__expr__"
RULE_GROUP = "ringtrain"
# Goodput below this is worth a look (the Helm chart's PrometheusRule uses the same default).
LOW_GOODPUT = 0.8


def _running() -> str:
    # A finished run reports 0 tokens/s and must stay quiet.
    return f"(max by (job, run_id) ({m.TOKENS_PER_SECOND.exported}) > 0)"


@dataclass(frozen=True)
class AlertRule:
    uid: str
    title: str
    expr: str
    # The rule fires when the expression's value is `op` (gt or lt) `threshold`.
    op: Literal["gt", "lt"]
    threshold: float
    pending: str
    severity: str
    summary: str
    description: str


def _sdc_failures(window: str) -> str:
    failures = m.SDC_FAILURES.exported
    # A series younger than the window counts with its whole value: increase() needs two samples.
    return f"sum by (job, run_id) (({failures} unless {failures} offset {window}) or increase({failures}[{window}]))"


def _alert_rules() -> tuple[AlertRule, ...]:
    loss = m.LOSS.exported
    run = "Run {{ $labels.run_id }} of job {{ $labels.job }}"
    return (
        AlertRule(
            "ringtrain-no-progress",
            "ringtrain: no progress",
            f"max by (job, run_id) (changes({m.STEP.exported}[15m])) and on (job, run_id) {_running()}",
            "lt",
            1,
            "2m",
            "critical",
            "Training makes no progress",
            f"{run} has not completed a step in 15m although it has not finished. Look for a hang "
            "report in the run's logs, or a worker that is stuck starting.",
        ),
        AlertRule(
            "ringtrain-loss-not-finite",
            "ringtrain: loss not finite",
            # NaN is the one value not equal to itself.
            f"count by (job, run_id) ({loss} != {loss} or abs({loss}) == +Inf)",
            "gt",
            0,
            "1m",
            "critical",
            "Training loss is NaN or infinite",
            f"{run} reports a loss that is not finite: training diverged or a rank computes "
            "corrupt values. Roll back to the last good checkpoint and lower the learning rate, "
            "or look for an SDC alert.",
        ),
        AlertRule(
            "ringtrain-low-goodput",
            "ringtrain: low goodput",
            f"max by (job, run_id) ({m.GOODPUT.exported}) and on (job, run_id) {_running()}",
            "lt",
            LOW_GOODPUT,
            "30m",
            "warning",
            "Training goodput is low",
            f"{run} spends less than {LOW_GOODPUT:.0%} of its time on steps that were kept: recoveries, "
            "restarts or slow ranks eat the rest.",
        ),
        AlertRule(
            "ringtrain-sdc-detected",
            "ringtrain: silent data corruption",
            _sdc_failures("30m"),
            "gt",
            0,
            "0s",
            "critical",
            "Silent data corruption detected",
            f"{run} failed a silent-data-corruption probe in the last 30m. The corrupt rank was "
            "evicted and training rolled back; drain and test its host's GPU.",
        ),
    )


ALERT_RULES = _alert_rules()


def alert_rule(rule: AlertRule, datasource_uid: str, folder_uid: str) -> Json:
    """``rule`` in the body Grafana's alerting provisioning API takes: query A, reduce B, threshold C."""
    expression_source = {"type": EXPRESSION_DATASOURCE, "uid": EXPRESSION_DATASOURCE}
    no_range = {"from": 0, "to": 0}
    return {
        "uid": rule.uid,
        "title": rule.title,
        "folderUID": folder_uid,
        "ruleGroup": RULE_GROUP,
        "condition": "C",
        "data": [
            {
                "refId": "A",
                "relativeTimeRange": {"from": 600, "to": 0},
                "datasourceUid": datasource_uid,
                "model": {
                    "refId": "A",
                    "datasource": {"type": "prometheus", "uid": datasource_uid},
                    "expr": rule.expr,
                    "instant": True,
                    "range": False,
                },
            },
            {
                "refId": "B",
                "relativeTimeRange": no_range,
                "datasourceUid": EXPRESSION_DATASOURCE,
                "model": {
                    "refId": "B",
                    "datasource": expression_source,
                    "type": "reduce",
                    "expression": "A",
                    "reducer": "last",
                },
            },
            {
                "refId": "C",
                "relativeTimeRange": no_range,
                "datasourceUid": EXPRESSION_DATASOURCE,
                "model": {
                    "refId": "C",
                    "datasource": expression_source,
                    "type": "threshold",
                    "expression": "B",
                    "conditions": [{"evaluator": {"type": rule.op, "params": [rule.threshold]}}],
                },
            },
        ],
        # No series means no running run (or no corrupt one): nothing to alert on.
        "noDataState": "OK",
        "execErrState": "Error",
        "for": rule.pending,
        "labels": {"severity": rule.severity},
        "annotations": {"summary": rule.summary, "description": rule.description},
        "isPaused": False,
    }
