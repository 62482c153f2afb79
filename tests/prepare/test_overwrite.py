"""`ringtrain prepare --overwrite` replaces a dataset it wrote, and nothing else: a folder without
its manifest, with a manifest that is not one, or holding files its manifest does not list is
refused (exit 2, one line naming --out and what is in the way), and left byte for byte as it was.
The same rules for s3:// outputs run against a real S3 server in tests/s3/test_prepare_s3.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from ringtrain import cli
from ringtrain.prepared import Manifest
from tests.corpus import write_jsonl


def prepare(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["prepare", "--quiet", "--parallelism", "1", "--tokenizer", "bytes", *args])
    return code, capsys.readouterr().err


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "src" / "a.jsonl", [{"text": f"document {i}"} for i in range(20)])


def test_a_dataset_prepare_wrote_is_replaced(serial: None, src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert prepare([str(src), "--out", str(out)], capsys)[0] == 0
    first = Manifest.load(out)
    write_jsonl(src, [{"text": "other"}])
    code, err = prepare([str(src), "--out", str(out), "--overwrite"], capsys)
    assert code == 0, err
    assert Manifest.load(out).num_documents == 1 != first.num_documents


def _user_folder(out: Path) -> None:
    (out / "thesis").mkdir(parents=True)
    (out / "thesis" / "chapter1.tex").write_text("years of work")


def _foreign_manifest(out: Path) -> None:
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"name": "some-other-tool", "files": []}))


def _extra_file(out: Path) -> None:
    (out / "notes.txt").write_text("mine")


CASES: dict[str, tuple[Callable[[Path], None], bool, str]] = {
    # name: (make the folder, start from a real dataset, what the error says)
    "a folder of the user's": (_user_folder, False, "holds no manifest.json of a prepared dataset"),
    "another tool's manifest.json": (_foreign_manifest, False, "manifest.json: field format is missing"),
    "a dataset with a file of the user's": (_extra_file, True, "holds notes.txt, which its manifest does not list"),
}


@pytest.mark.parametrize("case", CASES)
def test_overwrite_refuses_what_prepare_did_not_write(
    serial: None, src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    make, from_dataset, reason = CASES[case]
    out = tmp_path / "out"
    if from_dataset:
        assert prepare([str(src), "--out", str(out)], capsys)[0] == 0
    make(out)
    before = snapshot(out)
    code, err = prepare([str(src), "--out", str(out), "--overwrite"], capsys)
    assert code == 2, err
    assert err.startswith(f"ringtrain: config error: --out: {out}") and reason in err and err.count("\n") == 1, err
    assert "--overwrite replaces only a dataset `ringtrain prepare` wrote" in err
    assert snapshot(out) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind
