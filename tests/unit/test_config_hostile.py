"""Job configs that try to read the environment or smuggle in non-finite numbers: refused with the
key named, before any resolver runs.

The end-to-end cases (exit 2, one line, no traceback) run `ringtrain run` in a subprocess whose
environment holds a secret, and check the secret appears nowhere: not on stderr, not on disk.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ringtrain import config
from ringtrain.config.interpolation import resolver_calls
from ringtrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "jobs" / "quickstart.yaml"
SECRET = "s3cr3t-do-not-leak"


@pytest.fixture
def spy() -> Iterator[list[str]]:
    """A resolver that records every call: a refused interpolation must never reach it."""
    calls: list[str] = []
    OmegaConf.register_resolver("spy", lambda arg: calls.append(arg) or "x")
    yield calls
    OmegaConf.clear_resolver("spy")


def job_file(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ("plain", []),
        ("s3://bucket/${oc.env:SECRET}", ["oc.env"]),
        ("${ oc.env : SECRET }", ["oc.env"]),
        ("${train.lr}", []),
        ('${oc.decode:"${oc.env:SECRET}"}', ["oc.decode", "oc.env"]),
        ("${oc.select:a.b, ${oc.env:SECRET}}", ["oc.select", "oc.env"]),
        ("\\${oc.env:SECRET}", []),  # escaped: a literal, until a later merge makes it live
        ("${spy:x}", ["spy"]),
        ("price ${ is not an interpolation", []),
    ],
)
def test_resolver_calls_are_found_nested_and_spaced(text: str, calls: list[str]) -> None:
    assert resolver_calls(text) == calls


def test_oc_env_in_a_job_file_is_refused_naming_the_key_and_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SECRET", SECRET)
    path = job_file(tmp_path, "checkpoint:\n  uri: s3://elsewhere/${oc.env:SECRET}\n")
    with pytest.raises(ConfigError) as caught:
        config.load(path)
    assert caught.value.key == "checkpoint.uri"
    assert str(path) in caught.value.reason and "oc.env" in caught.value.reason
    assert "reads the environment" in caught.value.reason
    assert SECRET not in str(caught.value)


def test_no_resolver_runs_even_once(tmp_path: Path, spy: list[str]) -> None:
    """Refused before the merge resolves anything: from the file, from an override, in a list."""
    cases = [
        (job_file(tmp_path, "name: ${spy:file}\n", "a.yaml"), [], "name"),
        (QUICKSTART, ["run_dir=/tmp/${spy:override}"], "run_dir"),
        (job_file(tmp_path, "data:\n  sources:\n    - {path: '${spy:list}'}\n", "b.yaml"), [], "data.sources[0].path"),
    ]
    for path, overrides, key in cases:
        with pytest.raises(ConfigError) as caught:
            config.load(path, overrides)
        assert caught.value.key == key
    assert spy == []


def test_an_escaped_resolver_is_refused_once_it_would_become_live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``\\${oc.env:X}`` resolves to the text ``${oc.env:X}``, which the next merge of the
    config (``config.replace``, an eval's overrides) would resolve: refused as well."""
    monkeypatch.setenv("SECRET", SECRET)
    path = job_file(tmp_path, "name: quick\nrun_dir: '/tmp/\\${oc.env:SECRET}'\n")
    with pytest.raises(ConfigError) as caught:
        config.load(path)
    assert caught.value.key == "run_dir"


def test_references_to_other_keys_still_work(tmp_path: Path) -> None:
    path = job_file(tmp_path, "train:\n  lr: 0.001\n  min_lr_ratio: ${train.lr}\nname: ref\n")
    job = config.load(path)
    assert job.train.min_lr_ratio == 0.001


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["train.lr=inf"], "train.lr"),
        (["train.lr=-inf"], "train.lr"),
        (["train.grad_clip=nan"], "train.grad_clip"),
        (["train.weight_decay=nan"], "train.weight_decay"),
        (["controllers.step_timeout_s=inf"], "controllers.step_timeout_s"),
        (["model.rope_scaling={rope_type: linear, factor: .inf}"], "model.rope_scaling.factor"),
        (["data.sources=[{path: /x, weight: .nan}]", "data.path=stdlib"], "data.sources[0].weight"),
        (["eval.passkey_depths=[0.5, .nan]"], "eval.passkey_depths[1]"),
    ],
)
def test_non_finite_numbers_are_refused(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config.load(QUICKSTART, overrides)
    assert caught.value.key == key
    assert "finite" in caught.value.reason


def test_non_finite_numbers_in_a_yaml_file_are_refused(tmp_path: Path) -> None:
    path = job_file(tmp_path, "train:\n  grad_clip: .nan\n")
    with pytest.raises(ConfigError, match=r"train\.grad_clip: must be a finite number \(got nan\)"):
        config.load(path)


def run_cli(tmp_path: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SECRET": SECRET, "HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "platform"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "ringtrain", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("text", "overrides", "expected"),
    [
        ("name: q\ncheckpoint:\n  uri: s3://elsewhere/${oc.env:SECRET}\n", [], "checkpoint.uri: "),
        ("name: q\n", ["train.lr=inf"], "train.lr: must be a finite number (got inf)"),
    ],
    ids=["oc-env", "lr-inf"],
)
def test_the_command_line_exits_2_with_one_line_and_leaks_nothing(
    tmp_path: Path, text: str, overrides: list[str], expected: str
) -> None:
    path = job_file(tmp_path, text)
    run_dir = tmp_path / "run"
    proc = run_cli(tmp_path, ["run", str(path), *overrides, f"run_dir={run_dir}"])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"ringtrain: config error: {expected}"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert SECRET not in proc.stderr + proc.stdout
    assert not run_dir.exists()
    for file in tmp_path.rglob("*"):
        if file.is_file():
            assert SECRET.encode() not in file.read_bytes(), file


def _alias_bomb(levels: int = 12) -> str:
    """'Billion laughs': each level a list of ten aliases of the one before, 10^levels values."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + f"\nname: *a{levels - 1}\n"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (_alias_bomb(), "holds more than 100,000 values"),
        ("name: &x [*x]\n", "contains itself"),
        ("name: " + "[" * 40 + "]" * 40 + "\n", "nests deeper than"),
        ("name: " + "[" * 800 + "]" * 800 + "\n", "nests deeper than"),  # PyYAML recurses out first
    ],
    ids=["billion-laughs", "recursive-alias", "deep", "deeper-than-the-parser"],
)
def test_a_yaml_bomb_is_refused_in_bounded_time_naming_the_file(tmp_path: Path, text: str, reason: str) -> None:
    import time

    path = job_file(tmp_path, text)
    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        config.load(path)
    assert time.monotonic() - started < 2.0
    assert caught.value.key == "config" and str(path) in caught.value.reason and reason in caught.value.reason


def test_a_yaml_bomb_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ringtrain import cli

    path = job_file(tmp_path, _alias_bomb())
    assert cli.main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ringtrain: config error: config: {path} holds more than")


def test_an_oversized_job_file_is_refused_unread(tmp_path: Path) -> None:
    path = job_file(tmp_path, "name: big\n" + "# padding\n" * 200_000)
    with pytest.raises(ConfigError, match="bytes; a config file holds at most"):
        config.load(path)


def test_a_run_directorys_saved_config_is_bounded_too(tmp_path: Path) -> None:
    """The config a run directory keeps is read as a model's source by eval: bounded the same way."""
    path = job_file(tmp_path, _alias_bomb(), "config.yaml")
    with pytest.raises(ConfigError, match="holds more than"):
        config.load_saved(path)


def test_the_store_a_run_directory_names_is_read_within_bounds(tmp_path: Path) -> None:
    """``eval`` and ``export`` read a run directory's checkpoint.uri before anything else."""
    from ringtrain.checkpoint.sources import run_store_uri

    job_file(tmp_path, _alias_bomb().replace("name:", "checkpoint:\n  uri:"), "config.yaml")
    with pytest.raises(ConfigError, match="SOURCE: .*holds more than"):
        run_store_uri(tmp_path)
    job_file(tmp_path, "checkpoint:\n  uri: [a, b]\n", "config.yaml")
    with pytest.raises(ConfigError, match="checkpoint.uri must be a string"):
        run_store_uri(tmp_path)
