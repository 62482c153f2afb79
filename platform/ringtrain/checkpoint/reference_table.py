"""DPO's and IPO's reference table in a checkpoint store: one object per key, written once.

The table (``train/reference.py``: each pair's chosen and rejected completion log-prob sums
under the reference model, ``[pairs, 2]`` fp64) is a function of the preference dataset, the
reference weights, the model's forward settings the weights are scored under, and the few
settings that decide which tokens each completion scores. Those make its key (``table_key``); the object's name is the key's digest, so a run that changes any
of them finds no table under its own name and computes one, never reading another key's. The
object holds its key and its values' sha256 beside the values: a read checks all three (a table
whose key or bytes do not match is not used; the caller computes it again, and says why).

An object is one put: a file written to a temporary name and renamed, or one S3 PUT, so a
reader sees the whole table or none. The driver writes it, through the run's fence (the writer
lease), like the checkpoints beside it. Numpy and JSON; no torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ringtrain.checkpoint.backends import ObjectMissing, ObjectTooLarge
from ringtrain.checkpoint.fence import Fence
from ringtrain.checkpoint.fence import confirm as confirm_fence
from ringtrain.checkpoint.store import CheckpointStore
from ringtrain.errors import first_line
from ringtrain.jsonfile import JsonFileError, parse_json

# The store's folder of reference tables, beside its step folders.
TABLES_DIR = "reference-logps"
FORMAT = "ringtrain-reference-logps-1"
_DTYPE = "<f8"
_SHA256_HEX = 64  # the length of a sha256 hex digest


def table_key(*, dataset: str, num_pairs: int, reference: Mapping[str, Any], model: Mapping[str, Any], seq_len: int,
              prefix_sharing: bool, overlong: str, precision: Mapping[str, str]) -> dict[str, Any]:  # fmt: skip
    """What a table is a function of: the dataset (its manifest's digest) and its pairs, the
    reference model's identity, the model settings its forward runs under (shape, rotary
    embeddings, attention windows: a job may change some over the same weights), the row
    length, layout and overlong rule (which decide how much of a long prompt is cut) and the
    precision it was computed at (dtype and device)."""
    return {"format": FORMAT, "dataset": dataset, "num_pairs": int(num_pairs), "reference": dict(reference),
            "model": dict(model), "seq_len": int(seq_len), "prefix_sharing": bool(prefix_sharing), "overlong": overlong,
            "precision": dict(precision)}  # fmt: skip


def object_key(key: Mapping[str, Any]) -> str:
    """The store key of the table of ``key``."""
    digest = hashlib.sha256(_canonical(key)).hexdigest()[:32]
    return f"{TABLES_DIR}/{digest}.table"


@dataclass(frozen=True)
class Found:
    """A lookup's outcome: the table, or None and why none is used (``note``; empty when the store
    simply holds none of this key)."""

    table: Optional[np.ndarray]
    uri: str
    note: str = ""


def save_table(store: CheckpointStore, key: Mapping[str, Any], table: np.ndarray, *, fence: Optional[Fence] = None) -> str:
    """Write ``table`` under ``key`` (one put: all of it or nothing); its URI."""
    values = np.ascontiguousarray(table, dtype=_DTYPE)
    if values.shape != (key["num_pairs"], 2):
        raise ValueError(f"a reference table of shape {values.shape} for {key['num_pairs']} pairs")
    payload = values.tobytes()
    name = object_key(key)
    confirm_fence(fence)
    store.backend.put(name, _header(key, hashlib.sha256(payload).hexdigest()) + b"\n" + payload)
    return store.backend.uri(name)


def load_table(store: CheckpointStore, key: Mapping[str, Any]) -> Found:
    """The table stored under ``key``; ``Found.table`` None when there is none, or when the
    object there is not this key's whole table, or the store will not hand it over (an object it
    refuses to read, a denied or failed request): ``Found.note`` says why. A table is a cache of
    one pass over the data: whoever looks it up computes it again rather than fail on it."""
    name = object_key(key)
    uri = store.backend.uri(name)
    # This key's table is exactly its header, a newline and the values: nothing longer is read.
    header_bytes = len(_header(key, "0" * _SHA256_HEX))
    try:
        blob = store.backend.get(name, limit=header_bytes + 1 + 16 * int(key["num_pairs"]))
    except ObjectMissing:
        return Found(None, uri)
    except ObjectTooLarge:
        return Found(None, uri, f"{uri} is larger than a table of {key['num_pairs']} pairs")
    except Exception as exc:  # noqa: BLE001 - whatever the store raised, the table is taken again
        return Found(None, uri, f"could not read {uri}: {type(exc).__name__}: {first_line(exc)}")
    head, newline, payload = blob.partition(b"\n")
    try:
        header = parse_json(head, max_bytes=header_bytes) if newline else None
    except JsonFileError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        return Found(None, uri, f"{uri} is not a reference table")
    if header.get("key") != json.loads(_canonical(key)):
        return Found(None, uri, f"{uri} was taken for another dataset, reference or layout")
    if header.get("shape") != [key["num_pairs"], 2] or len(payload) != 16 * key["num_pairs"]:
        return Found(None, uri, f"{uri} holds {len(payload)} bytes, not a table of {key['num_pairs']} pairs")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        return Found(None, uri, f"{uri} fails its sha256 check")
    return Found(np.frombuffer(payload, dtype=_DTYPE).reshape(-1, 2).astype(np.float64), uri)


def _header(key: Mapping[str, Any], sha256: str) -> bytes:
    """The object's first line: what it is, its key, its shape and its values' sha256."""
    return _canonical({"format": FORMAT, "key": dict(key), "shape": [int(key["num_pairs"]), 2], "sha256": sha256})


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
