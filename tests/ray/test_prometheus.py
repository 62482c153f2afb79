"""A real Prometheus server scrapes a short run: every metric, and every dashboard query, has
data, and the scraped loss, step and counters are the run's own (metrics.jsonl, summary.json)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest

from ringtrain import metrics
from ringtrain.incidents import INCIDENT_KINDS
from ringtrain_dev.cli_runs import QUICKSTART, run_cli
from ringtrain_dev.ray_head import REPO, processes_using
from ringtrain_dev.tiny import TINY
from tests.tools import tool

from .test_run_e2e import ray_tmp  # noqa: F401  (fixture)

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def free_port() -> int:
    """A free loopback port outside Ray's worker port range (10002-19999)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not 10002 <= port <= 19999:
            return port
    raise RuntimeError("no free port outside 10002-19999")


def query_range(base: str, expr: str, start: float, end: float) -> list[Any]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": "1s"})
    with urllib.request.urlopen(f"{base}/api/v1/query_range?{params}", timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]["result"]


def raw_samples(base: str, selector: str, start: float, end: float) -> list[tuple[float, float]]:
    """Every sample Prometheus stored for ``selector`` between ``start`` and ``end``, as
    (scrape time, value) in time order: the scrapes themselves, not query_range's evaluation
    steps, which repeat the last sample for up to five minutes."""
    window = f"{int(end - start) + 1}s"
    params = urllib.parse.urlencode({"query": f"{selector}[{window}]", "time": end})
    with urllib.request.urlopen(f"{base}/api/v1/query?{params}", timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return sorted((float(t), float(v)) for series in body["data"]["result"] for t, v in series["values"])


def scraped_total(base: str, metric: metrics.Metric, run_id: str, start: float, end: float, **labels: str) -> float:
    """The highest value a counter-kind series of the run reached while it was scraped."""
    matchers = ",".join([f'run_id="{run_id}"', *(f'{k}="{v}"' for k, v in labels.items())])
    return max((v for _, v in raw_samples(base, f"{metric.exported}{{{matchers}}}", start, end)), default=-1.0)


def scrapes_read_by(base: str, start: float, end: float) -> dict[float, float]:
    """Each scrape's time -> when it had read the target's answer. Prometheus stamps a scrape's
    samples with the time it started; a value the run set while the scrape was in flight is in
    it, so what a sample shows was set by the scrape's end, its time plus its duration."""
    return {t: t + seconds for t, seconds in raw_samples(base, 'scrape_duration_seconds{job="ray"}', start, end)}


def match_records(samples: list[tuple[float, float]], read_by: dict[float, float], records: list[dict[str, Any]],
                  key: str) -> list[int]:
    """For each scraped (time, value), the newest line of metrics.jsonl written before that
    scrape read it whose ``key`` equals the value exactly; fails on a value no earlier line holds."""
    matched = []
    for t, value in samples:
        lines = [i for i, r in enumerate(records) if r["time"] <= read_by[t] and float(r[key]) == value]
        assert lines, f"scraped {key} {value!r} at {t:.3f} (read by {read_by[t]:.3f}) is no value metrics.jsonl held by then"
        matched.append(lines[-1])
    return matched


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, int]]:
    prometheus = tool("prometheus")
    metrics_port, web_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 500ms}\n"
        "scrape_configs:\n"
        "  - job_name: ray\n"
        "    honor_labels: true\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n"
    )
    proc = subprocess.Popen(
        [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{web_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{web_port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{base}/-/ready", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("prometheus did not become ready")
                time.sleep(0.2)
        yield base, metrics_port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def dashboard_queries() -> list[tuple[str, str]]:
    queries = []
    for path in sorted((REPO / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text()).get("panels", []):
            for target in panel.get("targets", []):
                if target.get("expr"):
                    queries.append((f"{path.stem}: {panel.get('title')}", target["expr"]))
    return queries


# Things for the counters to count: a NaN at step 12, retried (one incident, one recovery, no
# lost step), and an SDC probe round every 10 steps (steps 1, 10, 20, ..., 60).
NAN_STEP = 12
SDC_EVERY, STEPS = 10, 60
PROBE_STEPS = (1, *range(SDC_EVERY, STEPS + 1, SDC_EVERY))
COUNTED = [f"chaos.faults=[{{kind: nan, rank: 0, step: {NAN_STEP}}}]", "controllers.on_nan=retry",
           f"controllers.sdc_every_steps={SDC_EVERY}"]


def test_a_scraped_run_has_every_metric_and_every_dashboard_query_returns_data(
    tmp_path: Path, ray_tmp: Path, prometheus: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    base, metrics_port = prometheus
    # Ray's agent exports every 10 s by default, longer than the run's 60 tiny steps take: asked
    # to export every half second, and scraped as often, the run is seen at several steps.
    monkeypatch.setenv("RAY_metrics_report_interval_ms", "500")
    start = time.time()
    result = run_cli(
        [str(QUICKSTART), *TINY, f"train.steps={STEPS}", "checkpoint.persist_every=10", f"telemetry.metrics_port={metrics_port}",
         f"run_dir={tmp_path / 'run'}", *COUNTED],
        home=tmp_path,
        ray_tmp=ray_tmp,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    end = time.time() + 5
    run_id = json.loads((tmp_path / "run" / "summary.json").read_text())["run_id"]
    time.sleep(2)  # the last scrape before the run's cluster went away is already stored; let the TSDB head settle

    missing = [
        metric.exported
        for metric in metrics.ALL
        if not query_range(base, f'{metric.exported}{{job="quickstart",run_id="{run_id}"}}', start, end)
    ]
    assert missing == [], f"series never scraped: {missing}"
    run_dir = tmp_path / "run"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())

    # The scraped loss is the run's: each scrape shows, exactly, the loss of a step metrics.jsonl
    # had recorded by then, and the scrapes follow the run forward through several steps. A
    # constant, stale or made-up series matches no step or only one.
    read_by = scrapes_read_by(base, start, end)
    losses = raw_samples(base, f'ray_ringtrain_loss{{run_id="{run_id}"}}', start, end)
    by_loss = match_records(losses, read_by, records, "loss")
    assert by_loss == sorted(by_loss), "the scraped losses go back to earlier steps"
    assert len({records[i]["step"] for i in by_loss}) >= 3, f"the scrapes saw steps {sorted({records[i]['step'] for i in by_loss})}"
    by_step = match_records(raw_samples(base, f'ray_ringtrain_step{{run_id="{run_id}"}}', start, end), read_by, records,
                            "step")
    assert by_step == sorted(by_step) and len({records[i]["step"] for i in by_step}) >= 3

    # Counters against the run's own account. The NaN's counts settle mid-run, so the scrapes
    # after them must show the exact totals; the last probe round rides on the last step, which
    # the cluster's shutdown may beat to the next scrape.
    assert [(i["kind"], i["step"]) for i in summary["incidents"]] == [("nan", NAN_STEP)]
    by_kind = Counter(i["kind"] for i in summary["incidents"])
    for kind in INCIDENT_KINDS:
        assert scraped_total(base, metrics.INCIDENTS, run_id, start, end, kind=kind) == by_kind[kind], f"incidents of kind {kind}"
    assert scraped_total(base, metrics.RECOVERIES, run_id, start, end) == len(summary["recoveries"]) == 1
    assert scraped_total(base, metrics.LOST_STEPS, run_id, start, end) == sum(r["lost_steps"] for r in summary["recoveries"])
    # The last probe rounds ride on the last steps, which a fast machine runs, and the cluster's
    # shutdown ends, before the next export. The driver sets a round's count before the next
    # step's gauges, and each export carries all it set: a scrape that saw step N saw every
    # round before it.
    scans = summary["sdc"]["scans"]
    newest_seen = max(records[i]["step"] for i in by_step)
    before_it = sum(1 for step in PROBE_STEPS if step < newest_seen)
    assert scans == len(PROBE_STEPS) and before_it >= 3, f"the scrapes saw steps up to {newest_seen}"
    assert before_it <= scraped_total(base, metrics.SDC_PROBES, run_id, start, end) <= scans
    last_durable = query_range(base, f'max(ray_ringtrain_last_durable_step{{run_id="{run_id}"}})', start, end)
    assert max(float(v) for _, v in last_durable[0]["values"]) >= 10

    queries = dashboard_queries()
    assert queries, "dashboards/ holds no query"
    empty = []
    for title, expr in queries:
        concrete = re.sub(r"\$\{?job\}?", "quickstart", expr)
        concrete = re.sub(r"\$\{?run_id\}?", run_id, concrete)
        concrete = re.sub(r"\$\{?__rate_interval\}?", "5s", concrete)
        concrete = re.sub(r"\$\{?__interval\}?", "1s", concrete)
        if not query_range(base, concrete, start, end):
            empty.append(f"{title}: {concrete}")
    assert empty == [], "dashboard queries without data:\n" + "\n".join(empty)
    assert processes_using(ray_tmp) == []
