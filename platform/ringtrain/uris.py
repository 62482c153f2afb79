"""Storage URIs: the schemes ringtrain reads and writes (checkpoints, prepared datasets, sources)
and the two questions every caller asks of one, declared once.

``file://`` (or a plain path) is the local file system; ``s3://bucket/prefix`` an S3-compatible
object store, reached through boto3. A new backend adds its scheme here, then its backend in
``checkpoint/`` (``open_store``) and, for datasets, its reader in ``train/corpus.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

FILE = "file://"
S3 = "s3://"
SCHEMES = (FILE, S3)


def is_s3(uri: Union[str, Path]) -> bool:
    return str(uri).startswith(S3)


def has_scheme(uri: str) -> bool:
    """Whether ``uri`` names a scheme at all (``scheme://...``), known or not."""
    return "://" in uri


def is_known(uri: str) -> bool:
    """A plain path, or a URI of one of ``SCHEMES``."""
    return not has_scheme(uri) or uri.startswith(SCHEMES)


def local_path(uri: Union[str, Path]) -> Optional[Path]:
    """The local path a plain path or ``file://`` URI names; None for an object store."""
    text = str(uri)
    if has_scheme(text) and not text.startswith(FILE):
        return None
    return Path(text.removeprefix(FILE))
