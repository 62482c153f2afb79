"""A finished folder swapped in: what was at the destination judged once moved aside, put back
when refused, deleted once replaced; a folder made there meanwhile stops the swap."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringtrain.folderswap import DestinationAppeared, swap_in


def staged(tmp_path: Path) -> Path:
    folder = tmp_path / ".out.partial"
    folder.mkdir()
    (folder / "new").write_text("new")
    return folder


def hidden(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))


def test_into_nothing_and_over_what_the_judge_accepts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    judged: list[Path] = []
    swap_in(staged(tmp_path), out, judged.append)
    assert judged == [] and (out / "new").read_text() == "new"

    swap_in(staged(tmp_path), out, judged.append)
    (aside,) = judged
    assert aside.parent == tmp_path and aside.name.startswith(".out.replaced-")  # judged where nothing adds to it
    assert not aside.exists() and (out / "new").exists() and hidden(tmp_path) == []


def test_a_refused_destination_is_put_back_untouched(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "theirs").write_text("keep")

    def refuse(old: Path) -> None:
        raise ValueError(f"{old.name} is not ours")

    new = staged(tmp_path)
    with pytest.raises(ValueError, match="not ours"):
        swap_in(new, out, refuse)
    assert [p.name for p in out.iterdir()] == ["theirs"] and (new / "new").exists()


def test_a_folder_made_there_meanwhile_stops_the_swap(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")

    def someone_writes_there(old: Path) -> None:
        out.mkdir()
        (out / "theirs").write_text("theirs")

    new = staged(tmp_path)
    with pytest.raises(DestinationAppeared) as raised:
        swap_in(new, out, someone_writes_there)
    aside = raised.value.aside
    assert aside is not None and (aside / "old").exists(), "the replaced folder is kept, and named"
    assert [p.name for p in out.iterdir()] == ["theirs"] and (new / "new").exists()


def test_a_link_at_the_destination_is_judged_as_a_link_and_removed_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "precious").write_text("x")
    out = tmp_path / "out"
    out.symlink_to(target, target_is_directory=True)
    seen: list[bool] = []
    swap_in(staged(tmp_path), out, lambda old: seen.append(old.is_symlink()))
    assert seen == [True] and (target / "precious").exists() and not out.is_symlink()
