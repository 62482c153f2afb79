"""A real Prometheus server scrapes a short run: every metric, and every dashboard query, has data."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from ringtrain import metrics

from .test_run_e2e import QUICKSTART, REPO, TINY, processes_using, ray_tmp, run_cli  # noqa: F401  (fixture)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMETHEUS = shutil.which("prometheus")


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


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, int]]:
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (make tools installs Debian's package)")
    metrics_port, web_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: ray\n"
        "    honor_labels: true\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n"
    )
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
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


def test_a_scraped_run_has_every_metric_and_every_dashboard_query_returns_data(
    tmp_path: Path, ray_tmp: Path, prometheus: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    base, metrics_port = prometheus
    # Ray's agent exports every 10 s by default; a short test run needs it every second.
    monkeypatch.setenv("RAY_metrics_report_interval_ms", "1000")
    start = time.time()
    result = run_cli(
        [str(QUICKSTART), *TINY, "train.steps=40", "checkpoint.persist_every=10", f"telemetry.metrics_port={metrics_port}",
         f"run_dir={tmp_path / 'run'}"],
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
    losses = query_range(base, f'ray_ringtrain_loss{{run_id="{run_id}"}}', start, end)[0]["values"]
    assert float(losses[-1][1]) < float(losses[0][1]) + 1.0  # real values, not placeholders
    last_durable = query_range(base, f'max(ray_ringtrain_last_durable_step{{run_id="{run_id}"}})', start, end)
    assert max(float(v) for _, v in last_durable[0]["values"]) >= 10

    queries = dashboard_queries()
    if not queries:
        pytest.skip("no dashboards generated yet")
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
