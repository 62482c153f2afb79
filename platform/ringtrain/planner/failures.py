"""Failure profiles: how often a cluster's parts fail, by the kind of recovery each needs.

A profile gives failures per GPU-hour for each kind the goodput simulation (``planner.goodput``)
tells apart:

- ``device``: one GPU is lost (its worker dies and the device stays out until repaired);
- ``node``: a whole node is lost (a host, its NIC or its switch: every GPU on it);
- ``software``: a step fails with no hardware lost (a bug, a collective timeout);
- ``sdc``: a device computes wrong numbers silently until a probe round catches it.

The built-in profiles cite their sources; a file of rates by kind is the user's own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ringtrain.errors import ConfigError

KINDS = ("device", "node", "software", "sdc")
HOURS_PER_DAY = 24.0


@dataclass(frozen=True)
class FailureProfile:
    """Failures per GPU-hour by kind, and where the figures come from."""

    name: str
    source: str
    per_gpu_hour: dict[str, float]

    @property
    def total_per_gpu_hour(self) -> float:
        return sum(self.per_gpu_hour.values())

    def mtbf_h(self, gpus: int) -> float:
        """Hours between failures of a job on ``gpus`` GPUs."""
        return 1.0 / (self.total_per_gpu_hour * gpus)


def _split(per_gpu_hour: float, shares_percent: dict[str, float]) -> dict[str, float]:
    total = sum(shares_percent.values())
    return {kind: per_gpu_hour * share / total for kind, share in shares_percent.items()}


# Llama 3 405B's pre-training: 419 unexpected interruptions in 54 days on 16,384 H100 GPUs
# (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4 and Table 5). Table 5's
# shares, grouped by the recovery each needs: the GPU's own failures (faulty GPU 30.1%, HBM3
# 17.2%, SRAM 4.5%, system processor 4.1%, thermal interface and sensor 1.4%) lose a device;
# software bugs (12.9%) and NCCL watchdog timeouts (1.7%) lose no hardware; silent data
# corruption is 1.4%; the rest (network switches and cables 8.4%, host maintenance 7.6%, NICs
# 1.7% and the other host parts) take a node out.
_LLAMA3_SHARES = {"device": 57.3, "software": 14.6, "sdc": 1.4, "node": 100.0 - 57.3 - 14.6 - 1.4}
LLAMA3 = FailureProfile(
    "llama3",
    "Llama 3 405B on 16,384 H100s: 419 unexpected interruptions in 54 days (Dubey et al. 2024, Table 5)",
    _split(419 / (54 * HOURS_PER_DAY * 16_384), _LLAMA3_SHARES),
)
# Meta's research clusters: 6.50 failures per 1,000 node-days on RSC-1 (Kokolis et al.,
# "Revisiting Reliability in Large-Scale Machine Learning Research Clusters", HPCA 2025), on
# nodes of 8 GPUs; the paper's rate has no split by this profile's kinds, so Llama 3's is used.
META_RSC = FailureProfile(
    "meta-rsc",
    "Meta RSC-1: 6.50 failures per 1,000 node-days of 8 GPUs (Kokolis et al., HPCA 2025); kinds split as llama3's",
    _split(6.50 / 1000 / HOURS_PER_DAY / 8, _LLAMA3_SHARES),
)
PROFILES = {p.name: p for p in (LLAMA3, META_RSC)}


def profile(name_or_path: str) -> FailureProfile:
    """A built-in profile by name, or a JSON file of ``{"per_gpu_hour": {kind: rate}}`` (any of
    KINDS; the rest 0) with an optional ``"source"``."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError("--failures", f"{name_or_path!r} is neither a profile ({', '.join(PROFILES)}) nor a file")
    try:
        data = json.loads(path.read_text())
        rates = data["per_gpu_hour"]
        unknown = sorted(set(rates) - set(KINDS))
        if unknown:
            raise ConfigError("--failures", f"{path}: unknown kinds {unknown}; the kinds are {', '.join(KINDS)}")
        per_gpu_hour = {kind: float(rates.get(kind, 0.0)) for kind in KINDS}
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ConfigError("--failures", f'{path}: expected {{"per_gpu_hour": {{kind: failures per GPU-hour}}}} ({exc})') from None
    # NaN passes no comparison and infinity every upper one: both are refused by name.
    if not all(math.isfinite(rate) and rate >= 0 for rate in per_gpu_hour.values()) or not any(per_gpu_hour.values()):
        raise ConfigError("--failures", f"{path}: rates must be finite numbers >= 0, not all 0")
    return FailureProfile(path.stem, str(data.get("source", path)), per_gpu_hour)
