"""The exception hierarchy: every class pickles with its attributes (errors cross actor boundaries)."""

from __future__ import annotations

import inspect
import pickle
from typing import Union

import pytest

from ringtrain import errors
from ringtrain.errors import CapacityError, ConfigError, RingtrainError, WorkerError

EXCEPTION_CLASSES = sorted(
    (
        obj
        for obj in vars(errors).values()
        if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    ),
    key=lambda cls: cls.__name__,
)

_SAMPLE_BY_ANNOTATION = {"int": 7, "str": "sample text", "float": 1.5}


def _instance(cls: type[BaseException]) -> BaseException:
    """An instance built from the constructor's signature, with a distinct value per argument."""
    kwargs = {}
    for name, param in inspect.signature(cls).parameters.items():
        annotation = param.annotation if isinstance(param.annotation, str) else param.annotation.__name__
        sample = _SAMPLE_BY_ANNOTATION[annotation]
        kwargs[name] = f"{name}: {sample}" if isinstance(sample, str) else sample
    return cls(**kwargs)


def test_the_module_defines_the_expected_classes() -> None:
    names = {cls.__name__ for cls in EXCEPTION_CLASSES}
    assert {"RingtrainError", "ConfigError", "CapacityError", "DataError", "WorkerError", "ClusterError"} <= names


@pytest.mark.parametrize("cls", EXCEPTION_CLASSES, ids=lambda cls: cls.__name__)
def test_every_error_is_a_ringtrain_error(cls: type[BaseException]) -> None:
    assert issubclass(cls, RingtrainError)


@pytest.mark.parametrize("protocol", [0, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL])
@pytest.mark.parametrize("cls", EXCEPTION_CLASSES, ids=lambda cls: cls.__name__)
def test_every_error_pickles_with_attributes_and_message(cls: type[BaseException], protocol: int) -> None:
    original = _instance(cls)
    restored = pickle.loads(pickle.dumps(original, protocol=protocol))
    assert type(restored) is cls
    assert str(restored) == str(original)
    assert vars(restored) == vars(original)
    assert restored.args == original.args
    for name in inspect.signature(cls).parameters:
        if hasattr(original, name):
            assert getattr(restored, name) == getattr(original, name)


@pytest.mark.parametrize(
    "exc",
    [
        ConfigError("mesh.dp", "must be >= 1 (got 0)"),
        CapacityError("mesh.dp", "needs 8 GPUs, the cluster has 4"),
        WorkerError(3, "node-7", "CUDA error: an illegal memory access"),
        errors.DataError("tokens.bin: too short"),
        errors.ClusterError("cannot reach ray://head:10001"),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_known_errors_round_trip(exc: RingtrainError) -> None:
    restored = pickle.loads(pickle.dumps(exc))
    assert vars(restored) == vars(exc)
    assert str(restored) == str(exc)


def test_config_error_str_is_key_colon_reason() -> None:
    exc = ConfigError("data.seq_len", "1026 is not divisible by 4")
    assert str(exc) == "data.seq_len: 1026 is not divisible by 4"
    assert (exc.key, exc.reason) == ("data.seq_len", "1026 is not divisible by 4")
    assert exc.message == str(exc)


def test_capacity_error_is_a_config_error_with_key_and_reason() -> None:
    exc = pickle.loads(pickle.dumps(CapacityError("mesh.dp", "needs 8 GPUs")))
    assert isinstance(exc, ConfigError)
    assert (exc.key, exc.reason, str(exc)) == ("mesh.dp", "needs 8 GPUs", "mesh.dp: needs 8 GPUs")


def test_worker_error_names_rank_and_host() -> None:
    exc = pickle.loads(pickle.dumps(WorkerError(rank=5, host="gpu-node-2", cause="segfault")))
    assert (exc.rank, exc.host, exc.cause) == (5, "gpu-node-2", "segfault")
    assert str(exc) == "rank 5 on gpu-node-2: segfault"


def test_a_restored_error_can_be_raised_and_caught_by_base_class() -> None:
    restored = pickle.loads(pickle.dumps(ConfigError("train.lr", "must be > 0")))
    with pytest.raises(RingtrainError, match=r"^train\.lr: must be > 0$"):
        raise restored


@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (ValueError("Value 'abc' could not be converted:\n    full_key: mesh.dp"), "Value 'abc' could not be converted"),
        ("expected ',' or ']'\n  in <unicode string>", "expected ',' or ']'"),
        (ValueError("  \n"), "ValueError"),
    ],
    ids=["exception", "message", "silent"],
)
def test_first_line_is_a_library_errors_one_line(exc: Union[BaseException, str], line: str) -> None:
    assert errors.first_line(exc) == line


def test_a_yaml_error_without_a_position_says_its_first_line_as_the_config_does() -> None:
    import yaml

    from ringtrain.config.yamlfile import yaml_problem

    assert yaml_problem(yaml.YAMLError("found a tab character where an indentation space is expected:\n  here")) == (
        ": not valid YAML: found a tab character where an indentation space is expected"
    )
