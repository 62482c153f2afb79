"""What `ringtrain submit` ships as the job's working_dir, and how it finds the token and warns
about plain http: checked without a cluster (tests/ray/test_submit.py submits to a real one)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ringtrain import config
from ringtrain.errors import ConfigError
from ringtrain.submission import auth_headers, plain_http_warning, resolve_token
from ringtrain.submission_files import listing, shipped_inputs, working_dir

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "jobs" / "quickstart.yaml"


def job_folder(root: Path) -> Path:
    """A job file among files a submission must not ship, and the inputs it may name."""
    root.mkdir()
    job = root / "job.yaml"
    job.write_text(QUICKSTART.read_text())
    (root / ".env").write_text("AWS_SECRET_ACCESS_KEY=x\n")
    (root / ".aws").mkdir()
    (root / ".aws" / "credentials").write_text("[default]\n")
    (root / "notes.md").write_text("not declared\n")
    (root / "data" / "sub").mkdir(parents=True)
    (root / "data" / "a.txt").write_text("a")
    (root / "data" / "sub" / "b.txt").write_text("b")
    (root / "data" / ".hidden").write_text("h")
    (root / "data" / ".git").mkdir()
    (root / "data" / ".git" / "config").write_text("g")
    (root / "data" / "__pycache__").mkdir()
    (root / "data" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (root / "eval.txt").write_text("e")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text("{}")
    return job


def shipped(job: Path, overrides: list[str]) -> list[str]:
    with working_dir(job, config.load(job, overrides)) as folder:
        assert (folder.stat().st_mode & 0o777) == 0o700
        return listing(folder)


def test_only_the_job_file_ships_when_it_declares_no_local_input(tmp_path: Path) -> None:
    job = job_folder(tmp_path / "job")
    assert shipped(job, []) == ["job.yaml"]  # data.path=stdlib: nothing to ship


def test_declared_relative_inputs_ship_without_hidden_files_or_leftovers(tmp_path: Path) -> None:
    job = job_folder(tmp_path / "job")
    files = shipped(job, ["data.path=data", "eval.data=./eval.txt"])
    assert files == ["data/a.txt", "data/sub/b.txt", "eval.txt", "job.yaml"]


def test_the_folder_is_removed_once_submitted(tmp_path: Path) -> None:
    job = job_folder(tmp_path / "job")
    with working_dir(job, config.load(job, ["data.path=data"])) as folder:
        assert folder.is_dir()
    assert not folder.exists()
    assert (job.parent / "data" / "a.txt").read_text() == "a"  # hard links: the originals stay


def test_absolute_paths_and_uris_are_the_clusters_and_are_not_shipped(tmp_path: Path) -> None:
    job = job_folder(tmp_path / "job")
    overrides = [f"data.path={tmp_path / 'job' / 'data'}", "eval.data=s3://bucket/eval"]
    assert shipped(job, overrides) == ["job.yaml"]


@pytest.mark.parametrize(
    ("override", "key", "reason"),
    [
        ("data.path=.env", "data.path", "hidden"),
        ("data.path=.aws/credentials", "data.path", "hidden"),
        ("data.path=data/.hidden", "data.path", "hidden"),
        ("data.path=../secrets", "data.path", "leaves the job file's folder"),
        ("eval.data=data/../../x", "eval.data", "leaves the job file's folder"),
        ("data.path=missing", "data.path", "does not exist"),
        ("model.hf=nope", "model.hf", "does not exist"),
    ],
)
def test_inputs_that_cannot_ship_are_refused_naming_the_key(tmp_path: Path, override: str, key: str, reason: str) -> None:
    job = job_folder(tmp_path / "job")
    with pytest.raises(ConfigError) as caught:
        shipped_inputs(job, config.load(job, [override]))
    assert caught.value.key == key and reason in caught.value.reason


def test_a_link_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    """A link would ship its target: ``data/creds -> ~/.aws/credentials`` is refused."""
    outside = tmp_path / "home" / ".aws"
    outside.mkdir(parents=True)
    (outside / "credentials").write_text("secret")
    job = job_folder(tmp_path / "job")
    os.symlink(outside / "credentials", job.parent / "data" / "creds")
    with pytest.raises(ConfigError, match=r"data\.path: .*creds links to .*outside the job file's folder"):
        shipped_inputs(job, config.load(job, ["data.path=data"]))
    (job.parent / "data" / "creds").unlink()
    os.symlink(job.parent / "data" / "a.txt", job.parent / "data" / "same.txt")  # inside: fine
    assert "data/same.txt" in shipped(job, ["data.path=data"])


def test_the_token_is_the_flag_then_ray_auth_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    assert resolve_token(None) is None
    monkeypatch.setenv("RAY_AUTH_TOKEN", " from-env\n")
    assert resolve_token(None) == "from-env"
    assert resolve_token("from-flag") == "from-flag"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "")
    assert resolve_token(None) is None
    assert auth_headers("t") == {"Authorization": "Bearer t"}
    assert auth_headers(None) == {}


@pytest.mark.parametrize(
    ("address", "warns"),
    [
        ("http://127.0.0.1:8265", False),
        ("http://localhost:8265", False),
        ("http://[::1]:8265", False),
        ("127.0.0.1:6379", False),
        ("auto", False),
        ("https://ray.example.com", False),
        ("http://10.0.0.5:8265", True),
        ("http://ray-head.ml.svc:8265", True),
        ("10.0.0.5:6379", True),
    ],
)
def test_plain_http_off_this_machine_is_warned_about(address: str, warns: bool) -> None:
    warning = plain_http_warning(address, sends_token=True)
    assert (warning is not None) == warns
    if warning:
        assert address in warning and "token" in warning and "https://" in warning


def test_the_command_prints_the_warning_before_it_connects(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from ringtrain import cli
    from ringtrain.commands import jobs as submission_command
    from ringtrain.errors import ClusterError

    def unreachable(address: str, token: object = None) -> None:
        raise ClusterError(f"cannot reach the Ray job API at {address}")

    monkeypatch.setattr(submission_command, "JobsClient", unreachable)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t")
    assert cli.main(["status", "--address", "http://10.0.0.5:8265"]) == 1
    first, second = capsys.readouterr().err.splitlines()
    assert first.startswith("ringtrain: warning: http://10.0.0.5:8265 is plain http to another machine: the token")
    assert second == "ringtrain: error: cannot reach the Ray job API at http://10.0.0.5:8265"
