"""A mesh an embedded cluster's CPUs cannot place is refused before the cluster starts, naming a
cpus_per_worker that fits; a joined cluster's resources are checked once joined."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringtrain import config
from ringtrain.actors.cluster import capacity_problem, check_embedded_capacity
from ringtrain.errors import CapacityError


def job(*overrides: str) -> config.JobConfig:
    return config.load("jobs/quickstart.yaml", list(overrides))


def test_five_workers_on_two_cores_are_refused_with_a_setting_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(CapacityError) as caught:
        check_embedded_capacity(job("mesh.spares=1", "cluster.num_cpus=2"))
    assert str(caught.value) == (
        "mesh.dp: mesh.dp x mesh.cp + mesh.spares = 2 x 2 + 1 = 5 workers need 2.5 CPU "
        "(cluster.cpus_per_worker=0.5) but the cluster has 2; cluster.cpus_per_worker=0.4 fits"
    )
    check_embedded_capacity(job("mesh.spares=1", "cluster.num_cpus=2", "cluster.cpus_per_worker=0.4"))


def test_a_joined_cluster_is_not_judged_by_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    check_embedded_capacity(job("mesh.dp=4", "train.global_batch=8", "cluster.num_cpus=1"))
    monkeypatch.delenv("RAY_ADDRESS")
    check_embedded_capacity(job("mesh.dp=4", "train.global_batch=8", "cluster.num_cpus=1", "cluster.address=ray://head:10001"))


def test_gpus_get_no_cpu_hint() -> None:
    with pytest.raises(CapacityError, match=r"need 4 GPU \(cluster.gpus_per_worker=1\) but the cluster has 1$"):
        capacity_problem(job(), {"GPU": 1.0}, {"GPU": 1.0})


def test_the_run_is_refused_before_any_cluster_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ringtrain import cli

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "ray"))  # where an embedded cluster's temp dir would go
    (tmp_path / "ray").mkdir()
    code = cli.main(["run", "jobs/quickstart.yaml", "mesh.spares=1", "cluster.num_cpus=2", f"run_dir={tmp_path / 'run'}"])
    assert code == 2
    assert "cluster.cpus_per_worker=0.4 fits" in capsys.readouterr().err
    assert list((tmp_path / "ray").iterdir()) == [], "a cluster was started, and its temp dir left behind"
