"""Host memory of loading a pretrained model on 4 ranks of one node: ringtrain against the
naive way, measured in the same run.

A ~58M-parameter Llama (fp32 safetensors, made locally) is loaded for ZeRO-3 training by 4 gloo
ranks on this machine, twice:
- ringtrain: the model is built under ``zero.Init`` (a rank keeps its partition; a full tensor
  exists only while its module is built) and each rank reads only its fragments through
  safetensors' memory-mapped slices (what ``Trainer`` does with ``model.hf``);
- naive: every rank builds the whole model and reads the whole file
  (``safetensors.torch.load_file``), then ``deepspeed.initialize`` partitions it.

Loading is two phases, each measured per rank as the peak resident set during it (``VmHWM``,
reset through ``/proc/self/clear_refs``) less the resident set before it: building the model,
and reading the weights in. The DeepSpeed engine's own state (fp32 master partitions, Adam's
moments, gradient buffers) is created between the two and is not counted: it is the training
state ZeRO-3 keeps by design, and on a GPU it lives in device memory, not on the host.
Reported as multiples of the model's fp32 bytes, summed over the node's ranks:

    loading = sum over ranks of (build peak + read peak) / model bytes

The floor is two copies: the partitions the ranks keep (one copy in all; host memory here, device
memory on a GPU) and the file's pages, each read once somewhere on the node through the memory
map. The naive way holds a whole model and a whole state dict on every rank: about 2 x ranks
copies. Target: ringtrain's loading at most half the naive way's, measured in the same run.

Run: PYTHONPATH=platform .venv/bin/python bench/hf_load.py   (about 2 minutes on 2 cores)
Writes bench/results/hf_load-cpu.json.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from ringtrain_dev.ranks import run_ranks
from ringtrain_dev.record import Run

WORLD = 4
TARGET = 0.5  # ringtrain's loading memory / the naive way's
MODEL = dict(
    vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class Phases:
    """Each phase's peak resident set above the set at its start (KiB)."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self._start = 0

    def start(self) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to VmRSS (Linux >= 4.0)
        self._start = _status_kib("VmRSS")

    def stop(self, name: str) -> None:
        self.peaks[name] = _status_kib("VmHWM") - self._start


def _ringtrain(job: Any, mesh: Any, rank: int, phases: Phases) -> None:
    import torch

    from ringtrain.hf.weights import PretrainedWeights
    from ringtrain.topology import CPLayout
    from ringtrain.train.attention import build_attention
    from ringtrain.train.engine import build_engine, partitioned_construction
    from ringtrain.train.trainer import build_model
    from ringtrain.train.zero_state import ZeroState

    phases.start()
    with partitioned_construction(job, mesh, torch.float32):
        model = build_model(job, build_attention(CPLayout(1, 1), "auto", ring_group=None, ulysses_group=None))
    phases.stop("build")
    zero = ZeroState(build_engine(model, job, mesh, torch.float32, "cpu"), model, 3, rank, WORLD)
    zero.ensure_optimizer_state()
    phases.start()
    zero.load(PretrainedWeights(job.model.hf))  # as Trainer.load_pretrained
    phases.stop("read")


def _naive(job: Any, mesh: Any, rank: int, phases: Phases) -> None:
    import torch
    from safetensors.torch import load_file

    from ringtrain.hf.names import from_hf
    from ringtrain.topology import CPLayout
    from ringtrain.train.attention import build_attention
    from ringtrain.train.engine import build_engine
    from ringtrain.train.trainer import build_model
    from ringtrain.train.zero_state import ZeroState

    phases.start()
    model = build_model(job, build_attention(CPLayout(1, 1), "auto", ring_group=None, ulysses_group=None))
    phases.stop("build")
    phases.start()
    state = {from_hf(name): t for name, t in load_file(Path(job.model.hf) / "model.safetensors").items()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[name])
    del state
    phases.stop("read")
    ZeroState(build_engine(model, job, mesh, torch.float32, "cpu"), model, 3, rank, WORLD).ensure_optimizer_state()


MODES: dict[str, Callable[[Any, Any, int, Phases], None]] = {"ringtrain": _ringtrain, "naive": _naive}


def _rank_main(rank: int, world: int, store: str, folder: str, mode: str, results: Any) -> None:
    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.hf import resolve_job
    from ringtrain.topology import Topology
    from ringtrain.train.mesh import build_mesh
    from ringtrain.train.trainer import set_rank_env

    torch.set_num_threads(1)
    set_rank_env(rank=rank, world_size=WORLD, device=torch.device("cpu"))
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    try:
        job = resolve_job(config.load(None, [
            f"model.hf={folder}", "data.seq_len=64", f"mesh.dp={WORLD}", f"train.global_batch={WORLD}", "zero.stage=3",
        ]))
        mesh = build_mesh(Topology(WORLD, 1, 1), rank)
        phases = Phases()
        MODES[mode](job, mesh, rank, phases)
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, phases.peaks)
        if rank == 0:
            results.put(gathered)
    except BaseException as exc:
        results.put(exc)
        raise
    finally:
        dist.destroy_process_group()


def _measure(folder: Path, mode: str, tmp: Path) -> list[dict[str, int]]:
    return run_ranks(_rank_main, WORLD, tmp, str(folder), mode, timeout=600)


def _save_model(folder: Path) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    model.save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def _summary(ranks: list[dict[str, int]], model_bytes: int) -> dict[str, Any]:
    build = sum(r["build"] for r in ranks) * 1024
    read = sum(r["read"] for r in ranks) * 1024
    return {"ranks_kib": ranks, "build_bytes": build, "read_bytes": read, "build_x_model": build / model_bytes,
            "read_x_model": read / model_bytes, "loading_x_model": (build + read) / model_bytes}


def main() -> int:
    run = Run("hf_load")
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        num_params = _save_model(tmp / "model")
        model_bytes = num_params * 4
        print(f"model: {num_params / 1e6:.1f}M parameters, {model_bytes / 2**20:.0f} MiB in fp32; {WORLD} ranks, ZeRO-3")
        modes = {mode: _summary(_measure(tmp / "model", mode, tmp), model_bytes) for mode in MODES}
    for mode, s in modes.items():
        print(f"{mode:>9}: loading {s['loading_x_model']:.2f}x the model's bytes = build {s['build_x_model']:.2f}x "
              f"+ read {s['read_x_model']:.2f}x (peaks summed over {WORLD} ranks)")
    ratio = modes["ringtrain"]["loading_x_model"] / modes["naive"]["loading_x_model"]
    ok = ratio <= TARGET
    print(f"ringtrain / naive: {ratio:.2f}x; {'PASS' if ok else 'FAIL'} (target <= {TARGET})")
    run.write({"num_params": num_params, "model_bytes": model_bytes, "world_size": WORLD, "zero_stage": 3,
               "target_ringtrain_over_naive": TARGET, "pass": ok, "ringtrain_over_naive": ratio, "modes": modes},
              device_type="cpu")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
