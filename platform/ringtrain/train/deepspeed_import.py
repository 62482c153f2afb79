"""DeepSpeed imported without the package its autotuner would pull in.

DeepSpeed 0.19 imports ``mlflow`` at import time whenever it is installed (its autotuner, which
ringtrain never runs, logs there): two seconds of CPU in every process that imports DeepSpeed,
every rank of every run, on any machine where ``ringtrain[mlflow]`` is installed. ``import_deepspeed()``
imports it with mlflow hidden for the import alone, so a process that does log to MLflow (the
driver, telemetry/mlflow_tracker.py) still imports mlflow afterwards.
"""

from __future__ import annotations

import sys
from types import ModuleType

# Imported by DeepSpeed at import time and never used by ringtrain's ranks.
HIDDEN = ("mlflow",)


def import_deepspeed() -> ModuleType:
    """The deepspeed package; the first import in a process leaves HIDDEN unimported."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hidden = [name for name in HIDDEN if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises ImportError
    try:
        import deepspeed as module
    finally:
        for name in hidden:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]
    return module
