"""The data cache folder: this user's own and private, the default and a named one alike, refused
when someone else's or a link; files written into it through exclusively opened temp files."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from ringtrain.cachedir import CACHE_ENV, data_cache_dir, write_cached
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
    named.chmod(0o777)
    assert data_cache_dir(str(named)) == named and mode(named) == 0o700


def test_a_named_folder_that_is_a_link_is_refused_naming_the_key(temp_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = temp_root / "elsewhere"
    elsewhere.mkdir()
    link = temp_root / "cache"
    link.symlink_to(elsewhere)
    with pytest.raises(DataError, match=rf"{link}: the data cache is not a folder .* name another data\.cache_dir"):
        data_cache_dir(str(link))
    monkeypatch.setenv(CACHE_ENV, str(link))
    with pytest.raises(DataError, match=rf"set {CACHE_ENV} to another folder"):
        data_cache_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_named_folder_of_another_user_is_refused(temp_root: Path) -> None:
    planted = temp_root / "cache"
    planted.mkdir()
    planted.chmod(0o777)
    os.chown(planted, 65534, 65534)
    with pytest.raises(DataError, match=rf"{planted}: the data cache belongs to uid 65534, not to this user"):
        data_cache_dir(str(planted))
    assert mode(planted) == 0o777  # left as it was found


def test_a_cached_file_is_written_whole_through_a_private_temp_file(temp_root: Path) -> None:
    """A link planted where a temp file would be named (the old scheme named it from the pid
    and thread) is never followed: the temp file's name is random and it is opened exclusively."""
    import threading

    cache = data_cache_dir()
    target = cache / "shards" / "00000.tokens.npy"
    target.parent.mkdir()
    victim = temp_root / "victim"
    victim.write_text("the user's file")
    planted = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    planted.symlink_to(victim)
    write_cached(target, b"new shard")
    write_cached(target, b"newer shard")
    assert target.read_bytes() == b"newer shard" and not target.is_symlink()
    assert victim.read_text() == "the user's file"
    assert sorted(p.name for p in target.parent.iterdir()) == [planted.name, target.name]  # no temp left
