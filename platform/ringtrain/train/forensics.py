"""What a rank shows a hang diagnosis besides its collective records: every thread's Python
stack, and torch's own flight recorder of the process group's collectives."""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from typing import Any, Optional

import torch


def snapshot_stacks(*, exclude_current: bool = True) -> dict[str, list[str]]:
    """Every Python thread's stack, innermost frame last, keyed ``"<name> (<ident>)"``.

    The calling thread is left out by default: it is the diagnostic thread itself.
    """
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    return {
        f"{names.get(ident, 'thread')} ({ident})": [line.rstrip("\n") for line in traceback.format_stack(frame)]
        for ident, frame in sys._current_frames().items()
        if not (exclude_current and ident == me)
    }


def arm_flight_recorder(entries: int = 2048) -> None:
    """Turn on torch's flight recorder; must run before the process group is created.

    torch 2.7+ reads ``TORCH_FR_BUFFER_SIZE`` for every backend (gloo included) and warns on the
    older NCCL-only name, which earlier versions read instead.
    """
    modern = hasattr(torch._C._distributed_c10d, "_dump_fr_trace_json")
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE" if modern else "TORCH_NCCL_TRACE_BUFFER_SIZE", str(entries))


def flight_recorder_dump(*, only_active: bool = False) -> Optional[dict[str, Any]]:
    """torch's flight-recorder trace (NCCL's on CUDA, else the CPU one for gloo), or None.

    None when the recorder is not armed, this build lacks it, or no collective ran yet.
    """
    c = torch._C._distributed_c10d
    names = ["_dump_nccl_trace_json", "_dump_fr_trace_json"] if torch.cuda.is_available() else ["_dump_fr_trace_json"]
    for name in names:
        dump = getattr(c, name, None)
        if dump is None:
            continue
        try:
            trace = json.loads(dump(includeCollectives=True, onlyActive=only_active))
        except Exception:  # no process group yet, or a build whose recorder is off
            continue
        if trace.get("entries"):
            return dict(trace)
    return None
