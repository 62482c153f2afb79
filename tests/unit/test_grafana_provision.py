"""`ringtrain dashboards push` against an in-process fake of Grafana's HTTP API (grafana_fake.py).

The real grafana-client sends real HTTP requests; the fake stores what they create. A push
provisions the folder, the Prometheus data source, both dashboards and the alert rules; a second
push writes nothing and reports every object "unchanged"; drift is put back and reported
"updated"; bad credentials, an unreachable or silent server and bad flags end in one line.
"""

from __future__ import annotations

import argparse
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from grafana_fake import FakeGrafana

from ringtrain.commands import dashboards as dashboards_command
from ringtrain.telemetry import alerts, dashboards, grafana

TOKEN = "secret-token"
PROMETHEUS = "http://prometheus.monitoring:9090"
BOARD_UIDS = {"ringtrain-training", "ringtrain-reliability"}
RULE_UIDS = {rule.uid for rule in alerts.ALERT_RULES}


@pytest.fixture(autouse=True)
def no_credentials_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dashboards_command.TOKEN_ENV, raising=False)
    monkeypatch.delenv(dashboards_command.PASSWORD_ENV, raising=False)


@pytest.fixture
def fake() -> Iterator[FakeGrafana]:
    with FakeGrafana(token=TOKEN) as server:
        yield server


def push(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    dashboards_command.add_arguments(parser)
    return dashboards_command.run(parser.parse_args(["push", *argv]))


def push_to(fake: FakeGrafana, *argv: str) -> int:
    return push("--grafana-url", fake.url, "--token", TOKEN, "--timeout", "2", *argv)


def actions(out: str) -> dict[str, str]:
    """``{"dashboard ringtrain-training": "created", ...}`` from a push's report."""
    found = {}
    for line in out.splitlines():
        if not line.startswith("pushed to "):
            subject, _, action = line.rpartition(": ")
            found[subject] = action
    return found


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def test_push_provisions_folder_datasource_dashboards_and_alert_rules(fake: FakeGrafana, capsys: Any) -> None:
    assert push_to(fake, "--prometheus-url", PROMETHEUS) == 0

    assert {uid: f["title"] for uid, f in fake.folders.items()} == {"ringtrain": "ringtrain"}
    (source,) = fake.datasources.values()
    assert source["uid"] == grafana.DATASOURCE_UID and source["type"] == "prometheus"
    assert source["url"] == PROMETHEUS and source["access"] == "proxy"
    assert set(fake.dashboards) == BOARD_UIDS
    for name, build in dashboards.DASHBOARDS.items():
        entry = fake.dashboards[build()["uid"]]
        assert entry["folderUid"] == "ringtrain", name
        stored = {k: v for k, v in entry["dashboard"].items() if k not in ("id", "version")}
        generated = {k: v for k, v in build().items() if k not in ("id", "version")}
        assert stored["panels"] == generated["panels"]
        # The data source variable starts on the provisioned data source; the rest is as generated.
        assert stored["templating"]["list"][0]["current"]["value"] == grafana.DATASOURCE_UID
        assert stored["templating"]["list"][1:] == generated["templating"]["list"][1:]
    assert set(fake.alert_rules) == RULE_UIDS
    for rule in fake.alert_rules.values():
        assert rule["folderUID"] == "ringtrain" and rule["ruleGroup"] == "ringtrain"
        assert rule["data"][0]["datasourceUid"] == grafana.DATASOURCE_UID

    out = capsys.readouterr().out
    assert set(actions(out).values()) == {"created"} and len(actions(out)) == 2 + len(BOARD_UIDS) + len(RULE_UIDS)
    assert out.splitlines()[-1] == f"pushed to {fake.url}: 8 created, 0 updated, 0 unchanged"


def test_a_second_push_changes_nothing(fake: FakeGrafana, capsys: Any) -> None:
    assert push_to(fake, "--prometheus-url", PROMETHEUS) == 0
    before, writes = fake.state(), len(fake.writes())
    capsys.readouterr()

    assert push_to(fake, "--prometheus-url", PROMETHEUS) == 0
    assert fake.state() == before
    assert len(fake.writes()) == writes, "the second push wrote to Grafana"
    out = capsys.readouterr().out
    assert set(actions(out).values()) == {"unchanged"}
    assert out.splitlines()[-1].endswith(": 0 created, 0 updated, 8 unchanged")


def test_drift_is_put_back_and_reported_updated(fake: FakeGrafana, capsys: Any) -> None:
    assert push_to(fake, "--prometheus-url", PROMETHEUS) == 0
    before = fake.state()
    fake.datasources[grafana.DATASOURCE_UID]["url"] = "http://elsewhere:9090"
    fake.dashboards["ringtrain-training"]["dashboard"]["panels"][0]["title"] = "edited by hand"
    fake.alert_rules["ringtrain-low-goodput"]["data"][2]["model"]["conditions"][0]["evaluator"]["params"] = [0.5]
    fake.dashboards["ringtrain-reliability"]["folderUid"] = "General"
    capsys.readouterr()

    assert push_to(fake, "--prometheus-url", PROMETHEUS) == 0
    updated = {subject for subject, action in actions(capsys.readouterr().out).items() if action == "updated"}
    assert updated == {
        f"datasource {grafana.DATASOURCE_UID}",
        "dashboard ringtrain-training",
        "dashboard ringtrain-reliability",
        "alert rule ringtrain-low-goodput",
    }
    after = fake.state()
    assert after["datasources"][grafana.DATASOURCE_UID]["url"] == PROMETHEUS
    goodput = "ringtrain-low-goodput"
    assert after["alert_rules"][goodput]["data"] == before["alert_rules"][goodput]["data"]
    for uid in BOARD_UIDS:
        assert after["dashboards"][uid]["folderUid"] == "ringtrain"
        assert after["dashboards"][uid]["dashboard"]["panels"] == before["dashboards"][uid]["dashboard"]["panels"]


def test_without_prometheus_url_the_datasource_is_kept_or_created_local(fake: FakeGrafana) -> None:
    assert push_to(fake) == 0
    assert fake.datasources[grafana.DATASOURCE_UID]["url"] == grafana.DEFAULT_PROMETHEUS_URL
    fake.datasources[grafana.DATASOURCE_UID]["url"] = PROMETHEUS
    writes = len(fake.writes())
    assert push_to(fake) == 0
    assert fake.datasources[grafana.DATASOURCE_UID]["url"] == PROMETHEUS
    assert len(fake.writes()) == writes


def test_basic_auth_and_a_custom_folder(fake: FakeGrafana, capsys: Any) -> None:
    assert push(
        "--grafana-url", fake.url + "/", "--user", "admin", "--password", "admin-pw", "--folder", "ML Training"
    ) == 0
    assert fake.folders["ml-training"]["title"] == "ML Training"
    assert {entry["folderUid"] for entry in fake.dashboards.values()} == {"ml-training"}
    assert {rule["folderUID"] for rule in fake.alert_rules.values()} == {"ml-training"}


def test_token_from_the_environment(fake: FakeGrafana, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dashboards_command.TOKEN_ENV, TOKEN)
    assert push("--grafana-url", fake.url, "--timeout", "2") == 0
    assert set(fake.dashboards) == BOARD_UIDS


def test_a_wrong_token_fails_in_one_line_and_changes_nothing(fake: FakeGrafana, capsys: Any) -> None:
    assert push("--grafana-url", fake.url, "--token", "wrong", "--timeout", "2") == 1
    err = one_line(capsys.readouterr().err)
    assert err.startswith("ringtrain: dashboards push failed:")
    assert "rejected the credentials (HTTP 401)" in err and "--token" in err
    assert fake.state() == {"folders": {}, "datasources": {}, "dashboards": {}, "alert_rules": {}}
    assert fake.writes() == []


def test_a_refused_write_fails_in_one_line(fake: FakeGrafana, capsys: Any) -> None:
    fake.refuse_writes = 403
    assert push_to(fake) == 1
    err = one_line(capsys.readouterr().err)
    assert "failed to create folder ringtrain" in err and "403" in err


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_an_unreachable_grafana_fails_in_one_line(capsys: Any) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    start = time.monotonic()
    assert push("--grafana-url", url, "--token", TOKEN, "--timeout", "1") == 1
    assert time.monotonic() - start < 1.5
    err = one_line(capsys.readouterr().err)
    assert err == f"ringtrain: dashboards push failed: cannot reach Grafana at {url}: connection refused"


def test_a_silent_grafana_times_out_in_one_line(capsys: Any) -> None:
    # A socket that accepts connections and never answers.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        assert push("--grafana-url", url, "--token", TOKEN, "--timeout", "0.3") == 1
        assert time.monotonic() - start < 1.5
    err = one_line(capsys.readouterr().err)
    assert f"Grafana at {url} did not answer within 0.3 s" in err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        ([], "--grafana-url"),
        (["--grafana-url", "grafana:3000"], "--grafana-url"),
        (["--grafana-url", "ftp://grafana"], "--grafana-url"),
        (["--grafana-url", "http://grafana:port"], "--grafana-url"),
        (["--grafana-url", "http://admin:pw@grafana:3000"], "--grafana-url"),
        (["--grafana-url", "http://grafana:3000"], "--token"),
        (["--grafana-url", "http://grafana:3000", "--token", "t", "--user", "u", "--password", "p"], "--token"),
        (["--grafana-url", "http://grafana:3000", "--user", "u"], "--password"),
        (["--grafana-url", "http://grafana:3000", "--password", "p"], "--user"),
        (["--grafana-url", "http://grafana:3000", "--token", "t", "--timeout", "soon"], "--timeout"),
        (["--grafana-url", "http://grafana:3000", "--token", "t", "--timeout", "0"], "--timeout"),
        (["--grafana-url", "http://grafana:3000", "--token", "t", "--prometheus-url", "prom"], "--prometheus-url"),
        (["--grafana-url", "http://grafana:3000", "--token", "t", "--folder", " / "], "--folder"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(argv: list[str], flag: str, capsys: Any) -> None:
    assert push(*argv) == 2
    assert one_line(capsys.readouterr().err).startswith(f"ringtrain: config error: {flag}:")


def test_folder_uids_follow_grafana_rules() -> None:
    assert grafana.folder_uid("ringtrain") == "ringtrain"
    assert grafana.folder_uid("ML Training / Long context") == "ml-training-long-context"
    assert len(grafana.folder_uid("x" * 100)) == grafana.FOLDER_UID_LENGTH


def test_contains_ignores_fields_grafana_adds() -> None:
    wanted = {"a": 1, "b": {"c": [1, {"d": 2}]}}
    assert grafana.contains({"a": 1, "id": 7, "b": {"c": [1, {"d": 2, "e": 3}]}}, wanted)
    assert not grafana.contains({"a": 1, "b": {"c": [1]}}, wanted)
    assert not grafana.contains({"a": 2, "b": {"c": [1, {"d": 2}]}}, wanted)


def test_a_grafana_under_a_sub_path() -> None:
    with FakeGrafana(token=TOKEN, sub_path="/grafana") as fake:
        assert push_to(fake) == 0
        assert set(fake.dashboards) == BOARD_UIDS
        assert all(path.startswith("/grafana/api/") for _, path in fake.requests)
