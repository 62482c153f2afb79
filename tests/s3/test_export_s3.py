"""``ringtrain export`` of checkpoints in an S3 bucket: a store URI exports its newest valid
checkpoint, a step URI that one, and a bucket that is not there is one line and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ringtrain import cli
from tests.unit.test_export import params_of, scratch, tensors_in, write_checkpoint


@pytest.fixture
def endpoint_env(s3_endpoint: str, aws_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The export opens the store as a user would: the endpoint comes from the environment."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)


def test_a_bucket_store_and_a_step_in_it_export(bucket: str, endpoint_env: None, tmp_path: Path) -> None:
    job, old = scratch(seed=1)
    _, new = scratch(seed=2)
    store = f"s3://{bucket}/run/checkpoints"
    old_uri = write_checkpoint(store, job, params_of(old), step=3)
    write_checkpoint(store, job, params_of(new), step=9)
    assert old_uri == f"{store}/step-000000003"

    assert cli.main(["export", store, str(tmp_path / "newest")]) == 0
    assert torch.equal(tensors_in(tmp_path / "newest")["lm_head.weight"], new.output.weight.detach())
    assert cli.main(["export", old_uri, str(tmp_path / "old")]) == 0
    assert torch.equal(tensors_in(tmp_path / "old")["lm_head.weight"], old.output.weight.detach())


def test_a_missing_bucket_is_one_line_and_exit_2(endpoint_env: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["export", "s3://no-such-bucket-here/ckpt", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "SOURCE" in err[0] and "no-such-bucket-here" in err[0], err
