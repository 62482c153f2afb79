"""The accelerator table: memory, peak bf16 FLOP/s and link bandwidths per GPU type.

Bandwidths are per GPU and per direction, in bytes/s, as the hardware is specified; the
throughput model applies its own achievable fraction (``Assumptions.link_efficiency``).
Memory is the datasheet's capacity in decimal GB (1e9 bytes), a little below what CUDA reports
(81,559 MiB = 85.5e9 bytes on an H100 SXM "80GB"); the planner's headroom comes on top.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringtrain.errors import ConfigError

GB = 10**9
TB = 10**12


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int  # HBM per GPU
    peak_flops: float  # dense bf16 tensor-core FLOP/s, no sparsity
    nvlink_bw: float  # intra-node, per direction
    network_bw: float  # inter-node, per GPU, per direction
    pcie_bw: float  # host <-> device, per direction (optimizer offload)
    host_memory_bytes: int  # CPU memory per node of the reference system
    host_memory_bw: float  # CPU memory bandwidth per node (an offloaded Adam step is bound by it)


# H100 SXM5: 989 TFLOP/s dense BF16, 80 GB HBM3, 4th-gen NVLink 900 GB/s total (450 GB/s each
# way), PCIe Gen5 x16 (64 GB/s each way) -- NVIDIA H100 Tensor Core GPU datasheet. One
# ConnectX-7 InfiniBand NDR port per GPU, 400 Gb/s = 50 GB/s, 2 TB system memory and two Xeon
# Platinum 8480C per node -- NVIDIA DGX H100 datasheet; 8 channels of DDR5-4800 per socket
# (Intel ark) make 2 x 8 x 38.4 = 614 GB/s.
H100 = Device("h100", 80 * GB, 989e12, 450 * GB, 50 * GB, 64 * GB, 2 * TB, 614 * GB)

# H200 SXM: the H100's compute and NVLink with 141 GB HBM3e -- NVIDIA H200 Tensor Core GPU
# datasheet; DGX H200 keeps the DGX H100's NDR networking and 2 TB system memory.
H200 = Device("h200", 141 * GB, 989e12, 450 * GB, 50 * GB, 64 * GB, 2 * TB, 614 * GB)

# A100 SXM4 80GB: 312 TFLOP/s dense BF16, 3rd-gen NVLink 600 GB/s total (300 GB/s each way),
# PCIe Gen4 x16 (32 GB/s each way) -- NVIDIA A100 Tensor Core GPU datasheet. DGX A100 pairs each
# GPU with one ConnectX-6 InfiniBand HDR port, 200 Gb/s = 25 GB/s, and ships 2 TB system
# memory and two EPYC 7742 -- NVIDIA DGX A100 datasheet; 8 channels of DDR4-3200 per socket
# (AMD) make 2 x 8 x 25.6 = 410 GB/s.
A100 = Device("a100", 80 * GB, 312e12, 300 * GB, 25 * GB, 32 * GB, 2 * TB, 410 * GB)

DEVICES: dict[str, Device] = {d.name: d for d in (H100, H200, A100)}

# `cluster.device` says only "cuda"; an 80 GB part is the common denominator of the table.
DEVICE_ALIASES: dict[str, str] = {"cuda": "h100", "gpu": "h100"}


# A CPU core's nominal fp32 peak: two 8-wide FMA units x 2 FLOPs x ~3 GHz (AVX2), used only
# to put an MFU on CPU test runs; GPUs are looked up in the table.
CPU_CORE_PEAK_FLOPS = 2 * 8 * 2 * 3e9


def peak_flops(device_name: str, *, cpu_cores: float = 1.0) -> float:
    """Peak FLOP/s of one worker's device, from its reported name (e.g. "NVIDIA H100 80GB HBM3")."""
    lowered = device_name.lower()
    for name, spec in DEVICES.items():
        if name in lowered:
            return spec.peak_flops
    if lowered.startswith("cpu"):
        return CPU_CORE_PEAK_FLOPS * max(1.0, cpu_cores)
    return H100.peak_flops  # an unknown GPU: the table's common reference


def device(name: str, *, key: str = "--gpu-type") -> Device:
    """The device called ``name`` (case-insensitive; "cuda" means an 80 GB H100)."""
    lowered = name.lower()
    lowered = DEVICE_ALIASES.get(lowered, lowered)
    if lowered not in DEVICES:
        raise ConfigError(key, f"{name!r} is not one of {', '.join(DEVICES)}")
    return DEVICES[lowered]
