"""The durable checkpoint store on the file backend: commit order, retention, damage detection."""

from __future__ import annotations

import json
import logging
import os
import pickle
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Optional

import pytest

from ringtrain.checkpoint import CheckpointCorrupt, CheckpointRef, CheckpointStore, open_store
from ringtrain.checkpoint.backends import FileBackend, ObjectInfo
from ringtrain.checkpoint.layout import check_shard_names, parse_step_dir, step_dir

META = {"model": {"dim": 64, "layers": 2}, "tokens_seen": 1024}


@pytest.fixture(autouse=True)
def fsync_log(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Record fsyncs and renames instead of waiting on the disk: tests stay fast, order stays checked."""
    log: list[tuple[str, str]] = []
    real_replace = os.replace

    def fsync(fd: int) -> None:
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    def replace(src: Any, dst: Any) -> None:
        real_replace(src, dst)
        log.append(("replace", str(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return log


def shards_of(step: int) -> dict[str, bytes]:
    """Distinct bytes per step, with nested names and an empty shard."""
    return {
        "params/layers.0.wq": bytes([step % 256]) * 300 + b"wq",
        "params/layers.1.wk": bytes(range(256)) * 3,
        "optim/rank-3/exp_avg": f"step {step}".encode() * 50,
        "empty": b"",
    }


def store_at(root: Path, **kwargs: Any) -> CheckpointStore:
    return open_store(root.as_uri(), **kwargs)


def step_path(root: Path, step: int) -> Path:
    return root / step_dir(step)


def check_shape(meta: Mapping[str, Any]) -> Optional[str]:
    if meta.get("model") != META["model"]:
        return f"model {meta.get('model')} differs from {META['model']}"
    return None


def test_round_trip(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    ref = store.save(7, shards_of(7), META)
    assert ref.step == 7 and ref.uri == step_path(tmp_path, 7).as_uri()
    assert ref.num_shards == 4 and ref.num_bytes == sum(len(b) for b in shards_of(7).values())
    assert ref.seconds is not None and ref.seconds > 0 and ref.bytes_per_second is not None
    for how in (7, ref):
        loaded = store.load(how)
        assert loaded.step == 7 and loaded.meta == META
        assert not any(loaded.shards.is_read(name) for name in loaded.shards)
        assert dict(loaded.shards) == shards_of(7)
    eager = store.load(7, eager=True)
    assert all(eager.shards.is_read(name) for name in eager.shards)
    manifest = json.loads((step_path(tmp_path, 7) / "manifest.json").read_text())
    assert manifest["shards"]["params/layers.0.wq"]["size"] == 302
    assert {"format_version", "step", "created_at", "meta", "shards", "checksum_algo"} <= set(manifest)
    assert (step_path(tmp_path, 7) / "params" / "layers.0.wq").read_bytes() == shards_of(7)["params/layers.0.wq"]


def test_blake2b_is_recorded_and_verified(tmp_path: Path) -> None:
    store = store_at(tmp_path, checksum_algo="blake2b", num_threads=1)
    store.save(1, shards_of(1), META)
    assert json.loads((step_path(tmp_path, 1) / "manifest.json").read_text())["checksum_algo"] == "blake2b"
    # A reader configured for another algorithm still verifies with the one recorded.
    loaded = store_at(tmp_path).latest_valid()
    assert loaded is not None and dict(loaded.shards) == shards_of(1)


class RecordingBackend(FileBackend):
    """A file backend that logs each write and delete, and can fail the manifest commit."""

    def __init__(self, root: Path, fail_commit: Optional[BaseException] = None, failures: int = 1) -> None:
        super().__init__(root)
        self.calls: list[tuple[str, str]] = []
        self.fail_commit = fail_commit
        self.failures = failures

    def put(self, key: str, data: bytes) -> None:
        if key.endswith("/manifest.json") and self.fail_commit is not None and self.failures > 0:
            self.failures -= 1
            self.calls.append(("put-failed", key))
            raise self.fail_commit
        super().put(key, data)
        self.calls.append(("put", key))

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self.calls.extend(("delete", key) for key in keys)
        super().delete(keys)

    def delete_prefix(self, prefix: str) -> None:
        self.calls.append(("delete_prefix", prefix))
        super().delete_prefix(prefix)

    def is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, TimeoutError)


class Crash(Exception):
    pass


def test_the_manifest_is_written_last(tmp_path: Path) -> None:
    backend = RecordingBackend(tmp_path)
    CheckpointStore(backend, num_threads=4).save(3, shards_of(3), META)
    puts = [key for op, key in backend.calls if op == "put"]
    assert len(puts) == 5 and puts[-1] == "step-000000003/manifest.json"


def test_each_object_is_synced_renamed_and_its_folder_synced(tmp_path: Path, fsync_log: list[tuple[str, str]]) -> None:
    store_at(tmp_path).save(1, {"a/b": b"x"}, {})
    folder = step_path(tmp_path, 1)
    manifest = str(folder / "manifest.json")
    at = fsync_log.index(("replace", manifest))
    assert fsync_log[at - 1][0] == "fsync" and Path(fsync_log[at - 1][1]).name.startswith(".tmp-")
    assert fsync_log[at + 1] == ("fsync", str(folder))
    # New folders are made durable in their parents before anything is committed in them.
    assert fsync_log.index(("fsync", str(tmp_path))) < fsync_log.index(("replace", str(folder / "a" / "b")))
    assert fsync_log.index(("fsync", str(folder / "a"))) < at


def test_saves_with_the_real_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()
    store = store_at(tmp_path / "new" / "root")
    store.save(1, {"a/b": b"x"}, {})
    assert store.load(1).shards["a/b"] == b"x"


def test_a_crash_before_the_manifest_leaves_no_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store_at(tmp_path).save(1, shards_of(1), META)
    crashing = CheckpointStore(RecordingBackend(tmp_path, fail_commit=Crash("power cut")))
    with pytest.raises(Crash):
        crashing.save(2, shards_of(2), META)
    assert (step_path(tmp_path, 2) / "params" / "layers.0.wq").exists()
    assert not (step_path(tmp_path, 2) / "manifest.json").exists()
    store = store_at(tmp_path)
    assert [ref.step for ref in store.list()] == [1]
    with caplog.at_level(logging.WARNING, logger="ringtrain.checkpoint"):
        loaded = store.latest_valid()
    assert loaded is not None and loaded.step == 1
    assert [(s.step, s.uri) for s in store.skipped] == [(2, step_path(tmp_path, 2).as_uri())]
    assert "manifest is missing" in store.skipped[0].reason
    assert step_path(tmp_path, 2).as_uri() in caplog.text
    # The next successful save clears the dead one away.
    assert store.save(3, shards_of(3), META).deleted_steps == (2,)
    assert not step_path(tmp_path, 2).exists()


def test_a_failed_shard_write_cleans_up_and_commits_nothing(tmp_path: Path) -> None:
    class FailingShard(FileBackend):
        def put(self, key: str, data: bytes) -> None:
            if key.endswith("exp_avg"):
                raise OSError("disk full")
            super().put(key, data)

    store = CheckpointStore(FailingShard(tmp_path), num_threads=2)
    with pytest.raises(OSError, match="disk full"):
        store.save(4, shards_of(4), META)
    assert store.list() == [] and not step_path(tmp_path, 4).exists()


def test_retention_keeps_the_newest_k_and_deletes_manifests_first(tmp_path: Path) -> None:
    backend = RecordingBackend(tmp_path)
    store = CheckpointStore(backend, keep=2)
    deleted = [store.save(step, shards_of(step), META).deleted_steps for step in range(1, 6)]
    assert deleted == [(), (), (1,), (2,), (3,)]
    assert [ref.step for ref in store.list()] == [5, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir(4), step_dir(5)]
    for step in (1, 2, 3):
        ops = [(op, key) for op, key in backend.calls if op.startswith("delete") and key.startswith(step_dir(step))]
        assert ops == [("delete", f"{step_dir(step)}/manifest.json"), ("delete_prefix", f"{step_dir(step)}/")]


def test_saving_an_existing_step_replaces_it(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.save(2, {"a": b"old", "stale": b"x"}, META)
    store.save(2, {"a": b"new"}, {"v": 2})
    loaded = store.load(2)
    assert dict(loaded.shards) == {"a": b"new"} and loaded.meta == {"v": 2}
    assert not (step_path(tmp_path, 2) / "stale").exists()


def test_list_is_newest_first_and_ignores_foreign_folders(tmp_path: Path) -> None:
    store = store_at(tmp_path, keep=10)
    for step in (10, 2, 7, 0):
        store.save(step, {"x": b"1"}, {})
    (tmp_path / "step-12").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    assert [ref.step for ref in store.list()] == [10, 7, 2, 0]
    assert all(isinstance(ref, CheckpointRef) for ref in store.list())


def test_steps_past_nine_digits_get_wider_names_and_sort_numerically(tmp_path: Path) -> None:
    store = store_at(tmp_path, keep=10)
    for step in (999_999_999, 1_234_567_890, 5):
        store.save(step, {"x": str(step).encode()}, {})
    assert [ref.step for ref in store.list()] == [1_234_567_890, 999_999_999, 5]
    assert (tmp_path / "step-1234567890").is_dir() and (tmp_path / "step-000000005").is_dir()
    assert store.load(1_234_567_890).shards["x"] == b"1234567890"
    assert parse_step_dir("step-0000000005") is None and parse_step_dir("step-5") is None


@pytest.mark.parametrize("step", [-1, True, 1.0, "3"])
def test_bad_steps_are_refused(tmp_path: Path, step: Any) -> None:
    with pytest.raises((ValueError, TypeError)):
        store_at(tmp_path).save(step, {"x": b""}, {})
    assert not tmp_path.joinpath("step--00000001").exists()


@pytest.mark.parametrize(
    "names",
    [["../escape"], ["/abs"], ["a//b"], ["a/./b"], ["trail/"], ["manifest.json"], ["a", "a/b"], [""], ["x\\y"],
     ["a/.tmp-1"], ["n" * 256]],
)
def test_unsafe_shard_names_are_refused_before_writing(tmp_path: Path, names: list[str]) -> None:
    with pytest.raises(ValueError, match="shard name"):
        store_at(tmp_path).save(1, {name: b"x" for name in names}, {})
    assert list(tmp_path.iterdir()) == []
    check_shard_names(["params/layers.0.wq", "optim/rank-0/exp_avg", "a.manifest.json", "üñí/ç"])


def test_meta_must_be_json(tmp_path: Path) -> None:
    for meta in ({"f": object()}, {"nan": float("nan")}):
        with pytest.raises(ValueError, match="meta"):
            store_at(tmp_path).save(1, {"x": b""}, meta)
    assert list(tmp_path.iterdir()) == []


def _truncate(root: Path) -> None:
    path = step_path(root, 3) / "params" / "layers.1.wk"
    path.write_bytes(path.read_bytes()[:100])


def _flip(root: Path) -> None:
    path = step_path(root, 3) / "params" / "layers.1.wk"
    data = bytearray(path.read_bytes())
    data[500] ^= 0x10
    path.write_bytes(bytes(data))


def _tamper_meta(root: Path) -> None:
    path = step_path(root, 3) / "manifest.json"
    path.write_text(path.read_text().replace('"layers": 2', '"layers": 3'))


DAMAGE: dict[str, tuple[Callable[[Path], object], str]] = {
    "truncated": (_truncate, "shard 'params/layers.1.wk' is truncated: 100 of 768 bytes"),
    "flipped-byte": (_flip, "shard 'params/layers.1.wk' fails its sha256 checksum"),
    "missing-shard": (lambda root: (step_path(root, 3) / "optim" / "rank-3" / "exp_avg").unlink(), "is missing"),
    "missing-manifest": (lambda root: (step_path(root, 3) / "manifest.json").unlink(), "manifest is missing"),
    "garbage-manifest": (lambda root: (step_path(root, 3) / "manifest.json").write_bytes(b"\x00{not json"), "not valid JSON"),
    "empty-manifest": (lambda root: (step_path(root, 3) / "manifest.json").write_bytes(b""), "manifest is unreadable"),
    "tampered-manifest": (_tamper_meta, "manifest checksum does not match"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_latest_valid_skips_damage_and_names_it(tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture) -> None:
    store = store_at(tmp_path)
    for step in (1, 2, 3):
        store.save(step, shards_of(step), META)
    damage, reason = DAMAGE[case]
    damage(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ringtrain.checkpoint"):
        loaded = store.latest_valid(check_shape)
    assert loaded is not None and loaded.step == 2 and dict(loaded.shards) == shards_of(2)
    uri = step_path(tmp_path, 3).as_uri()
    assert [(s.step, s.uri) for s in store.skipped] == [(3, uri)] and loaded.skipped == tuple(store.skipped)
    assert reason in store.skipped[0].reason
    assert f"skipping checkpoint {uri}: " in caplog.text and reason in caplog.text


def test_an_incompatible_model_is_skipped_with_the_callbacks_reason(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.save(1, shards_of(1), META)
    store.save(2, shards_of(2), {**META, "model": {"dim": 128, "layers": 2}})
    loaded = store.latest_valid(check_shape)
    assert loaded is not None and loaded.step == 1
    assert store.skipped[0].reason == "incompatible with this model: model {'dim': 128, 'layers': 2} differs from " + str(
        META["model"]
    )


def test_none_valid_returns_none_and_reports_all(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    assert store.latest_valid() is None and store.skipped == []
    for step in (1, 2):
        store.save(step, shards_of(step), META)
    for step in (1, 2):
        (step_path(tmp_path, step) / "empty").unlink()
    assert store.latest_valid() is None
    assert [s.step for s in store.skipped] == [2, 1]
    assert all("shard 'empty' is missing" in s.reason for s in store.skipped)


def test_direct_loads_raise_checkpoint_corrupt(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.save(3, shards_of(3), META)
    _flip(tmp_path)
    loaded = store.load(3)
    assert loaded.shards["empty"] == b""
    with pytest.raises(CheckpointCorrupt, match="fails its sha256 checksum") as info:
        loaded.shards["params/layers.1.wk"]
    assert info.value.uri == step_path(tmp_path, 3).as_uri()
    with pytest.raises(CheckpointCorrupt):
        store.load(3, eager=True)
    assert len(store.load(3, verify=False).shards["params/layers.1.wk"]) == 768
    with pytest.raises(CheckpointCorrupt, match="manifest is missing"):
        store.load(4)


def test_latest_valid_without_verify_checks_sizes_but_defers_checksums(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    for step in (2, 3):
        store.save(step, shards_of(step), META)
    _flip(tmp_path)
    loaded = store.latest_valid(verify=False)
    assert loaded is not None and loaded.step == 3
    with pytest.raises(CheckpointCorrupt):
        loaded.shards["params/layers.1.wk"]
    _truncate(tmp_path)
    loaded = store.latest_valid(verify=False)
    assert loaded is not None and loaded.step == 2 and "truncated" in store.skipped[0].reason


def test_the_commit_is_retried_with_backoff_on_transient_errors(tmp_path: Path) -> None:
    delays: list[float] = []
    backend = RecordingBackend(tmp_path, fail_commit=TimeoutError("slow down"), failures=3)
    store = CheckpointStore(backend, commit_attempts=5, backoff_s=1.0, sleep=delays.append)
    store.save(1, shards_of(1), META)
    assert len(delays) == 3 and all(0.5 * 2**i <= d <= 2**i for i, d in enumerate(delays))
    assert [ref.step for ref in store.list()] == [1]

    backend = RecordingBackend(tmp_path, fail_commit=TimeoutError("down"), failures=9)
    with pytest.raises(TimeoutError):
        CheckpointStore(backend, commit_attempts=2, sleep=delays.append).save(2, shards_of(2), META)
    backend = RecordingBackend(tmp_path, fail_commit=PermissionError("denied"))
    with pytest.raises(PermissionError):
        CheckpointStore(backend, sleep=delays.append).save(2, shards_of(2), META)
    assert len(delays) == 4


def test_many_shards_through_the_thread_pool(tmp_path: Path) -> None:
    shards = {f"params/layer.{i}/w": bytes([i]) * (i + 1) for i in range(64)}
    store = store_at(tmp_path, num_threads=8)
    ref = store.save(1, shards, {})
    assert ref.num_shards == 64
    assert dict(store.load(1, eager=True).shards) == shards


def test_a_newer_checkpoint_is_kept_and_reported_when_saving_an_older_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_at(tmp_path, keep=1)
    store.save(10, {"x": b"10"}, {})
    with caplog.at_level(logging.WARNING, logger="ringtrain.checkpoint"):
        ref = store.save(5, {"x": b"5"}, {})
    assert ref.deleted_steps == () and [r.step for r in store.list()] == [10, 5]
    assert "newer checkpoints exist (steps 10)" in caplog.text
    store.delete(10)
    assert [r.step for r in store.list()] == [5]


def test_uris_and_pickling(tmp_path: Path) -> None:
    plain = open_store(str(tmp_path / "ck"))
    assert plain.uri == (tmp_path / "ck").as_uri()
    assert open_store(f"file://localhost{tmp_path}/ck").uri == plain.uri
    for bad in ("gs://bucket/x", "file://otherhost/x", "file://relative"):
        with pytest.raises(ValueError, match="checkpoint URI"):
            open_store(bad)
    with pytest.raises(ValueError):
        open_store(str(tmp_path), endpoint_url="http://127.0.0.1:1")
    with pytest.raises(ValueError):
        open_store(str(tmp_path), keep=0)
    plain.save(1, {"x": b"1"}, {})
    clone = pickle.loads(pickle.dumps(plain))
    assert clone.load(1).shards["x"] == b"1" and clone.keep == plain.keep
    error = pickle.loads(pickle.dumps(CheckpointCorrupt("file:///x/step-000000001", "shard 'a' is missing")))
    assert (error.uri, error.reason, str(error)) == (
        "file:///x/step-000000001",
        "shard 'a' is missing",
        "checkpoint file:///x/step-000000001: shard 'a' is missing",
    )


def test_the_file_backend_lists_nested_objects_with_sizes(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path)
    backend.put("a/b/c", b"123")
    backend.put("a/d", b"")
    found: Iterator[ObjectInfo] = backend.list("")
    assert sorted((i.key, i.size) for i in found) == [("a/b/c", 3), ("a/d", 0)]
    assert [i.key for i in backend.list("a/b/")] == ["a/b/c"]
    assert list(backend.list("nope/")) == []


def test_a_step_folder_that_is_a_link_is_never_followed(tmp_path: Path) -> None:
    """A store may be shared: a step folder replaced by a link to a folder elsewhere (another
    run's checkpoint, a planted one) is not read as a checkpoint, and neither written through nor
    deleted through."""
    root, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    store = store_at(root)
    store.save(1, shards_of(1), {"n": 1})
    store.save(2, shards_of(2), {"n": 2})
    step_path(root, 2).rename(elsewhere)
    step_path(root, 2).symlink_to(elsewhere, target_is_directory=True)

    assert [ref.step for ref in store.list()] == [1]
    loaded = store.latest_valid()
    assert loaded is not None and loaded.step == 1
    with pytest.raises(OSError, match="symbolic link"):
        store.delete(2)
    with pytest.raises(OSError, match="symbolic link"):
        store.save(2, shards_of(3), {"n": 3})
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted(p.name for p in step_path(root, 1).iterdir())
