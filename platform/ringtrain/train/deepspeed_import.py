"""DeepSpeed imported without the modules that would cost every rank seconds for nothing.

Two of DeepSpeed 0.19's imports run work ringtrain never uses, in every process that builds an
engine, every rank of every run:

- ``import deepspeed`` imports ``mlflow`` whenever it is installed (its autotuner logs there):
  two seconds of CPU. It is hidden for that import alone, so a process that does log to MLflow
  (the driver, telemetry/mlflow_tracker.py) still imports it afterwards.
- Building a ZeRO engine imports DeepSpeed's Muon optimizer to compare the optimizer's class
  with it (``is_zero_supported_optimizer``, the ZeRO stages' ``isinstance`` checks), and ZeRO-1/2
  import its ``muon_update`` before every gradient partition's loop; both modules apply
  ``torch.compile`` at import, which imports TorchInductor: two seconds more. ringtrain trains
  with AdamW only, so both are replaced by stand-ins: a ``MuonWithAuxAdam`` no optimizer is an
  instance of, so every check answers as DeepSpeed's own does for AdamW, and a ``muon_update``
  that DeepSpeed calls for Muon parameters only, and that raises if it ever were.
"""

from __future__ import annotations

import sys
from types import ModuleType

# Imported by ``import deepspeed`` and never used by ringtrain's ranks.
HIDDEN_AT_IMPORT = ("mlflow",)
MUON_OPTIMIZER = "deepspeed.runtime.zero.muon.muon_optimizer"
MUON_UPDATE = "deepspeed.runtime.zero.muon.original_muon"


class _NoMuon:
    """What DeepSpeed compares optimizers with: no optimizer ringtrain builds is one."""


def _no_muon_update(*args: object, **kwargs: object) -> None:
    raise RuntimeError("DeepSpeed's Muon is not loaded in ringtrain's ranks: they train with AdamW")


def _stand_in(name: str, **attributes: object) -> ModuleType:
    module = ModuleType(name, "ringtrain's stand-in (deepspeed_import.py): the real module compiles kernels at import")
    module.__dict__.update(attributes)
    return module


# What replaces each module, unless the process imported the real one already.
STAND_INS = {MUON_OPTIMIZER: {"MuonWithAuxAdam": _NoMuon}, MUON_UPDATE: {"muon_update": _no_muon_update}}


def import_deepspeed() -> ModuleType:
    """The deepspeed package, with STAND_INS for its Muon modules in place; when this is the
    process's first import of it, HIDDEN_AT_IMPORT stay unimported."""
    module = sys.modules.get("deepspeed") or _first_import()
    for name, attributes in STAND_INS.items():
        if name not in sys.modules:  # not imported yet: nothing has compared with the real class
            sys.modules[name] = _stand_in(name, **attributes)
    return module


def _first_import() -> ModuleType:
    hidden = [name for name in HIDDEN_AT_IMPORT if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises ImportError
    try:
        import deepspeed as module
    finally:
        for name in hidden:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]
    return module
