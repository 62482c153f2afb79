"""Which GPU a worker binds, and what it tells DeepSpeed and NCCL about it, checked on a CPU.

Ray hides the other GPUs of a node from an actor only by narrowing CUDA_VISIBLE_DEVICES, which
it skips with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES set; a worker that took ``cuda:0``
regardless would then share one device with every other worker of the node. These tests pin
the mapping from Ray's GPU ids to a device index, the config rule behind it, and the device
reaching ``LOCAL_RANK``, ``DS_ACCELERATOR`` and ``init_process_group(device_id=...)``.
``ray`` is replaced by a stand-in module, so nothing here starts a cluster or needs a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Optional, Union

import pytest
import torch

from ringtrain import config
from ringtrain.actors import worker as worker_module
from ringtrain.actors.cluster import cuda_device_index, resolve_device
from ringtrain.actors.worker import TrainWorker
from ringtrain.errors import ConfigError
from ringtrain.train import trainer as trainer_module
from ringtrain.train.trainer import set_rank_env, warm_up

REPO = Path(__file__).resolve().parents[2]
RANK_ENV = ("DS_ACCELERATOR", "LOCAL_RANK", "RANK", "WORLD_SIZE")


class _Stop(Exception):
    """Raised by a stand-in once it has seen what the test needs, to end the call there."""


@pytest.fixture
def rank_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the code under test sets in os.environ is undone after the test."""
    for name in RANK_ENV:
        monkeypatch.delenv(name, raising=False)


def _fake_ray(monkeypatch: pytest.MonkeyPatch, *, gpu_ids: list[Any], gpus_in_cluster: float = 0.0) -> None:
    fake = types.ModuleType("ray")
    fake.is_initialized = lambda: True  # type: ignore[attr-defined]
    fake.get_gpu_ids = lambda: list(gpu_ids)  # type: ignore[attr-defined]
    fake.cluster_resources = lambda: {"CPU": 8.0, "GPU": gpus_in_cluster}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", fake)


# --- the pure mapping ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu_ids", "visible", "index"),
    [
        pytest.param([0], "0", 0, id="ray-narrowed"),
        pytest.param([3], "3", 0, id="ray-narrowed-not-first-gpu"),
        pytest.param(["3"], "3", 0, id="string-id"),
        pytest.param([3], None, 3, id="nothing-hidden"),
        pytest.param([2], "0,1,2,3", 2, id="noset-whole-node"),
        pytest.param([5], "4,5", 1, id="node-started-on-a-subset"),
        pytest.param([5, 4], " 4 , 5 ", 1, id="first-of-two-spaces"),
        pytest.param(["GPU-bbb"], "GPU-aaa,GPU-bbb", 1, id="uuids"),
    ],
)
def test_device_index_from_ray_ids_and_visible_devices(
    gpu_ids: list[Union[int, str]], visible: Optional[str], index: int
) -> None:
    assert cuda_device_index(gpu_ids, visible) == index


@pytest.mark.parametrize(
    ("gpu_ids", "visible", "says"),
    [
        pytest.param([], "0", "cluster.gpus_per_worker", id="no-gpu-assigned"),
        pytest.param([1], "0", "not among", id="assigned-but-hidden"),
        pytest.param([1], "", "not among", id="everything-hidden"),
        pytest.param(["GPU-aaa"], None, "not an index", id="uuid-without-visible-list"),
    ],
)
def test_device_index_refuses_what_it_cannot_map(
    gpu_ids: list[Union[int, str]], visible: Optional[str], says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        cuda_device_index(gpu_ids, visible)


# --- the config rule: a whole GPU per worker on CUDA ---------------------------------------------


@pytest.mark.parametrize("gpus", ["0.5", "1.5"])
def test_fractional_gpus_refused_on_cuda(gpus: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config.load(None, ["cluster.device=cuda", f"cluster.gpus_per_worker={gpus}"])
    assert caught.value.key == "cluster.gpus_per_worker"


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_fractional_gpus_accepted_where_the_device_is_not_cuda_yet(device: str) -> None:
    job = config.load(None, [f"cluster.device={device}", "cluster.gpus_per_worker=0.5"])
    assert job.cluster.gpus_per_worker == 0.5


def test_whole_gpus_accepted_on_cuda() -> None:
    assert config.load(None, ["cluster.device=cuda", "cluster.gpus_per_worker=2"]).cluster.gpus_per_worker == 2


def test_auto_resolving_to_cuda_checks_gpus_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    job = config.load(None, ["cluster.gpus_per_worker=0.5"])
    _fake_ray(monkeypatch, gpu_ids=[], gpus_in_cluster=8)
    with pytest.raises(ConfigError) as caught:
        resolve_device(job)
    assert caught.value.key == "cluster.gpus_per_worker"
    _fake_ray(monkeypatch, gpu_ids=[], gpus_in_cluster=0)
    assert resolve_device(job) == "cpu"


def test_cli_exits_2_naming_the_key(tmp_path: Path) -> None:
    env = {**os.environ, "HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO / "platform")}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-m", "ringtrain", "run", str(REPO / "jobs" / "quickstart.yaml"),
         "cluster.device=cuda", "cluster.gpus_per_worker=0.5"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "cluster.gpus_per_worker" in done.stderr


# --- the worker binds the device Ray assigned ------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu_ids", "visible", "index"),
    [
        pytest.param([2], None, 2, id="nothing-hidden"),
        pytest.param([2], "2", 0, id="ray-narrowed"),
        pytest.param([2], "0,1,2,3", 2, id="noset-whole-node"),
    ],
)
def test_worker_binds_the_gpu_ray_assigned(
    monkeypatch: pytest.MonkeyPatch, gpu_ids: list[int], visible: Optional[str], index: int
) -> None:
    _fake_ray(monkeypatch, gpu_ids=gpu_ids)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    made_current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    worker = TrainWorker(config.load(None, []), -1, "cuda")
    device = worker._bind_device(worker.job)
    assert device == torch.device("cuda", index)
    assert made_current == [device]


def test_join_passes_the_device_to_the_process_group(monkeypatch: pytest.MonkeyPatch, rank_env: None) -> None:
    from ringtrain.train import mesh

    _fake_ray(monkeypatch, gpu_ids=[1])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(worker_module, "_quiet_deepspeed", lambda level=None: None)
    seen: dict[str, Any] = {}

    def init_process_group(**kwargs: Any) -> None:
        seen.update(kwargs, local_rank=os.environ["LOCAL_RANK"], accelerator=os.environ["DS_ACCELERATOR"])
        raise _Stop

    monkeypatch.setattr(mesh, "init_process_group", init_process_group)
    job = config.load(None, ["mesh.dp=2"])
    with pytest.raises(_Stop):
        TrainWorker(job, -1, "cuda").join(job, 1, "127.0.0.1", 1)
    assert seen["backend"] == "nccl"
    assert seen["device_id"] == torch.device("cuda", 1)
    assert seen["local_rank"] == "1" and seen["accelerator"] == "cuda"


def test_warm_up_binds_its_process_group_to_the_device(monkeypatch: pytest.MonkeyPatch, rank_env: None) -> None:
    seen: dict[str, Any] = {}

    def init_process_group(backend: str, **kwargs: Any) -> None:
        seen.update(kwargs, backend=backend)
        raise _Stop

    monkeypatch.setattr(trainer_module.dist, "init_process_group", init_process_group)
    with pytest.raises(_Stop):
        warm_up(config.load(None, []), torch.device("cuda", 3))
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 3)
    with pytest.raises(_Stop):
        warm_up(config.load(None, []), torch.device("cpu"))
    assert seen["backend"] == "gloo" and seen["device_id"] is None


# --- what DeepSpeed reads -------------------------------------------------------------------------


def test_rank_env_names_the_bound_cuda_device(monkeypatch: pytest.MonkeyPatch, rank_env: None) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # inherited from somewhere: must not win on a GPU
    set_rank_env(rank=5, world_size=8, device=torch.device("cuda", 3))
    assert os.environ["DS_ACCELERATOR"] == "cuda"
    assert os.environ["LOCAL_RANK"] == "3"
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("5", "8")


def test_rank_env_on_cpu(monkeypatch: pytest.MonkeyPatch, rank_env: None) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    set_rank_env(rank=1, world_size=2, device=torch.device("cpu"))
    assert (os.environ["DS_ACCELERATOR"], os.environ["LOCAL_RANK"]) == ("cpu", "0")


def test_rank_env_refuses_an_unindexed_cuda_device(rank_env: None) -> None:
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        set_rank_env(rank=0, world_size=1, device=torch.device("cuda"))
