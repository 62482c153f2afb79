"""Links in a folder from elsewhere: a file may be a link only to a place inside the folder (or,
in a Hugging Face cache snapshot, into its repository's blobs). The commands that read such
folders are tested with their own input: tests/hf/test_bad_input.py (``ringtrain run``),
tests/prepare/test_bad_input.py (``prepare``), tests/unit/test_export.py,
tests/unit/test_eval_cli_errors.py and tests/unit/test_report.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringtrain.errors import ConfigError
from ringtrain.links import check_folder, check_inside, homes
from ringtrain.train.data import check_data_path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "secret.txt").write_text("not the folder's")
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "sub" / "merges.txt").write_text("a b")
    return folder


def test_a_folder_without_links_or_with_links_inside_passes(folder: Path) -> None:
    (folder / "alias.json").symlink_to("config.json")
    (folder / "sub" / "up.json").symlink_to("../config.json")
    (folder / "again").symlink_to("sub")
    check_folder(folder, "model.hf")
    assert check_inside(folder, folder / "again" / "merges.txt", "model.hf") == (folder / "sub" / "merges.txt").resolve()


@pytest.mark.parametrize(
    ("entry", "target"),
    [("merges.txt", "../secret.txt"), ("sub/deep.txt", "/proc/self/environ"), ("linked-folder", ".."), ("absolute", "{secret}")],
)
def test_a_link_out_of_the_folder_is_refused_naming_it(folder: Path, entry: str, target: str) -> None:
    secret = folder.parent / "secret.txt"
    (folder / entry).symlink_to(target.format(secret=secret))
    with pytest.raises(ConfigError) as refused:
        check_folder(folder, "model.hf")
    assert refused.value.key == "model.hf"
    assert refused.value.reason.startswith(f"{folder / entry} leads through a link to ")
    assert f", outside {folder}: " in refused.value.reason


def test_a_file_under_a_linked_folder_is_refused_by_where_it_really_is(folder: Path) -> None:
    (folder / "out").symlink_to(folder.parent)
    with pytest.raises(ConfigError, match=r"out/secret.txt leads through a link to .*/secret.txt, outside"):
        check_inside(folder, folder / "out" / "secret.txt", "SRC")


def test_the_folder_itself_may_be_a_link(folder: Path, tmp_path: Path) -> None:
    (tmp_path / "named").symlink_to(folder)
    check_folder(tmp_path / "named", "model.hf")
    check_inside(tmp_path / "named", tmp_path / "named" / "config.json", "model.hf")


def test_a_hugging_face_cache_snapshot_may_link_into_its_blobs_only(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "f00d").write_text("{}")
    (snapshot / "config.json").symlink_to("../../blobs/f00d")
    assert homes(snapshot) == (snapshot.resolve(), (repo / "blobs").resolve())
    check_folder(snapshot, "model.hf")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    (snapshot / "tokenizer.json").symlink_to("../../refs/main")  # the repository, not its blobs
    with pytest.raises(ConfigError, match="tokenizer.json leads through a link"):
        check_folder(snapshot, "model.hf")


def test_a_folder_named_like_a_snapshot_outside_a_cache_gets_no_blobs(tmp_path: Path) -> None:
    snapshot = tmp_path / "mine" / "snapshots" / "v1"
    snapshot.mkdir(parents=True)
    assert homes(snapshot) == (snapshot.resolve(),)


def test_a_text_corpus_folder_as_data_path_refuses_a_link_out(folder: Path) -> None:
    """``data.path`` as a folder of text: every file of it is read as training text."""
    check_data_path(str(folder))
    (folder / "notes.txt").symlink_to(folder.parent / "secret.txt")
    with pytest.raises(ConfigError, match=r"^data\.path: .*notes\.txt leads through a link"):
        check_data_path(str(folder))
