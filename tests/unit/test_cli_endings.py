"""How a command ends on an error: one table (``errors.ending``) gives every verb its exit code
and its one stderr line, whether ``cli.main`` or the verb itself (``ringtrain report``) says it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

import pytest

from ringtrain import cli
from ringtrain.commands import jobs as submission_command
from ringtrain.commands import report as report_command
from ringtrain.errors import CapacityError, ClusterError, ConfigError, DataError, RingtrainError
from ringtrain.submission import TokenRefused, UnknownJobError

UNKNOWN_JOB = "no job ringtrain-x-0000000000 on http://127.0.0.1:1 (`ringtrain status` lists them)"
NO_TOKEN = "the Ray job API at http://127.0.0.1:1 requires a token: pass --token-file"


def _s3_failure() -> BaseException:
    from botocore.exceptions import NoCredentialsError

    return NoCredentialsError()


ENDINGS = {
    "config": (lambda: ConfigError("mesh.dp", "must be >= 1"), 2, "ringtrain: config error: mesh.dp: must be >= 1"),
    "capacity": (lambda: CapacityError("mesh.dp", "needs 8 GPUs"), 2, "ringtrain: config error: mesh.dp: needs 8 GPUs"),
    "data": (lambda: DataError("a.jsonl:2: malformed JSON"), 2, "ringtrain: data error: a.jsonl:2: malformed JSON"),
    "failed": (lambda: ClusterError("cannot reach ray://head:10001"), 1, "ringtrain: error: cannot reach ray://head:10001"),
    "unknown-job": (lambda: UnknownJobError(UNKNOWN_JOB), 2, f"ringtrain: {UNKNOWN_JOB}"),
    "token-refused": (lambda: TokenRefused(NO_TOKEN), 2, f"ringtrain: {NO_TOKEN}"),
    "interrupted": (KeyboardInterrupt, 130, "ringtrain: interrupted"),
    "s3": (_s3_failure, 1, "ringtrain: error: S3: no AWS credentials were found"),
}


def _raising(exc: BaseException) -> cli.Verb:
    def run(args: argparse.Namespace, argv: Optional[Sequence[str]]) -> int:
        raise exc

    return cli.Verb("raises", report_command.add_arguments, run)


@pytest.mark.parametrize("name", ENDINGS)
def test_an_error_a_verb_raises_ends_the_command_by_its_class(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    make, code, line = ENDINGS[name]
    monkeypatch.setitem(cli.VERBS, "report", _raising(make()))
    assert cli.main(["report", "runs/x"]) == code
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(line), err


def test_an_error_no_one_raised_on_purpose_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cli.VERBS, "report", _raising(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        cli.main(["report", "runs/x"])


@pytest.mark.parametrize("name", ["unknown-job", "token-refused", "failed", "interrupted"])
def test_the_job_verbs_end_as_every_verb_does(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """submit, status, logs and stop: what the cluster answers ends them through the same table."""
    make, code, line = ENDINGS[name]

    def refused(address: str, token: object = None) -> None:
        raise make()

    monkeypatch.setattr(submission_command, "JobsClient", refused)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t")
    assert cli.main(["logs", "ringtrain-x-0000000000", "--address", "http://127.0.0.1:1"]) == code
    assert capsys.readouterr().err == line + "\n"


@pytest.mark.parametrize(
    ("raised", "code", "line"),
    [
        (ConfigError("RUN_DIR", "runs/x/config.yaml leads through a link"), 2,
         "ringtrain: report: RUN_DIR: runs/x/config.yaml leads through a link"),
        (PermissionError(13, "Permission denied", "runs/x/report.html.tmp"), 1,
         "ringtrain: report: cannot write runs/x/report.html: [Errno 13] Permission denied: 'runs/x/report.html.tmp'"),
        (RingtrainError("a failure"), 1, "ringtrain: report: a failure"),
    ],
)  # fmt: skip
def test_report_names_itself_in_the_same_ending(
    raised: BaseException, code: int, line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    def write_report(run_dir: Path) -> tuple[Path, list[str]]:
        raise raised

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "x").mkdir(parents=True)
    monkeypatch.setattr(report_command, "write_report", write_report)
    assert cli.main(["report", "runs/x"]) == code
    assert capsys.readouterr().err == line + "\n"
