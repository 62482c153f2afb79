"""A durable checkpoint written out as a Hugging Face model folder (``ringtrain export``).

The folder holds ``config.json`` (the source model's, with what training changed: the context
trained at, its rotary settings and attention windows; for a model trained from scratch, that of
the architecture that expresses it, ``hf/architectures.py``), the fp32 master
weights in safetensors files of at most ``max_shard_size`` (with an index when there are
several), and the source model's tokenizer and ``generation_config.json`` when it had them.

Everything the export needs comes from the checkpoint itself (its meta carries the model
section, the sequence length and the source's config.json, see ``actors/resume.py``), so it
runs anywhere the checkpoint can be read, on a CPU and without a world of ranks. It is
written into a temporary folder next to the destination and renamed into place, so a reader
never sees half an export.

The folder also holds ``ringtrain-export.json``: the checkpoint it came from and every file the
export wrote. ``--overwrite`` replaces only such a folder, and only when it holds nothing that
file does not list: a folder of anything else (a model downloaded by hand, a user's notes) is
refused, so an export never deletes what it did not write.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
from safetensors.torch import save_file

from ringtrain import config
from ringtrain.checkpoint import CheckpointStore, LoadedCheckpoint
from ringtrain.checkpoint.layout import CHECKPOINT_FORMAT
from ringtrain.checkpoint.sources import open_source
from ringtrain.config import JobConfig, ModelConfig
from ringtrain.errors import ConfigError
from ringtrain.folderswap import DestinationAppeared, swap_in
from ringtrain.jsonfile import read_json
from ringtrain.links import check_inside
from ringtrain.hf.fragments import MasterWeights
from ringtrain.hf.hfconfig import CONFIG_FILE, hf_config
from ringtrain.hf.names import to_hf
from ringtrain.hf.shards import INDEX_FILE, OutputShard, OutputTensor, index, plan_shards
from ringtrain.train.model import ModelArgs, Transformer

# Files of the source model folder that belong with the weights, copied when present.
SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# What an export leaves in its folder to be known by: see the module docstring.
EXPORT_MANIFEST = "ringtrain-export.json"
EXPORT_FORMAT = "ringtrain-export/1"
# config.json's dtype names -> the export's; float16 has no export dtype (see default_dtype).
_SOURCE_DTYPES = {"bfloat16": "bf16", "float32": "fp32"}

Say = Callable[[str], None]


class ExportError(ConfigError):
    """Bad input to an export; its key names the argument to change (SOURCE, OUT_DIR, ...)."""


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    checkpoint_uri: str
    step: int
    dtype: str
    files: tuple[str, ...]  # every file written, sorted
    num_tensors: int
    num_bytes: int  # tensor data
    num_blob_reads: int  # checkpoint shards read (more than their number under ZeRO-0/3)


def export(
    source: str,
    out_dir: str | Path,
    *,
    dtype: Optional[str] = None,
    max_shard_size: int = 5 * 10**9,
    overwrite: bool = False,
    hf_source: Optional[str] = None,
    say: Say = lambda line: None,
) -> ExportResult:
    """Write checkpoint ``source`` (a run directory, a checkpoint URI or a store URI) as a
    Hugging Face folder ``out_dir``. Bad input raises ExportError before anything is written; a
    blob found damaged or foreign while reading raises CheckpointCorrupt or FragmentError, and
    the half-written temporary folder is removed."""
    out = Path(out_dir).expanduser().absolute()
    _check_destination(out, overwrite)
    if dtype is not None and dtype not in DTYPES:
        raise ExportError("--dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}")
    if hf_source is not None and not Path(hf_source).is_dir():
        raise ExportError("--hf-source", f"no such model folder: {hf_source}")
    store, loaded = open_checkpoint(source)
    _check_not_inside(store, out)
    if out.is_dir() and any(out.iterdir()):
        _check_replaceable(out)
    meta = loaded.meta
    side_files, copied = _side_files(hf_source or meta.get("hf_source"), explicit=hf_source is not None)
    model = model_config(meta, loaded.uri)
    source_cfg = meta.get("hf_config") or None
    if dtype is None:
        dtype = default_dtype(source_cfg, say)
    config = hf_config(model, source_cfg, trained_seq_len=int(meta.get("seq_len") or 0), dtype=dtype)
    tensors = output_tensors(model, DTYPES[dtype])
    shards = plan_shards(tensors, max_shard_size)
    say(
        f"{loaded.uri} (step {loaded.step}): {config['architectures'][0]}, {sum(t.numel for t in tensors):,} "
        f"parameters, {dtype} -> {out} in {len(shards)} file{'s' if len(shards) > 1 else ''}"
    )
    weights = MasterWeights(
        lambda name: store.load(loaded.step, verify=True).shards[name],  # a fresh map: no shard stays cached
        sorted(loaded.shards),
        {t.name: t.shape for t in tensors},
        say,
    )
    tmp = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        for i, shard in enumerate(shards, start=1):
            _write_shard(tmp, shard, weights, DTYPES[dtype])
            say(f"[{i}/{len(shards)}] wrote {shard.file}: {len(shard.tensors)} tensors, {shard.num_bytes / 1e6:,.1f} MB")
        if len(shards) > 1:
            _write_json(tmp / INDEX_FILE, index(shards))
        _write_json(tmp / CONFIG_FILE, config)
        for name, path in side_files:
            _copy_regular(path, tmp / name)
        say(copied)
        written = sorted(p.name for p in tmp.iterdir())
        _write_json(
            tmp / EXPORT_MANIFEST,
            {"format": EXPORT_FORMAT, "checkpoint": loaded.uri, "step": loaded.step, "dtype": dtype, "files": written},
        )
        files = tuple(sorted([*written, EXPORT_MANIFEST]))
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(
        out_dir=out,
        checkpoint_uri=loaded.uri,
        step=loaded.step,
        dtype=dtype,
        files=files,
        num_tensors=len(tensors),
        num_bytes=sum(s.num_bytes for s in shards),
        num_blob_reads=weights.num_reads,
    )


# --- the source --------------------------------------------------------------------------------


def open_checkpoint(source: str) -> tuple[CheckpointStore, LoadedCheckpoint]:
    """The store and checkpoint ``source`` names: a run directory (its newest valid checkpoint),
    ``<store>/step-<n>``, or a store (its newest valid checkpoint); see ``checkpoint.sources``."""
    try:
        found = open_source(source, accept=_is_fragment_checkpoint)
    except ConfigError as exc:
        raise ExportError(exc.key, exc.reason) from None
    return found.store, found.checkpoint


def _is_fragment_checkpoint(meta: Mapping[str, Any]) -> Optional[str]:
    if meta.get("format") != CHECKPOINT_FORMAT:
        return f"format {meta.get('format')!r}, expected {CHECKPOINT_FORMAT!r}"
    return None


def model_config(meta: Mapping[str, Any], uri: str) -> ModelConfig:
    """The model section a checkpoint was trained with, from its meta."""
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ExportError("SOURCE", f"{uri}: format {meta.get('format')!r} is not a ringtrain checkpoint ({CHECKPOINT_FORMAT})")
    section = meta.get("model_config")
    if not isinstance(section, dict):
        raise ExportError(
            "SOURCE",
            f"{uri} was written before checkpoints recorded their model section, which an export needs; "
            "resume the run for a step to write one that does",
        )
    # A checkpoint may come from elsewhere: only ModelConfig's own keys are read (never ``hf``, a
    # folder of this machine), and their values are checked as a job file's would be.
    known = {f.name for f in dataclasses.fields(ModelConfig)} - {"hf"}
    values = {k: v for k, v in section.items() if k in known and v is not None}
    try:
        return config.from_mapping({"model": values}, f"{uri}'s meta").model
    except ConfigError as exc:
        raise ExportError("SOURCE", f"{uri}: the model section its meta records is not valid: {exc}") from None


def default_dtype(source_cfg: Optional[Mapping[str, Any]], say: Say) -> str:
    """The source model's dtype (config.json's ``dtype``, or the older ``torch_dtype``); fp32
    for a model trained from scratch, and for float16, which bf16 would round differently."""
    name = (source_cfg or {}).get("dtype") or (source_cfg or {}).get("torch_dtype")
    if name is None:
        return "fp32"
    if name not in _SOURCE_DTYPES:
        say(f"the source model's dtype {name} is not an export dtype: writing fp32 (--dtype bf16 for half the size)")
        return "fp32"
    return _SOURCE_DTYPES[str(name)]


# --- the tensors -------------------------------------------------------------------------------


def _no_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    raise AssertionError("the export builds the model for its parameter shapes only")


def output_tensors(model: ModelConfig, dtype: torch.dtype) -> list[OutputTensor]:
    """The model's parameters in order, with their Hugging Face names. A tied output projection
    is the embedding matrix, so it is not a parameter of its own and is not written."""
    args = ModelArgs.from_job(JobConfig(model=model))
    with torch.device("meta"):  # shapes without memory
        net = Transformer(args, attention_fn=_no_attention, init_std=None)
    size = torch.empty((), dtype=dtype).element_size()
    return [
        OutputTensor(name, to_hf(name, args.norm_style), tuple(p.shape), p.numel() * size)
        for name, p in net.named_parameters()
    ]


def _write_shard(folder: Path, shard: OutputShard, weights: MasterWeights, dtype: torch.dtype) -> None:
    tensors = {t.name: torch.empty(t.shape, dtype=dtype) for t in shard.tensors}
    weights.gather(tensors)
    save_file({t.hf_name: tensors[t.name] for t in shard.tensors}, str(folder / shard.file), metadata={"format": "pt"})


# --- the destination ---------------------------------------------------------------------------


def _check_destination(out: Path, overwrite: bool) -> None:
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ExportError("OUT_DIR", f"{out} is a file or a link, not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError("OUT_DIR", f"{out} is not empty; use --overwrite to replace it")


def _check_replaceable(out: Path, named: Optional[Path] = None) -> None:
    """ExportError unless ``out`` holds an export's files and nothing else; messages name the
    folder as ``named`` (where the user knows it; default ``out``)."""
    named = named or out
    refuse = "--overwrite replaces only a folder `ringtrain export` wrote; choose a new or empty OUT_DIR"
    if out.is_symlink() or not out.is_dir():
        raise ExportError("OUT_DIR", f"{named} is a file or a link, not a folder: {refuse}")
    try:
        record = read_json(out / EXPORT_MANIFEST)
    except FileNotFoundError:
        raise ExportError("OUT_DIR", f"{named} holds no {EXPORT_MANIFEST}: {refuse}") from None
    except (OSError, ValueError) as exc:
        raise ExportError("OUT_DIR", f"{named / EXPORT_MANIFEST} is unreadable ({exc}): {refuse}") from None
    if not isinstance(record, dict) or record.get("format") != EXPORT_FORMAT or not isinstance(record.get("files"), list):
        raise ExportError("OUT_DIR", f"{named / EXPORT_MANIFEST} is not a ringtrain export record: {refuse}")
    ours = {EXPORT_MANIFEST, *(f for f in record["files"] if isinstance(f, str))}
    foreign = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir() if p.name not in ours or p.is_dir())
    if foreign:
        raise ExportError("OUT_DIR", f"{named} holds {', '.join(foreign[:3])}, which its {EXPORT_MANIFEST} does not list: {refuse}")


def _check_not_inside(store: CheckpointStore, out: Path) -> None:
    """An --overwrite of a folder holding the checkpoint would delete what is being exported."""
    root = getattr(store.backend, "root", None)
    if isinstance(root, Path) and (root == out or out in root.parents):
        raise ExportError("OUT_DIR", f"{out} holds the checkpoint store {store.uri}; export somewhere else")


def _write_json(path: Path, content: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _side_files(source: Optional[str], *, explicit: bool) -> tuple[list[tuple[str, Path]], str]:
    """(name, where it really is) of each side file the source model folder has, checked before
    anything is written (a link out of the folder is refused: ``links``), and the line that
    says what was copied."""
    if not source:
        return [], "no source model folder (trained from scratch): no tokenizer files to copy"
    src = Path(source)
    if not src.is_dir():
        return [], f"the source model folder {source} is gone: no tokenizer or generation_config.json copied (use --hf-source PATH)"
    origin = "--hf-source" if explicit else "the source model folder"
    try:
        found = [(name, check_inside(src, src / name, "--hf-source")) for name in SIDE_FILES if (src / name).is_file()]
    except ConfigError as exc:
        raise ExportError(exc.key, exc.reason) from None
    names = ", ".join(name for name, _ in found)
    return found, (f"copied {names} from {origin} {src}" if found else f"{origin} {src} has no tokenizer or generation files")


def _copy_regular(source: Path, dest: Path) -> None:
    """``source`` (a checked file's real path) into the new regular file ``dest``: read without
    following a link put there since, and written where nothing was ('x' fails on any entry,
    a link included)."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ExportError("--hf-source", f"{source} cannot be read as a file of the model folder ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f, open(dest, "xb") as out:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ExportError("--hf-source", f"{source} is not a regular file")
        shutil.copyfileobj(f, out)


def _publish(tmp: Path, out: Path) -> None:
    """Put the finished folder in place (``folderswap``): what is at ``out`` is replaced only if
    it is still an export's folder or empty when the export ends."""
    for path in tmp.iterdir():  # on disk before the folder becomes visible under its name
        if not stat.S_ISREG(path.lstat().st_mode):  # only files this export wrote, never a link
            raise ExportError("OUT_DIR", f"{path} is not a file the export wrote: nothing was published")
        with open(path, "rb") as f:
            os.fsync(f.fileno())

    def judge(old: Path) -> None:
        if old.is_symlink() or not old.is_dir() or any(old.iterdir()):
            _check_replaceable(old, named=out)

    try:
        swap_in(tmp, out, judge)
    except DestinationAppeared as exc:
        kept = f"; the export it was to replace is at {exc.aside}" if exc.aside is not None else ""
        raise ExportError("OUT_DIR", f"{out} appeared while exporting ({exc.reason}): nothing there was replaced{kept}") from None
