"""The emulated ring (ringtrain_dev/emulated_cp.py), checked on the CPU where it can be.

The GPU tier runs the real ring code for every rank of a ring in one process, with its P2P
exchange replaced by mailboxes, to test CUDA kernels inside the ring on a single GPU. That
stand-in must itself be right, or the GPU tier would test nothing: here, in threads on the
CPU, it must give what one call over the whole sequence gives (to fp32 precision: the ring
merges its partial results in fp32 even for float64 inputs), and a kernel whose LSE is false
must show.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

from ringtrain.train.attention.kernels import MATH, BlockOutput, MathKernel, default_scale, get_kernel
from ringtrain_dev.emulated_cp import emulated_ring

BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16
TIMEOUT_S = 20.0  # a message that never comes fails the test in seconds (the ring itself takes ms)


def _inputs(seq: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seq)
    shapes = [(BATCH, seq, HEADS, HEAD_DIM), (BATCH, seq, KV_HEADS, HEAD_DIM), (BATCH, seq, KV_HEADS, HEAD_DIM),
              (BATCH, seq, HEADS, HEAD_DIM)]
    return tuple(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes)


def _whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, causal: bool) -> list[torch.Tensor]:
    scale = default_scale(HEAD_DIM)
    fwd = MATH.forward(q, k, v, causal=causal, scale=scale)
    return [fwd.out_BQHD, *MATH.backward(dout, q, k, v, fwd.out_BQHD, fwd.lse_BHQ, None, causal=causal, scale=scale)]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(
    ("kernel", "dtype", "tolerance"), [("math", torch.float64, 1e-6), ("cpu_flash", torch.float32, 1e-5)]
)
def test_emulated_ring_equals_one_call_over_the_sequence(
    world: int, causal: bool, kernel: str, dtype: torch.dtype, tolerance: float
) -> None:
    q, k, v, dout = _inputs(8 * world, dtype)
    ring = emulated_ring(q, k, v, dout, world=world, kernel=get_kernel(kernel, device_type="cpu", dtype=dtype),
                         causal=causal, scale=default_scale(HEAD_DIM), timeout_s=TIMEOUT_S)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (ring.out_BSHD, ring.dq_BSHD, ring.dk_BSKD, ring.dv_BSKD),
                               _whole(*(t.double() for t in (q, k, v, dout)), causal)):
        assert got.dtype == dtype and got.shape == want.shape, name
        torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=0, msg=name)


class _FalseLse(MathKernel):
    """The math kernel reporting an LSE too high by 0.1 per key of the block: right outputs,
    wrong merge weights. (A shift equal for every block of a row would cancel in the merge.)"""

    def forward_in_layout(self, q_BQHD: torch.Tensor, k_BSKD: torch.Tensor, v_BSKD: torch.Tensor, *, causal: bool,
                          scale: float, visible: Optional[torch.Tensor] = None) -> BlockOutput:
        out = super().forward_in_layout(q_BQHD, k_BSKD, v_BSKD, causal=causal, scale=scale, visible=visible)
        return BlockOutput(out.out_BQHD, out.lse_BHQ + 0.1 * k_BSKD.shape[1], out.aux)


def test_a_false_lse_shows_through_the_emulated_ring() -> None:
    q, k, v, dout = _inputs(32, torch.float64)
    ring = emulated_ring(q, k, v, dout, world=2, kernel=_FalseLse(), causal=True, scale=default_scale(HEAD_DIM),
                         timeout_s=TIMEOUT_S)
    want = _whole(q, k, v, dout, True)
    assert (ring.out_BSHD - want[0]).abs().max() > 1e-2


def test_a_failing_rank_fails_the_ring_without_hanging_the_others() -> None:
    class _Broken(MathKernel):
        calls = 0

        def forward_in_layout(self, *args: Any, **kwargs: Any) -> BlockOutput:
            _Broken.calls += 1
            if _Broken.calls == 3:  # one rank's second block: its peer is waiting for a message
                raise RuntimeError("kernel failed")
            return super().forward_in_layout(*args, **kwargs)

    q, k, v, dout = _inputs(16, torch.float64)
    with pytest.raises(RuntimeError):
        emulated_ring(
            q, k, v, dout, world=2, kernel=_Broken(), causal=True, scale=default_scale(HEAD_DIM), timeout_s=TIMEOUT_S
        )
