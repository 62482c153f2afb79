"""Hugging Face interop: config.json <-> model keys, parameter names, safetensors in and out."""

from ringtrain.hf.hfconfig import ARCHITECTURES, read_hf_config, resolve_job

__all__ = ["ARCHITECTURES", "read_hf_config", "resolve_job"]
