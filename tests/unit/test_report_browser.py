"""report.html in headless Chromium, opened from disk: no console errors, no network, charts drawn.

``render_in_chromium`` is also what the end-to-end test (tests/ray/test_report_e2e.py) opens
a real run's report with. Screenshots go to the test's tmp_path and to
.ringtrain-cache/artifacts/ (git-ignored), to look at after a run.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pytest

from ringtrain import config
from ringtrain.telemetry.report import write_report
from ringtrain_dev.fake_run import FAILED_SUMMARY, write_run_dir
from tests.tools import tool

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / ".ringtrain-cache" / "artifacts"
# Root in a container needs --no-sandbox; the rest keep Chromium from calling home, which a
# closed network answers with errors that are not the page's.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
CHARTS = ("loss", "throughput", "step-time", "timeline", "checkpoint", "goodput", "durable", "lr", "grad-norm", "mfu")
# What the page exposes to the test: each chart's polylines (points, drawn width), incidents.
PAGE_STATE = """() => ({
  charts: Object.fromEntries([...document.querySelectorAll('figure.chart')].map(f => [
    f.id.replace('chart-', ''),
    [...f.querySelectorAll('polyline')].map(p => [p.points.numberOfItems, p.getBBox().width]),
  ])),
  markers: document.querySelectorAll('svg a.marker').length,
  incidents: [...document.querySelectorAll('article.incident')].map(a => a.innerText),
  incidentRows: [...document.querySelectorAll('table.incidents tbody tr')].map(r => r.innerText),
  status: document.querySelector('h1 .status').textContent,
  warnings: [...document.querySelectorAll('#warnings li')].map(li => li.textContent),
})"""


@dataclass
class Rendered:
    errors: list[str]  # console errors and warnings, uncaught exceptions, failed loads
    requests: list[str]  # every URL the page asked for
    state: dict[str, Any]  # PAGE_STATE's answer
    screenshot: Path


def render_in_chromium(report: Path, screenshot: Path) -> Rendered:
    """Open ``report`` as a file:// URL in headless Chromium; a full-page screenshot to ``screenshot``."""
    chromium = tool("chromium")
    from playwright.sync_api import ConsoleMessage, sync_playwright

    errors: list[str] = []
    requests: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        if message.type in ("error", "warning"):
            errors.append(f"console {message.type}: {message.text}")

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", on_console)
            page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
            page.on("request", lambda request: requests.append(request.url))
            page.on("requestfailed", lambda request: errors.append(f"failed to load {request.url}"))
            page.goto(report.resolve().as_uri(), wait_until="load")
            state = page.evaluate(PAGE_STATE)
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(screenshot, ARTIFACTS / screenshot.name)
    return Rendered(errors, requests, state, screenshot)


def assert_drawn(
    rendered: Rendered, report: Path, *, num_ranks: int, drawn: Sequence[str] = CHARTS, charts_shown: Sequence[str] = CHARTS
) -> None:
    """The page loaded only itself, logged no error, showed ``charts_shown`` and drew lines with
    points in the ``drawn`` ones."""
    assert rendered.errors == []
    assert rendered.requests == [report.resolve().as_uri()]
    charts = rendered.state["charts"]
    assert set(charts) == set(charts_shown)
    for name in drawn:
        assert charts[name], f"chart {name} has no line"
        assert all(points >= 2 and width > 0 for points, width in charts[name]), (name, charts[name])
    assert len(charts["step-time"]) == num_ranks + 1  # a line per rank, and the controller's step time
    assert rendered.screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failed_run_with_a_nan_incident_renders_in_chromium(tmp_path: Path) -> None:
    job = config.load(REPO / "jobs" / "quickstart.yaml", ["train.steps=6", f"run_dir={tmp_path / 'run'}"])
    run_dir = write_run_dir(tmp_path / "run", config_yaml=config.to_yaml(job), summary=FAILED_SUMMARY)
    report, warnings = write_report(run_dir)
    assert warnings == []

    rendered = render_in_chromium(report, tmp_path / "report-nan-synthetic.png")

    assert_drawn(rendered, report, num_ranks=4)
    state = rendered.state
    assert state["status"] == "failed" and state["warnings"] == []
    assert state["markers"] == len(CHARTS)  # the incident is marked on every chart
    (row,) = state["incidentRows"]
    assert row.split("\t")[:5] == ["1", "nan", "3", "1", "abort"]
    (detail,) = state["incidents"]
    assert "Incident 1: nan" in detail and "culprit rank\t1" in detail and "loss.backward()" in detail
