"""A small JSON file from a folder that may come from elsewhere (a model folder, a tokenizer
folder, an export), read with bounds.

Such files are a few KB (config.json, tokenizer_config.json, a safetensors index, an export's
record). One past ``MAX_BYTES`` is not what it claims to be and is refused unread, and a
document nested deeper than Python's parser recurses is refused too, instead of a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

# Far above any real one (a 405B model's safetensors index is ~100 KB; chat templates ~10 KB).
MAX_BYTES = 16 << 20


class JsonFileError(ValueError):
    """What is wrong with the file, worded to follow its path: '<path> <message>'."""


def read_json(path: Union[str, Path], limit: int = MAX_BYTES) -> Any:
    """The JSON value the file holds; JsonFileError when it is too large, not JSON or nested too
    deep; OSError when it cannot be read (a missing file: FileNotFoundError)."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise JsonFileError(f"holds more than {limit:,} bytes, more than such a file may: not read")
    try:
        return json.loads(data)
    except RecursionError:
        raise JsonFileError("nests too deeply to be read") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise JsonFileError(f"is not valid JSON: {exc}") from None
