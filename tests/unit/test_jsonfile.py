"""The one bounded JSON parser (``ringtrain.jsonfile``) every JSON from elsewhere goes through: a
refusal says which limit failed (the bytes, the depth) or that the text is not JSON, and each
reader words that for what it reads (a small file, a dataset's or a checkpoint's manifest, a
snapshot's header)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringtrain.checkpoint.manifest import Manifest, ManifestInvalid
from ringtrain.checkpoint.wire import SnapshotFormatError, decode
from ringtrain.errors import DataError
from ringtrain.jsonfile import TOO_DEEP, TOO_LARGE, JsonFileError, parse_json, read_json
from ringtrain.prepared import Manifest as DatasetManifest

DEEP = b"[" * 100_000


@pytest.mark.parametrize(
    ("text", "max_bytes", "limit", "message"),
    [
        (b'{"a": 1}', 7, TOO_LARGE, "holds more than 7 bytes"),
        (DEEP, None, TOO_DEEP, "nests too deeply to be read"),
        (b"{half", None, None, "is not valid JSON: Expecting property name"),
        (b"\xff\xfe\x00", None, None, "is not valid JSON"),
    ],
    ids=["too-large", "too-deep", "not-json", "not-text"],
)
def test_a_refusal_names_the_limit_that_failed(text: bytes, max_bytes: int, limit: str, message: str) -> None:
    with pytest.raises(JsonFileError, match=message) as refused:
        parse_json(text, max_bytes)
    assert refused.value.limit == limit
    assert bool(refused.value.detail) == (limit is None)


def test_what_is_within_the_limits_parses_from_any_text() -> None:
    value = {"a": [1, {"b": None}]}
    for text in ('{"a": [1, {"b": null}]}', b'{"a": [1, {"b": null}]}', memoryview(b'  {"a": [1, {"b": null}]}  ')):
        assert parse_json(text, max_bytes=32) == value
    assert parse_json(b"[" * 50 + b"]" * 50, max_bytes=None) == parse_json("[" * 50 + "]" * 50)


def test_a_file_past_the_limit_is_refused_unread(tmp_path: Path) -> None:
    huge = tmp_path / "config.json"
    with open(huge, "wb") as f:
        f.truncate(1 << 40)  # sparse: reading it whole would take a terabyte
    with pytest.raises(JsonFileError, match="holds more than 1,024 bytes") as refused:
        read_json(huge, limit=1024)
    assert refused.value.limit == TOO_LARGE


@pytest.mark.parametrize(
    ("read", "error", "message"),
    [
        (lambda: DatasetManifest.loads(DEEP, "m.json"), DataError, "m.json: nests too deeply to be a manifest"),
        (lambda: DatasetManifest.loads(b"{half", "m.json"), DataError, r"m.json: not valid JSON \(Expecting"),
        (lambda: Manifest.decode(DEEP, step=3), ManifestInvalid, "manifest nests too deeply to be read"),
        (lambda: Manifest.decode(b"{half", step=3), ManifestInvalid, "manifest is not valid JSON: Expecting"),
        (lambda: decode(b"RTSNAP01" + (100_000).to_bytes(8, "little") + DEEP), SnapshotFormatError,
         "the header nests too deeply to be read"),
        (lambda: decode(b"RTSNAP01" + (5).to_bytes(8, "little") + b"{half"), SnapshotFormatError,
         r"the header is not JSON \(Expecting"),
    ],
    ids=["dataset-deep", "dataset-not-json", "checkpoint-deep", "checkpoint-not-json", "snapshot-deep", "snapshot-not-json"],
)
def test_each_reader_words_the_refusal_for_what_it_reads(read: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        read()  # type: ignore[operator]
