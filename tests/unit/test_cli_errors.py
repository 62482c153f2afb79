"""`ringtrain run` on bad input: exit 2, one stderr line naming the key, no traceback, no cluster.

Every case here is caught before Ray or torch is imported. The subprocesses run with stand-in
``torch``, ``ray`` and ``deepspeed`` packages first on ``sys.path`` that fail on import, so a
check that moved behind a cluster start (or a heavy import) fails these tests instead of
silently making them slow.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLATFORM = REPO / "platform"
QUICKSTART = REPO / "jobs" / "quickstart.yaml"
HEAVY_MODULES = ("torch", "ray", "deepspeed")


def _poison(root: Path) -> Path:
    """A folder of packages that stand in for the heavy modules and refuse to be imported."""
    poison = root / "poison"
    for name in HEAVY_MODULES:
        (poison / name).mkdir(parents=True)
        message = f"{name} imported before the input was checked"
        (poison / name / "__init__.py").write_text(f"raise ImportError({message!r})\n")
    return poison


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    home = tmp_path / "home"
    home.mkdir()
    env["HOME"] = str(home)
    env["RAY_AUTH_MODE"] = "disabled"
    paths = [str(_poison(tmp_path)), str(PLATFORM)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _run(tmp_path: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return subprocess.run(
        [sys.executable, "-m", "ringtrain", *args],
        cwd=cwd,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_stand_in_heavy_modules_do_refuse_import(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import torch"], env=_env(tmp_path), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert "torch imported before the input was checked" in proc.stderr


def _write_invalid_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "broken.yaml"
    path.write_text("name: broken\nmesh: {dp: [2\n")
    return path


JOBS = {
    "quickstart": lambda tmp_path: QUICKSTART,
    "missing": lambda tmp_path: tmp_path / "missing-job.yaml",
    "invalid-yaml": _write_invalid_yaml,
}


@pytest.mark.parametrize(
    ("job", "overrides", "expected"),
    [
        pytest.param("quickstart", ["model.bogus=1"], ("model.bogus", "unknown key"), id="unknown-key"),
        pytest.param("quickstart", ["mesh.dp=abc"], ("mesh.dp",), id="bad-type"),
        pytest.param("quickstart", ["data.seq_len=1026"], ("data.seq_len", "mesh.cp"), id="seq-len-vs-cp"),
        pytest.param(
            "quickstart",
            ["attention.impl=ulysses", "mesh.cp=8"],
            ("mesh.ulysses", "model.n_heads"),
            id="heads-vs-ulysses",
        ),
        pytest.param("quickstart", ["train.global_batch=3"], ("train.global_batch",), id="global-batch-vs-dp"),
        pytest.param("quickstart", ["data.path=/nonexistent/x"], ("data.path", "/nonexistent/x"), id="missing-data"),
        pytest.param("missing", [], ("config", "missing-job.yaml"), id="missing-job-file"),
        pytest.param("invalid-yaml", [], ("config", "not valid YAML"), id="invalid-yaml"),
        pytest.param("quickstart", ["mesh.dp"], ("mesh.dp", "key=value"), id="malformed-override"),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_the_key(
    tmp_path: Path, job: str, overrides: list[str], expected: tuple[str, ...]
) -> None:
    job_path = JOBS[job](tmp_path)
    run_dir = tmp_path / "run"

    proc = _run(tmp_path, ["run", str(job_path), *overrides, f"run_dir={run_dir}"])

    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ringtrain: config error: ")
    for text in expected:
        assert text in lines[0]
    assert not run_dir.exists()
    assert not any((tmp_path / "cwd").iterdir())  # no default runs/ folder either


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["eval", "runs/x", "--seq", "2048"], id="eval-seq-len"),
        pytest.param(["status", "--addr", "http://127.0.0.1:1"], id="status-address"),
        pytest.param(["dashboards", "push", "--grafana", "http://127.0.0.1:1"], id="dashboards-push-grafana-url"),
    ],
)
def test_a_prefix_of_a_flag_is_refused_naming_it(tmp_path: Path, args: list[str]) -> None:
    # Flags match only as spelled: a renamed flag fails the commands and pages still using the
    # old name, instead of the old name quietly matching as a prefix of the new one.
    proc = _run(tmp_path, args)
    assert proc.returncode == 2, proc.stderr
    assert f"unrecognized arguments: {args[-2]}" in proc.stderr
    assert "Traceback" not in proc.stderr
