"""What a Trainer is given for DPO's and IPO's reference (``train/reference.py``): the table the
run already holds, or the weights to take it with. Plain values, no torch: the driver makes them
and hands them to every rank of a world forming."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

# The key every message about the reference model names.
REFERENCE_KEY = "train.preference.reference"


@dataclass(frozen=True)
class ReferenceWeights:
    """A model to score the reference with in the policy's place: a Hugging Face folder's
    safetensors, or a checkpoint's shards (every rank's, as a restore reads them)."""

    where: str  # what it is, for messages
    folder: str = ""
    shards: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class Reference:
    """The table already taken (``[pairs, 2]`` fp64), or the weights to take it with (None:
    the starting weights)."""

    table: Optional[np.ndarray] = None
    weights: Optional[ReferenceWeights] = None
