"""JSON that may come from elsewhere, parsed with bounds: the one parser of a small file from a
folder made elsewhere (a model folder, a tokenizer folder, an export), a prepared dataset's
manifest, a checkpoint's manifest and a snapshot's header.

Two limits hold, and a refusal says which one failed (``JsonFileError.limit``): the bytes a
document may take (one past them is not what it claims to be and is refused unparsed), and the
depth Python's parser recurses to (a document nested deeper is refused, instead of a traceback).
Small files (config.json, tokenizer_config.json, a safetensors index, an export's record) are a
few KB: ``read_json`` reads at most ``MAX_BYTES`` of one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

# Far above any real one (a 405B model's safetensors index is ~100 KB; chat templates ~10 KB).
MAX_BYTES = 16 << 20
# The limits a refusal names (JsonFileError.limit); one that names none is not JSON at all.
TOO_LARGE = "bytes"
TOO_DEEP = "depth"

Text = Union[str, bytes, bytearray, memoryview]


class JsonFileError(ValueError):
    """What is wrong with the JSON, worded to follow what holds it: '<path> <message>'.

    ``limit``: the limit that failed (``TOO_LARGE``, ``TOO_DEEP``), None when the text is not
    JSON; ``detail``: the parser's own words for what it could not read there."""

    def __init__(self, message: str, limit: Optional[str] = None, detail: str = "") -> None:
        super().__init__(message)
        self.limit = limit
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.limit, self.detail))


def parse_json(text: Text, max_bytes: Optional[int] = MAX_BYTES) -> Any:
    """The JSON value ``text`` holds, once it is at most ``max_bytes`` long (None: whatever its
    length, for text a caller bounded already) and nested no deeper than the parser recurses;
    JsonFileError saying which limit failed, or that it is not JSON."""
    if max_bytes is not None and len(text) > max_bytes:
        raise JsonFileError(f"holds more than {max_bytes:,} bytes, more than such a file may: not read", TOO_LARGE)
    try:
        return json.loads(bytes(text) if isinstance(text, memoryview) else text)
    except RecursionError:
        raise JsonFileError("nests too deeply to be read", TOO_DEEP) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise JsonFileError(f"is not valid JSON: {exc}", detail=str(exc)) from None


def read_json(path: Union[str, Path], limit: int = MAX_BYTES) -> Any:
    """The JSON value the file holds; JsonFileError when it is too large, not JSON or nested too
    deep; OSError when it cannot be read (a missing file: FileNotFoundError)."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)  # one past the bound: enough to tell a file over it
    return parse_json(data, limit)
