"""W&B's offline run file (``run-<id>.wandb``) read back through wandb's own record schema.

wandb 0.31 writes the file from its bundled Go core and ships no Python reader of it. The
framing is LevelDB's log format under a 7-byte header (``:W&B``, the magic 0xBEE1 little-endian,
version 0): 32 KiB blocks of chunks, each a 4-byte checksum, a 2-byte little-endian length, a
1-byte type (full, first, middle, last) and the payload; a block's last bytes, too few for a
chunk header, are zero padding. The joined payloads are ``wandb_internal_pb2.Record`` messages.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEADER = b":W&B" + struct.pack("<H", 0xBEE1) + b"\x00"
BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if not data.startswith(HEADER):
        raise ValueError(f"{path}: not a W&B run file (header {data[:7]!r})")
    out = []
    pos, pending = len(HEADER), b""
    while pos + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < CHUNK_HEADER:
            pos += left_in_block  # padding
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        if kind == 0 and length == 0:
            pos += left_in_block  # a block ended early
            continue
        payload = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind == FULL:
            pending = payload
        elif kind == FIRST:
            pending = payload
            continue
        elif kind == MIDDLE:
            pending += payload
            continue
        else:
            pending += payload
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        out.append(record)
        pending = b""
    return out


@dataclass
class OfflineRun:
    """What the run files of one W&B run id hold, over every offline attempt (as ``wandb sync`` joins them)."""

    run_id: str
    history: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> logged keys
    points: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # every point, in order
    config: dict[str, Any] = field(default_factory=dict)
    alerts: list[str] = field(default_factory=list)
    files: set[str] = field(default_factory=set)
    exit_codes: list[int] = field(default_factory=list)


def offline_run(root: Path, run_id: str) -> OfflineRun:
    run = OfflineRun(run_id)
    # A run resumed within the second it ended gets W&B's folder name with "-1" (and so on) added.
    for path in sorted(root.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb")):
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                values = {item.nested_key[0] if item.nested_key else item.key: json.loads(item.value_json) for item in record.history.item}
                step = int(record.history.step.num) if record.history.HasField("step") else int(values.get("_step", -1))
                user = {k: v for k, v in values.items() if not k.startswith("_")}
                run.points.append((step, user))
                run.history.setdefault(step, {}).update(user)
            elif kind in ("config", "run"):
                updates = record.config.update if kind == "config" else record.run.config.update
                for item in updates:
                    key = item.nested_key[0] if item.nested_key else item.key
                    run.config[key] = json.loads(item.value_json)
            elif kind == "alert":
                run.alerts.append(record.alert.title)
            elif kind == "files":
                run.files.update(f.path for f in record.files.files)
            elif kind == "exit":
                run.exit_codes.append(record.exit.exit_code)
    return run
