"""The data cache folder: this user's own and private by default, refused when someone else's."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from ringtrain.cachedir import CACHE_ENV, data_cache_dir
from ringtrain.errors import DataError


@pytest.fixture
def temp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.delenv(CACHE_ENV, raising=False)
    return tmp_path


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_default_is_a_private_folder_of_this_user(temp_root: Path) -> None:
    path = data_cache_dir()
    assert path == temp_root / f"ringtrain-data-cache-{os.getuid()}"
    assert path.is_dir() and mode(path) == 0o700 and os.lstat(path).st_uid == os.getuid()
    assert data_cache_dir() == path  # found again as it is


def test_a_folder_of_another_user_is_refused(temp_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Made first by someone else (here: the folder is ours, and this process pretends to be
    another uid, which names the same path for that uid)."""
    owner = os.getuid()
    other = owner + 4242
    planted = temp_root / f"ringtrain-data-cache-{other}"
    planted.mkdir(mode=0o777)
    monkeypatch.setattr(os, "getuid", lambda: other)
    with pytest.raises(DataError, match=rf"{planted}: the data cache belongs to uid {owner}, not to this user"):
        data_cache_dir()


def test_a_link_is_refused_and_an_open_folder_of_ours_made_private(temp_root: Path) -> None:
    path = temp_root / f"ringtrain-data-cache-{os.getuid()}"
    elsewhere = temp_root / "elsewhere"
    elsewhere.mkdir()
    path.symlink_to(elsewhere)
    with pytest.raises(DataError, match="is not a folder"):
        data_cache_dir()
    path.unlink()
    path.mkdir()
    path.chmod(0o777)
    assert data_cache_dir() == path and mode(path) == 0o700


def test_a_named_folder_is_used_and_made_private_when_new(temp_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    named = temp_root / "mine" / "cache"
    assert data_cache_dir(str(named)) == named and mode(named) == 0o700
    monkeypatch.setenv(CACHE_ENV, str(temp_root / "from-env"))
    assert data_cache_dir() == temp_root / "from-env"
    assert data_cache_dir(str(named)) == named  # the config key wins over the variable
