"""A real MLflow tracking server on loopback (``ringtrain_dev.mlflow_server``), started for the
tests that need one and stopped by its PID after them; the tests skip (fail under CI) without
the mlflow package."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from ringtrain_dev.mlflow_server import MlflowServer, running_mlflow
from tests.tools import missing


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    if importlib.util.find_spec("mlflow") is None:
        missing("mlflow is not installed (pip install -e '.[test]')")
    with running_mlflow(tmp_path_factory.mktemp("mlflow")) as server:
        yield server
