"""Rotary position embeddings: inverse frequencies for each rope_scaling type, and cos/sin.

The four types a training job can use, computed as Hugging Face transformers computes them (the
reference the model is checked against), so that a pretrained model's positions mean what they
meant in pretraining:
- ``default``: theta ** (-2i / D) (Su et al. 2021).
- ``linear``: every frequency divided by ``factor`` (position interpolation, Chen et al. 2023).
- ``llama3``: low frequencies divided by ``factor``, high ones kept, a smooth ramp between
  (Llama 3.1's long-context recipe).
- ``yarn``: NTK-by-parts interpolation with a ramp between ``beta_fast`` and ``beta_slow``
  rotations, and cos/sin scaled by ``0.1 ln(factor) + 1`` (Peng et al. 2023, eqs. 17-22).

Positions are true token positions: a context-parallel rank holds non-contiguous pieces of the
sequence (zigzag) and each token rotates by its place in the whole sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch


@dataclass(frozen=True)
class Rope:
    """What a model's rotary embeddings need: per-pair inverse frequencies and a cos/sin scale."""

    inv_freq: torch.Tensor  # [D/2] float32, where the model was built
    attention_factor: float = 1.0
    # inv_freq per device it was used on: copied there once, not on every forward (a host to
    # device copy that would block each layer's launch queue). Not a module buffer, which a
    # model-wide cast to bf16 would round.
    _on_device: dict[torch.device, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._on_device:
            self._on_device[device] = self.inv_freq.to(device)
        return self._on_device[device]

    def cos_sin(self, position_ids_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [B, S, 1, D/2] in fp32, so long positions keep their precision."""
        inv_freq = self.inv_freq_on(position_ids_BS.device)
        angles = position_ids_BS.float()[..., None] * inv_freq
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos[:, :, None, :], sin[:, :, None, :]


def rope_type(scaling: Optional[Mapping[str, Any]]) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def build_rope(head_dim: int, theta: float, scaling: Optional[Mapping[str, Any]] = None) -> Rope:
    kind = rope_type(scaling)
    # The same expression as the reference, so the frequencies agree to the bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    if kind == "default":
        return Rope(inv_freq)
    assert scaling is not None
    factor = float(scaling["factor"])
    if kind == "linear":
        return Rope(inv_freq / factor)
    if kind == "llama3":
        return Rope(_llama3(inv_freq, factor, scaling))
    if kind == "yarn":
        return _yarn(head_dim, theta, factor, scaling)
    raise ValueError(f"rope_type {kind!r} is not one of default, linear, llama3, yarn")


def _llama3(inv_freq: torch.Tensor, factor: float, scaling: Mapping[str, Any]) -> torch.Tensor:
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Wavelengths longer than the pretraining context are interpolated, shorter ones than a
    # quarter of it (at the usual factors) are kept, and those between are blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(head_dim: int, theta: float, factor: float, scaling: Mapping[str, Any]) -> Rope:
    original = float(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)
    truncate = bool(scaling.get("truncate", True))

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits ``num_rotations`` times in the original context.
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: the dimension rotates as in pretraining; 0: fully interpolated
    return Rope(interpolation * (1 - keep) + extrapolation * keep, float(attention_factor))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
