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
from ringtrain_dev.corpus import write_jsonl


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


@pytest.mark.parametrize("overwrite", [False, True], ids=["into-a-new-folder", "over-a-dataset"])
def test_what_appears_at_out_while_prepare_runs_is_never_replaced(
    serial: None, src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    overwrite: bool,
) -> None:
    """--out is checked before prepare starts and judged again when the dataset is published: a
    file the user writes there meanwhile stops the publish (exit 2, naming --out); the folder is
    left as it was and the prepared dataset kept beside it, named in the message."""
    from ringtrain.prepare import writer

    out = tmp_path / "out"
    if overwrite:
        assert prepare([str(src), "--out", str(out)], capsys)[0] == 0
    publish = writer.LocalOutput.publish

    def after_the_user_writes(self: writer.LocalOutput, manifest: Manifest) -> None:
        out.mkdir(exist_ok=True)
        (out / "notes.txt").write_text("mine")
        publish(self, manifest)

    monkeypatch.setattr(writer.LocalOutput, "publish", after_the_user_writes)
    before = snapshot(out) if overwrite else {}
    code, err = prepare([str(src), "--out", str(out), *(["--overwrite"] if overwrite else [])], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--out: {out}" in err and "nothing there was replaced, and the prepared dataset is kept at" in err
    assert snapshot(out) == {**before, "notes.txt": b"mine"}
    kept = Path(err.strip().rsplit(" at ", 1)[1])
    assert Manifest.load(kept).num_documents == 20
