"""A Hugging Face model folder's safetensors, read lazily in parameter coordinates.

``PretrainedWeights`` answers the same question a snapshot's ``FragmentIndex`` does (the values
of elements ``[start, stop)`` of parameter ``name``), so ``ZeroState.load`` puts a pretrained
model into any ZeRO stage through the path a resume uses: each rank reads only the rows of the
fragments it keeps, through safetensors' memory-mapped slices, never the whole file. Adam's
moments of a pretrained model start at zero.
"""

from __future__ import annotations

import math
from pathlib import Path, PurePosixPath
from typing import Any, Mapping, Optional

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from ringtrain.errors import ConfigError
from ringtrain.jsonfile import JsonFileError, read_json
from ringtrain.hf.hfconfig import CONFIG_FILE, norm_style_of, read_hf_config
from ringtrain.hf.names import from_hf, to_hf
from ringtrain.hf.shards import INDEX_FILE


class PretrainedWeights:
    """Tensor name -> file of a model folder, with row-sliced reads into fp32 numpy arrays.

    Tensors are named as the folder's architecture names them (``hf/names.py``): ``style`` is
    its norm style, by default read from its config.json (Llama's without one)."""

    def __init__(self, folder: str | Path, key: str = "model.hf", style: Optional[str] = None) -> None:
        self.folder = Path(folder)
        self.key = key
        if style is None:
            style = norm_style_of(read_hf_config(self.folder, key)) if (self.folder / CONFIG_FILE).is_file() else "llama"
        self.style = style
        self._handles: dict[Path, Any] = {}
        self.files = self._tensor_files()  # Hugging Face tensor name -> file
        self.scalars: dict[str, Any] = {}

    def _tensor_files(self) -> dict[str, Path]:
        index = self.folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = read_json(index)["weight_map"]
            except JsonFileError as exc:
                raise ConfigError(self.key, f"{index} {exc}") from None
            except (KeyError, TypeError) as exc:
                raise ConfigError(self.key, f"{index} is not a safetensors index: {exc}") from None
            if not isinstance(weight_map, dict):
                raise ConfigError(self.key, f"{index} is not a safetensors index: weight_map is not a mapping")
            files = {name: self.folder / _inside_folder(file, name, index, self.key) for name, file in weight_map.items()}
            for file in sorted(set(files.values())):
                if not file.is_file():
                    raise ConfigError(self.key, f"{file.name} is listed in {index} but missing from {self.folder}")
            return files
        shards = sorted(self.folder.glob("*.safetensors"))
        if not shards:
            raise ConfigError(self.key, f"{self.folder} holds no *.safetensors weights")
        return {name: file for file in shards for name in self._open(file).keys()}

    def _open(self, file: Path) -> Any:
        handle = self._handles.get(file)
        if handle is None:
            try:
                handle = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise ConfigError(self.key, f"{file} is not a readable safetensors file ({exc}); truncated or corrupt?") from None
            self._handles[file] = handle
        return handle

    def shape(self, hf_name: str) -> tuple[int, ...]:
        return tuple(self._open(self.files[hf_name]).get_slice(hf_name).get_shape())

    def check(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Every parameter (ringtrain name -> shape) is present with its shape, or a ConfigError
        naming the tensor and its file."""
        for name, shape in shapes.items():
            hf_name = to_hf(name, self.style)
            if hf_name not in self.files:
                raise ConfigError(self.key, f"tensor {hf_name} (for {name}) is missing from {self.folder}")
            theirs = self.shape(hf_name)
            if theirs != tuple(shape):
                raise ConfigError(
                    self.key, f"tensor {hf_name} in {self.files[hf_name].name} has shape {list(theirs)}, the model needs {list(shape)}"
                )

    def unused(self, names: set[str]) -> list[str]:
        """Tensors of the folder no parameter reads (a tied lm_head, rotary buffers): informative."""
        used = {to_hf(n, self.style) for n in names}
        return sorted(n for n in self.files if n not in used)

    def read(self, name: str, key: str, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of ringtrain parameter ``name`` flattened, as fp32; zeros
        for Adam's moments, which a pretrained checkpoint does not carry."""
        if key != "param":
            return np.zeros(stop - start, dtype=np.float32)
        hf_name = to_hf(name, self.style)
        view = self._open(self.files[hf_name]).get_slice(hf_name)
        shape = view.get_shape()
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        first, last = start // row, -(-stop // row)  # only the rows that hold the range
        rows = view[first:last] if len(shape) > 1 else view[start:stop]
        flat = rows.to(torch.float32).reshape(-1).numpy()
        offset = start - first * row if len(shape) > 1 else 0
        return flat[offset : offset + stop - start]

    def full(self, name: str) -> np.ndarray:
        shape = self.shape(to_hf(name, self.style))
        return self.read(name, "param", 0, math.prod(shape)).reshape(shape)

    def ringtrain_name(self, hf_name: str) -> str:
        return from_hf(hf_name, self.style)


def _inside_folder(file: Any, tensor: str, index: Path, key: str) -> str:
    """A weight_map entry as a path inside the model folder, or a ConfigError naming it: an index
    written to point at ``/etc/...`` or ``../..`` must not make a run open files elsewhere. The
    path is judged as written; links inside the folder are the folder's own (a Hugging Face cache
    links every file to its blob store)."""
    if not isinstance(file, str) or not file:
        raise ConfigError(key, f"{index}: weight_map[{tensor!r}] is {file!r}, not a file name")
    path = PurePosixPath(file)
    if path.is_absolute() or "\\" in file or any(part in ("..", "") for part in file.split("/")):
        raise ConfigError(key, f"{index}: weight_map[{tensor!r}] is {file!r}, which points outside the model folder {index.parent}")
    return file


def load_full(model: torch.nn.Module, weights: PretrainedWeights) -> None:
    """Copy every parameter whole into an unpartitioned model (one process, no ZeRO): for
    evaluation and tests. Training loads through ``ZeroState.load`` instead."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    weights.check(shapes)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(weights.full(name)).to(p.dtype))


def check_pretrained(job: Any, folder: str = "", key: str = "model.hf") -> None:
    """Before any worker starts: every tensor the job's model needs is in ``folder`` (default
    ``model.hf``) with its shape, and every file opens (a truncated safetensors fails here,
    naming it); errors name ``key``."""
    from ringtrain.train.model import ModelArgs, Transformer

    def no_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("shape check only")

    with torch.device("meta"):  # shapes without memory, whatever the model's size
        model = Transformer(ModelArgs.from_job(job), attention_fn=no_attention, init_std=None)
    weights = PretrainedWeights(folder or job.model.hf, key=key)
    for file in sorted(set(weights.files.values())):
        weights._open(file)
    weights.check({name: tuple(p.shape) for name, p in model.named_parameters()})
