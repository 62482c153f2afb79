"""Which durable checkpoint a resume loads: the newest valid one, damaged and foreign ones named and skipped.

Checkpoints here are written through the real file store with small fake shards and the meta
the Persister records (``checkpoint_meta(job)`` plus step and world size); the shards are never
decoded, only the store's and the resume's checks run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from ringtrain import config
from ringtrain.actors.resume import checkpoint_meta, find_resume_point, store_uri
from ringtrain.checkpoint import LoadedCheckpoint, open_store
from ringtrain.checkpoint.layout import MANIFEST_NAME, step_dir
from ringtrain.config import JobConfig
from ringtrain.errors import ConfigError

BASE = ["name=resume-test", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2"]
WORLD = 2


@pytest.fixture(autouse=True)
def no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store fsyncs every object and folder; these tests check what is stored, not durability."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


class Said(list[str]):
    """Collects what ``find_resume_point`` tells the user."""

    def __call__(self, message: str) -> None:
        self.append(message)


@pytest.fixture
def said() -> Said:
    return Said()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


def job(*overrides: str) -> JobConfig:
    return config.load(None, BASE + list(overrides))


def shards_of(step: int) -> dict[str, bytes]:
    return {f"rank-{rank:05d}": f"step {step} rank {rank};".encode() * 16 for rank in range(WORLD)}


def save(root: Path, step: int, writer: JobConfig | None = None) -> None:
    writer = writer or job()
    meta = dict(checkpoint_meta(writer), step=step, world_size=WORLD)
    open_store(root.as_uri(), keep=10).save(step, shards_of(step), meta)


def checkpoints(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def step_uri(root: Path, step: int) -> str:
    return (root / step_dir(step)).as_uri()


def assert_loaded(loaded: LoadedCheckpoint | None, step: int) -> None:
    assert loaded is not None
    assert loaded.step == step
    assert dict(loaded.shards) == shards_of(step)
    assert loaded.meta["step"] == step and loaded.meta["world_size"] == WORLD


# --- damage done to a stored checkpoint ---------------------------------------------------------


def flip_a_byte(folder: Path) -> None:
    shard = folder / "rank-00001"
    data = bytearray(shard.read_bytes())
    data[5] ^= 0x40
    shard.write_bytes(bytes(data))


def truncate_a_shard(folder: Path) -> None:
    shard = folder / "rank-00000"
    shard.write_bytes(shard.read_bytes()[:-7])


def delete_a_shard(folder: Path) -> None:
    (folder / "rank-00001").unlink()


def delete_the_manifest(folder: Path) -> None:
    (folder / MANIFEST_NAME).unlink()


def garble_the_manifest(folder: Path) -> None:
    (folder / MANIFEST_NAME).write_bytes(b"\x00not json{")


def edit_the_manifest(folder: Path) -> None:
    """Valid JSON, but its own checksum no longer matches (a byte flipped inside the meta)."""
    manifest = folder / MANIFEST_NAME
    manifest.write_text(manifest.read_text().replace('"resume-test"', '"resume-tesT"'))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "flipped-byte": (flip_a_byte, "checksum"),
    "truncated-shard": (truncate_a_shard, "truncated"),
    "missing-shard": (delete_a_shard, "missing"),
    "missing-manifest": (delete_the_manifest, "manifest is missing"),
    "garbage-manifest": (garble_the_manifest, "manifest is unreadable"),
    "edited-manifest": (edit_the_manifest, "manifest checksum does not match"),
}


# --- checkpoint.resume=none and auto --------------------------------------------------------------


def test_resume_none_starts_fresh_even_when_checkpoints_exist(run_dir: Path, said: Said) -> None:
    save(checkpoints(run_dir), 4)

    assert find_resume_point(job("checkpoint.resume=none"), run_dir, said) is None
    assert said == []


@pytest.mark.parametrize("exists", [False, True], ids=["no-folder", "empty-folder"])
def test_auto_with_an_empty_store_starts_fresh_and_says_so(run_dir: Path, said: Said, exists: bool) -> None:
    if exists:
        checkpoints(run_dir).mkdir(parents=True)

    assert find_resume_point(job("checkpoint.resume=auto"), run_dir, said) is None
    assert len(said) == 1
    assert "no checkpoint" in said[0] and checkpoints(run_dir).as_uri() in said[0]


def test_auto_loads_the_newest_valid_checkpoint(run_dir: Path, said: Said) -> None:
    for step in (2, 4, 6):
        save(checkpoints(run_dir), step)

    loaded = find_resume_point(job("checkpoint.resume=auto"), run_dir, said)

    assert_loaded(loaded, 6)
    assert loaded is not None and loaded.skipped == ()
    assert said == []


def test_auto_reads_the_store_named_by_checkpoint_uri(tmp_path: Path, run_dir: Path, said: Said) -> None:
    elsewhere = tmp_path / "durable"
    save(elsewhere, 3)

    loaded = find_resume_point(job("checkpoint.resume=auto", f"checkpoint.uri={elsewhere.as_uri()}"), run_dir, said)

    assert_loaded(loaded, 3)


@pytest.mark.parametrize("damage, reason", DAMAGE.values(), ids=DAMAGE.keys())
def test_auto_skips_a_damaged_newest_checkpoint_and_names_it(
    run_dir: Path, said: Said, damage: Callable[[Path], None], reason: str
) -> None:
    root = checkpoints(run_dir)
    for step in (4, 6):
        save(root, step)
    damage(root / step_dir(6))

    loaded = find_resume_point(job("checkpoint.resume=auto"), run_dir, said)

    assert_loaded(loaded, 4)
    assert len(said) == 1
    assert step_uri(root, 6) in said[0] and reason in said[0]
    assert loaded is not None and [s.step for s in loaded.skipped] == [6]


@pytest.mark.parametrize(
    "writer_overrides, named",
    [
        (["model.dim=128"], "model.dim=128 (this job: 64)"),
        (["model.n_layers=3"], "model.n_layers=3 (this job: 2)"),
        (["model.vocab_size=512"], "model.vocab_size=512 (this job: 256)"),
        (["model.n_kv_heads=4"], "model.n_kv_heads=4 (this job: 2)"),
        (["model.ffn_dim=96"], "model.ffn_dim=96 (this job: 192)"),
        # Gemma's block over the same shapes: its parameters carry other names and meanings.
        (["model.norm_style=gemma"], "model.norm_style=gemma (this job: llama)"),
        (["model.activation=gelu_pytorch_tanh"], "model.activation=gelu_pytorch_tanh (this job: silu)"),
    ],
    ids=["dim", "n_layers", "vocab_size", "n_kv_heads", "ffn_dim", "norm_style", "activation"],
)
def test_auto_skips_a_checkpoint_of_another_model_and_names_the_field(
    run_dir: Path, said: Said, writer_overrides: list[str], named: str
) -> None:
    root = checkpoints(run_dir)
    save(root, 4)
    save(root, 6, writer=job(*writer_overrides))

    loaded = find_resume_point(job("checkpoint.resume=auto"), run_dir, said)

    assert_loaded(loaded, 4)
    assert len(said) == 1
    assert step_uri(root, 6) in said[0]
    assert "incompatible model" in said[0] and named in said[0]


def test_auto_skips_a_checkpoint_of_another_format(run_dir: Path, said: Said) -> None:
    root = checkpoints(run_dir)
    save(root, 4)
    meta = dict(checkpoint_meta(job()), format="someone-elses-v9", step=6, world_size=WORLD)
    open_store(root.as_uri(), keep=10).save(6, shards_of(6), meta)

    loaded = find_resume_point(job("checkpoint.resume=auto"), run_dir, said)

    assert_loaded(loaded, 4)
    assert "someone-elses-v9" in said[0]


@pytest.mark.parametrize(
    "writer_overrides",
    [["model.activation_checkpointing=true"], ["mesh.dp=2", "train.global_batch=4"], ["zero.stage=3"]],
    ids=["activation-checkpointing", "dp", "zero-stage"],
)
def test_what_does_not_change_the_state_shapes_does_not_block_a_resume(
    run_dir: Path, said: Said, writer_overrides: list[str]
) -> None:
    save(checkpoints(run_dir), 5, writer=job(*writer_overrides))

    assert_loaded(find_resume_point(job("checkpoint.resume=auto"), run_dir, said), 5)
    assert said == []


def test_auto_with_every_checkpoint_invalid_is_a_config_error(run_dir: Path, said: Said) -> None:
    root = checkpoints(run_dir)
    save(root, 4)
    save(root, 6, writer=job("model.dim=128"))
    flip_a_byte(root / step_dir(4))

    with pytest.raises(ConfigError) as info:
        find_resume_point(job("checkpoint.resume=auto"), run_dir, said)

    assert info.value.key == "checkpoint.resume"
    assert "no valid checkpoint" in info.value.reason and root.as_uri() in info.value.reason
    assert len(said) == 2
    assert step_uri(root, 6) in said[0] and "incompatible model" in said[0]
    assert step_uri(root, 4) in said[1] and "checksum" in said[1]


def test_auto_over_only_an_uncommitted_save_starts_fresh(run_dir: Path, said: Said) -> None:
    root = checkpoints(run_dir)
    save(root, 50)
    delete_the_manifest(root / step_dir(50))  # what a crash during the run's first persist leaves

    assert find_resume_point(job("checkpoint.resume=auto"), run_dir, said) is None


# --- an explicit store or checkpoint uri ----------------------------------------------------------


def test_explicit_store_uri_loads_its_newest_valid_checkpoint(tmp_path: Path, run_dir: Path, said: Said) -> None:
    root = tmp_path / "other-run"
    for step in (3, 9):
        save(root, step)
    truncate_a_shard(root / step_dir(9))

    loaded = find_resume_point(job(f"checkpoint.resume={root.as_uri()}"), run_dir, said)

    assert_loaded(loaded, 3)
    assert len(said) == 1 and step_uri(root, 9) in said[0]


@pytest.mark.parametrize("exists", [False, True], ids=["no-folder", "empty-folder"])
def test_explicit_store_uri_that_is_empty_is_a_config_error(
    tmp_path: Path, run_dir: Path, said: Said, exists: bool
) -> None:
    root = tmp_path / "nothing-here"
    if exists:
        root.mkdir()

    with pytest.raises(ConfigError) as info:
        find_resume_point(job(f"checkpoint.resume={root.as_uri()}"), run_dir, said)

    assert info.value.key == "checkpoint.resume"
    assert "empty" in info.value.reason and root.as_uri() in info.value.reason


@pytest.mark.parametrize("suffix", ["", "/"], ids=["plain", "trailing-slash"])
def test_explicit_step_uri_loads_that_step_though_newer_ones_exist(
    run_dir: Path, said: Said, suffix: str
) -> None:
    root = checkpoints(run_dir)
    for step in (2, 4, 6):
        save(root, step)

    loaded = find_resume_point(job(f"checkpoint.resume={step_uri(root, 4)}{suffix}"), run_dir, said)

    assert_loaded(loaded, 4)
    assert loaded is not None and all(loaded.shards.is_read(name) for name in loaded.shards)
    assert said == []


def test_explicit_step_uri_of_another_model_is_a_config_error(run_dir: Path, said: Said) -> None:
    root = checkpoints(run_dir)
    save(root, 4, writer=job("model.dim=128"))
    uri = step_uri(root, 4)

    with pytest.raises(ConfigError) as info:
        find_resume_point(job(f"checkpoint.resume={uri}"), run_dir, said)

    assert info.value.key == "checkpoint.resume"
    assert uri in info.value.reason
    assert "incompatible model" in info.value.reason and "model.dim=128" in info.value.reason


@pytest.mark.parametrize("damage, reason", DAMAGE.values(), ids=DAMAGE.keys())
def test_explicit_step_uri_of_a_damaged_checkpoint_is_a_config_error(
    run_dir: Path, said: Said, damage: Callable[[Path], None], reason: str
) -> None:
    root = checkpoints(run_dir)
    for step in (2, 4):
        save(root, step)
    damage(root / step_dir(4))

    with pytest.raises(ConfigError) as info:
        find_resume_point(job(f"checkpoint.resume={step_uri(root, 4)}"), run_dir, said)

    assert info.value.key == "checkpoint.resume"
    assert "cannot load" in info.value.reason and step_uri(root, 4) in info.value.reason


def test_explicit_step_uri_that_was_never_written_is_a_config_error(run_dir: Path, said: Said) -> None:
    root = checkpoints(run_dir)
    save(root, 2)

    with pytest.raises(ConfigError) as info:
        find_resume_point(job(f"checkpoint.resume={step_uri(root, 8)}"), run_dir, said)

    assert info.value.key == "checkpoint.resume" and "manifest is missing" in info.value.reason


@pytest.mark.parametrize("uri", ["gs://bucket/run", "http://host/run"])
def test_a_resume_uri_of_an_unsupported_scheme_is_a_config_error(run_dir: Path, said: Said, uri: str) -> None:
    with pytest.raises(ConfigError) as info:
        find_resume_point(job(f"checkpoint.resume={uri}"), run_dir, said)

    assert info.value.key == "checkpoint.resume"


# --- where the store is -------------------------------------------------------------------------------


def test_store_uri_defaults_to_the_run_dirs_checkpoints_folder(tmp_path: Path) -> None:
    uri = store_uri(job(), tmp_path / "run")

    assert uri == (tmp_path / "run" / "checkpoints").as_uri()
    assert uri.startswith("file:///")


def test_store_uri_of_a_relative_run_dir_is_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)

    assert store_uri(job(), Path("runs/a")) == (tmp_path.resolve() / "runs" / "a" / "checkpoints").as_uri()


def test_store_uri_is_checkpoint_uri_when_set(tmp_path: Path) -> None:
    assert store_uri(job("checkpoint.uri=s3://bucket/prefix"), tmp_path) == "s3://bucket/prefix"


# --- the store a run reads and writes -----------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, opened, resumed",
    [
        (["checkpoint.resume=auto"], ["checkpoints"], 4),
        (["checkpoint.resume=none"], ["checkpoints"], None),
        (["checkpoint.resume={other}"], ["other", "checkpoints"], 2),
        (["checkpoint.resume=auto", "checkpoint.snapshot_every=0"], ["checkpoints"], 4),
        (["checkpoint.resume=none", "checkpoint.snapshot_every=0"], [], None),
    ],
    ids=["auto", "none", "other-store", "auto-no-snapshots", "none-no-snapshots"],
)
def test_a_store_the_run_resumes_from_and_writes_is_opened_and_checked_once(
    tmp_path: Path, run_dir: Path, said: Said, monkeypatch: pytest.MonkeyPatch,
    overrides: list[str], opened: list[str], resumed: int | None,
) -> None:  # fmt: skip
    from ringtrain.actors import resume

    other = tmp_path / "other"
    save(checkpoints(run_dir), 4)
    save(other, 2)
    checked: list[str] = []
    real_check = resume.check_reachable
    monkeypatch.setattr(resume, "check_reachable", lambda uri, key: (checked.append(uri), real_check(uri, key)))
    the_job = job(*(o.format(other=other.as_uri()) for o in overrides))

    resume_from, store = resume.open_checkpoints(the_job, run_dir, said)

    assert [Path(uri.removeprefix("file://")).name for uri in checked] == opened
    assert (store is None) == (the_job.checkpoint.snapshot_every == 0)
    assert (resume_from.step if resume_from else None) == resumed
