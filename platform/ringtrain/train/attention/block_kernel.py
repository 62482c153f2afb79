"""The block-kernel interface: what one attention block returns, and the rules every kernel keeps.

Context-parallel attention computes attention one block of keys at a time and merges the
partial results, which needs each block's log-sum-exp (LSE) as well as its output; each
block's backward then runs against the *merged* output and LSE. So a kernel here is a forward
that returns ``(out, lse)`` and a backward that takes them back, not a plain attention call,
and a kernel that cannot return a real LSE is refused by name.

Shape legend: B batch, Q query length of the block, S key length of the block, H query heads,
K key/value heads (H % K == 0; query head h reads KV head h // (H // K)), G = H // K, D head
dim. Tensors are ``[B, Q, H, D]`` and ``[B, S, K, D]`` (sequence-major, "BSHD"); LSEs are
``[B, H, Q]`` fp32. A head-major op takes ``[B, H, Q, D]`` ("BHSD").

Conventions every kernel keeps (``AttentionKernel`` enforces them, so a kernel cannot forget):

- ``causal`` on square blocks (Q == S): there query i sees keys 0..i under top-left (torch's
  ``is_causal``) and bottom-right (flash-attn's) alignment alike, and no row is left empty. A
  kernel whose causal mask aligns bottom-right (``aligns_causal_bottom_right``) also takes a
  block wider than tall (Q < S): query i sees keys 0..i + S - Q, the queries at the end of the
  keys, as a chunk's rows against its whole prefix and itself are; every row sees a key. Any
  other non-square causal block is refused: the two alignments disagree there, and flash-attn
  gives a row that sees no key an LSE of +inf, which the merge would weigh as everything.
- ``visible_BQS`` (boolean, True = may attend) restricts attention further; only kernels with
  ``supports_mask`` accept it.
- A query row with no visible key has output 0 and LSE -inf, and receives zero gradient.
- Head dims: a kernel whose op needs D to be a multiple of ``pad_head_dim_to`` gets q, k, v
  zero-padded up to one and its results sliced back (as flash-attn's ``FlashAttnFunc`` does);
  one with a largest D (``KernelSpec.max_head_dim``) is never chosen for a larger one.
- GQA: a kernel whose op takes fewer K/V heads than query heads (``native_gqa``) gets K/V as
  they are; any other gets them repeated per query head, and its K/V gradients summed back.
- Layout: a kernel whose op is head-major (``head_major``) gets its inputs transposed to BHSD
  and its results back here, once, rather than in each kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Optional, Union

import torch

from ringtrain.errors import RingtrainError

Tensor = torch.Tensor
Grads = tuple[Tensor, Tensor, Tensor]
# aten op name -> (its argument names in order, its number of results) a kernel's call is written for.
AtenOps = Mapping[str, tuple[tuple[str, ...], int]]
SchemaLookup = Callable[[str], Optional[Any]]

HALF = frozenset({torch.float16, torch.bfloat16})


class KernelUnavailableError(RingtrainError, ValueError):
    """An attention kernel was named that cannot run here, or cannot return a log-sum-exp."""

    def __init__(self, kernel: str, reason: str) -> None:
        super().__init__(f"attention kernel {kernel!r}: {reason}")
        self.kernel = kernel
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.kernel, self.reason))


class BlockOutput(NamedTuple):
    out_BQHD: Tensor  # in the query's dtype
    lse_BHQ: Tensor  # fp32 (fp64 for fp64 inputs); -inf where a row sees no key
    aux: Any  # kernel-private state its backward needs (RNG state, varlen metadata)


class BlockMask:
    """A block's visibility ``[B, Q, S]`` (True: may attend), with what kernels derive from it
    (an additive bias, the rows that see nothing) made once and kept: a plan's masks serve every
    layer of a forward (``plan``), so each is derived once, not once per call."""

    def __init__(self, visible_BQS: Tensor, *, any_unseen: bool = True) -> None:
        """``any_unseen``: whether some row sees no key (known on the host where the mask was
        made there; True, the safe side, otherwise)."""
        self.visible_BQS = visible_BQS
        self.any_unseen = any_unseen
        self._made: dict[Any, Any] = {}

    @classmethod
    def of(cls, visible: Union[Tensor, BlockMask, None]) -> Optional[BlockMask]:
        return visible if visible is None or isinstance(visible, BlockMask) else cls(visible)

    def derived(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, the first time ``key`` is asked for."""
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    @property
    def unseen_BQ(self) -> Tensor:
        """Rows with no visible key."""
        return self.derived("unseen", lambda: self.visible_BQS.any(dim=-1).logical_not())


class BlockCall(NamedTuple):
    """What one block call is, besides its tensors: the same for its forward and its backward."""

    causal: bool
    scale: float
    visible_BQS: Union[Tensor, BlockMask, None]


class BackwardInputs(NamedTuple):
    """The tensors a block's backward reads, in the op's layout (``lse`` is ``[B, H, Q]`` in both)."""

    dout: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor


def to_head_major(*xs_BSHD: Tensor) -> tuple[Tensor, ...]:
    """``[B, S, H, D]`` -> ``[B, H, S, D]`` views (the layout torch's fused attention ops take)."""
    return tuple(x.transpose(1, 2) for x in xs_BSHD)


def to_seq_major(*xs_BHSD: Tensor) -> tuple[Tensor, ...]:
    """``[B, H, S, D]`` -> ``[B, S, H, D]`` views: the inverse of ``to_head_major``."""
    return tuple(x.transpose(1, 2) for x in xs_BHSD)


@dataclass(frozen=True)
class KernelSpec:
    """Which inputs a kernel takes; ``select_kernel`` reads it without running anything."""

    devices: Optional[frozenset[str]]  # None: any device
    dtypes: frozenset[torch.dtype]
    max_head_dim: Optional[int] = None  # None: any; forward and backward alike

    def takes_head_dim(self, head_dim: Optional[int]) -> bool:
        return head_dim is None or self.max_head_dim is None or head_dim <= self.max_head_dim


def aten_schema(op: str) -> Optional[Any]:
    """The installed torch's schema (``torch.FunctionSchema``) of ``aten::op``, None if absent."""
    packet = getattr(torch.ops.aten, op, None)
    return None if packet is None else packet.default._schema


def ops_fit(ops: AtenOps, schema_of: SchemaLookup = aten_schema) -> bool:
    """Whether every op in ``ops`` exists with the signature its call is written for.

    The private ops change between releases (cuDNN's gained ``attn_bias`` and
    ``compute_log_sumexp`` in torch 2.5); a call written for another signature would put its
    values in the wrong places, so a kernel whose ops differ is not offered.
    """
    for op, (arguments, num_returns) in ops.items():
        schema = schema_of(op)
        if schema is None:
            return False
        if tuple(a.name for a in schema.arguments) != arguments or len(schema.returns) != num_returns:
            return False
    return True


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What LSEs and sums of partial results of ``dtype`` inputs are kept in: fp32, fp64 for fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _pad_head_dim(x: Tensor, multiple: int) -> Tensor:
    # Zero columns add nothing to q.k, and zero value columns only add output columns that are
    # sliced off; the scale is passed explicitly, so it stays that of the true head dim.
    extra = -x.shape[-1] % multiple
    return torch.nn.functional.pad(x, (0, extra)) if extra else x


def _check_causal_shape(causal: bool, q_len: int, k_len: int, *, bottom_right: bool) -> None:
    if not causal or q_len == k_len or (bottom_right and q_len < k_len):
        return
    takes = "a square block or one wider than tall" if bottom_right else "a square block"
    raise ValueError(
        f"causal attention needs {takes}, got {q_len} queries and {k_len} keys: kernels "
        "align a non-square causal mask differently (flash-attn bottom-right, with LSE +inf for "
        "rows that see no key), so split the block or pass an explicit mask"
    )


def visible_of(call: BlockCall) -> Optional[Tensor]:
    """The call's visibility ``[B, Q, S]`` as a tensor, or None."""
    visible = call.visible_BQS
    return visible.visible_BQS if isinstance(visible, BlockMask) else visible


def allowed_mask(
    visible_BQS: Optional[Tensor], causal: bool, q_len: int, k_len: int, *, device: torch.device
) -> Optional[Tensor]:
    """The full boolean mask (``[Q, S]`` or ``[B, Q, S]``) on ``device``, or None when nothing is masked.

    ``device`` is the scores' device, passed rather than taken from the mask: with no mask the
    causal part would otherwise be made on the default (CPU) device.
    """
    if not causal:
        return visible_BQS
    # Aligned bottom-right: the queries are the last Q of the keys (top-left too on a square block).
    tril_QS = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)
    return tril_QS if visible_BQS is None else visible_BQS & tril_QS


def additive_bias(allowed_BQS: Tensor, dtype: torch.dtype, *, align: int = 1) -> Tensor:
    """``[B, 1, Q, S]`` float bias of ``dtype``: 0 where allowed, -inf elsewhere (broadcast over heads).

    ``align`` > 1 allocates the key dim padded to a multiple of it and returns the S-wide view,
    so every stride but the last is a multiple of ``align`` (what an op that reads the bias in
    aligned vectors needs).
    """
    B, Q, S = allowed_BQS.shape
    storage_BQP = torch.zeros((B, Q, S + (-S % align)), dtype=dtype, device=allowed_BQS.device)
    bias_BQS = storage_BQP[..., :S].masked_fill_(allowed_BQS.logical_not(), -math.inf)
    return bias_BQS[:, None]


class AttentionKernel:
    """Forward and backward of one attention block.

    This base class owns what must hold for every kernel: the shapes of causal blocks, head-dim
    padding, GQA expansion for kernels that lack it, the layout its op takes, the LSE of rows
    that see no key, and fp32 LSEs. A kernel implements ``_op_forward``/``_op_backward`` in
    its op's layout (BHSD if ``head_major``, else BSHD), with the head dim padded to a multiple
    of ``pad_head_dim_to`` and KV heads already expanded to H unless ``native_gqa``.

    What selection needs to know about a kernel is declared on its class: ``name`` (one of
    config's ``ATTENTION_BLOCK_KERNELS``), ``spec``, the aten ``ops`` it calls, ``unavailable``
    (why it may not run) and ``runs_here``.
    """

    name: ClassVar[str]
    spec: ClassVar[KernelSpec]
    supports_mask: ClassVar[bool] = False
    # Whether its causal mask aligns a block wider than tall bottom-right (see the module doc).
    aligns_causal_bottom_right: ClassVar[bool] = False
    pad_head_dim_to: ClassVar[int] = 1
    head_major: ClassVar[bool] = False
    ops: ClassVar[AtenOps] = {}
    unavailable: ClassVar[str] = ""  # why ``runs_here`` may say no, for the error a user sees

    def __init__(self, *, native_gqa: Optional[bool] = None) -> None:
        """``native_gqa`` overrides what ``takes_gqa`` says (tests compare both paths)."""
        self.native_gqa = self.takes_gqa() if native_gqa is None else native_gqa

    @classmethod
    def runs_here(cls, device_type: str) -> bool:
        """Whether this process can run the kernel on ``device_type`` (probes the runtime)."""
        return False

    def takes_gqa(self) -> bool:
        """Whether this kernel's op takes fewer K/V heads than query heads as they are."""
        return False

    @property
    def seq_dim(self) -> int:
        """The sequence dim of the op's layout (the heads dim is the other of 1 and 2)."""
        return 2 if self.head_major else 1

    def to_layout(self, *xs_BSHD: Tensor) -> tuple[Tensor, ...]:
        """BSHD views in the op's layout."""
        return to_head_major(*xs_BSHD) if self.head_major else xs_BSHD

    def from_layout(self, *xs: Tensor) -> tuple[Tensor, ...]:
        """The op's layout back to BSHD views."""
        return to_seq_major(*xs) if self.head_major else xs

    def forward(self, q_BQHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, *, causal: bool, scale: float,
                visible_BQS: Union[Tensor, BlockMask, None] = None) -> BlockOutput:
        """One block, BSHD in and out."""
        q, k, v = self.to_layout(q_BQHD, k_BSKD, v_BSKD)
        res = self.forward_in_layout(q, k, v, causal=causal, scale=scale, visible=visible_BQS)
        return BlockOutput(self.from_layout(res.out_BQHD)[0], res.lse_BHQ, res.aux)

    def backward(self, dout_BQHD: Tensor, q_BQHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, out_BQHD: Tensor,
                 lse_BHQ: Tensor, aux: Any, *, causal: bool, scale: float,
                 visible_BQS: Union[Tensor, BlockMask, None] = None) -> Grads:
        """Gradients of this block for the merged ``out``/``lse`` of its query rows, BSHD in and out."""
        dout, q, k, v, out = self.to_layout(dout_BQHD, q_BQHD, k_BSKD, v_BSKD, out_BQHD)
        dq, dk, dv = self.backward_in_layout(dout, q, k, v, out, lse_BHQ, aux, causal=causal, scale=scale,
                                             visible=visible_BQS)
        return self.from_layout(dq, dk, dv)  # type: ignore[return-value]

    def forward_in_layout(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float,
        visible: Union[Tensor, BlockMask, None] = None,
    ) -> BlockOutput:
        """One block with its tensors in the op's layout (``to_layout``), the output too: what a
        context-parallel loop calls, having put its tensors in the layout once."""
        mask = visible if visible is None or isinstance(visible, BlockMask) else BlockMask(visible)
        if mask is not None:
            self._check_mask(mask)
        seq = self.seq_dim
        heads = 3 - seq
        if causal:
            _check_causal_shape(causal, q.shape[seq], k.shape[seq], bottom_right=self.aligns_causal_bottom_right)
        head_dim = q.shape[-1]
        if head_dim % self.pad_head_dim_to:
            q, k, v = (_pad_head_dim(t, self.pad_head_dim_to) for t in (q, k, v))
        if not self.native_gqa and q.shape[heads] != k.shape[heads]:
            groups = q.shape[heads] // k.shape[heads]
            k, v = k.repeat_interleave(groups, dim=heads), v.repeat_interleave(groups, dim=heads)
        out, lse_BHQ, aux = self._op_forward(q, k, v, BlockCall(causal, scale, mask))
        if out.shape[-1] != head_dim:
            out = out[..., :head_dim]
        if lse_BHQ.dtype is not torch.float32 and lse_BHQ.dtype is not torch.float64:
            lse_BHQ = lse_BHQ.float()
        if mask is not None and mask.any_unseen:
            # A fused kernel may report LSE 0 rather than -inf for a row whose keys are all
            # masked (torch's CPU flash kernel does); the merge needs the truth, or that row's
            # zero output would get real weight.
            lse_BHQ = lse_BHQ.masked_fill(_unseen_as(mask, "lse", 1), -math.inf)
            # In place, on the op's own fresh output: an out-of-place masked_fill returns a
            # contiguous copy, which for a head-major op is not the layout its output had (and
            # torch's efficient backward reads its out in that layout alone).
            out.masked_fill_(_unseen_as(mask, "out", seq), 0.0)
        return BlockOutput(out, lse_BHQ, aux)

    def backward_in_layout(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse_BHQ: Tensor, aux: Any, *,
        causal: bool, scale: float, visible: Union[Tensor, BlockMask, None] = None,
    ) -> Grads:
        """``backward`` with its tensors in the op's layout, the gradients too."""
        mask = visible if visible is None or isinstance(visible, BlockMask) else BlockMask(visible)
        seq = self.seq_dim
        heads = 3 - seq
        if causal:
            _check_causal_shape(causal, q.shape[seq], k.shape[seq], bottom_right=self.aligns_causal_bottom_right)
        if mask is not None:
            self._check_mask(mask)
            # Every kernel recomputes P = exp(s - lse). For a row that saw no key that is
            # exp(-inf + inf) = NaN; with +inf instead of -inf it is exp(-inf) = 0, so the row
            # gets zero gradient through fused and explicit kernels alike. Only a mask leaves a
            # row of a block empty (a causal block, square or aligned bottom-right, shows every
            # row its own key), and such a row's gradient here is zero whatever its merged LSE:
            # unmasked, the LSE goes through as it is, and contiguous, as callers that keep it
            # contiguous pass it.
            if mask.any_unseen:
                lse_BHQ = lse_BHQ.masked_fill(_unseen_as(mask, "lse", 1), math.inf)
        lse_BHQ = lse_BHQ.contiguous()
        head_dim = q.shape[-1]
        if head_dim % self.pad_head_dim_to:
            dout, q, k, v, out = (_pad_head_dim(t, self.pad_head_dim_to) for t in (dout, q, k, v, out))
        kv_heads = k.shape[heads]
        groups = q.shape[heads] // kv_heads
        if groups > 1 and not self.native_gqa:
            k, v = k.repeat_interleave(groups, dim=heads), v.repeat_interleave(groups, dim=heads)
        dq, dk, dv = self._op_backward(BackwardInputs(dout, q, k, v, out, lse_BHQ), aux, BlockCall(causal, scale, mask))
        if dk.shape[heads] != kv_heads:
            # Each KV head fed ``groups`` query heads; its gradient is the sum over them. Also
            # taken when a native-GQA op hands back per-query-head gradients.
            per_group = (*dk.shape[:heads], kv_heads, groups, *dk.shape[heads + 1:])
            dk, dv = dk.reshape(per_group).sum(dim=heads + 1), dv.reshape(per_group).sum(dim=heads + 1)
        if dq.shape[-1] != head_dim:
            dq, dk, dv = dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim]
        return dq, dk, dv

    def _check_mask(self, mask: Optional[BlockMask]) -> None:
        if mask is not None and not self.supports_mask:
            raise ValueError(f"attention kernel {self.name!r} takes no mask; use a mask-capable kernel")

    # The two hooks below see tensors in the op's layout, padded and GQA-expanded as the class says.

    def _op_forward(self, q: Tensor, k: Tensor, v: Tensor, call: BlockCall) -> tuple[Tensor, Tensor, Any]:
        """``(out, lse [B, H, Q], aux)`` from the op, in its layout."""
        raise NotImplementedError

    def _op_backward(self, inputs: BackwardInputs, aux: Any, call: BlockCall) -> Grads:
        """``(dq, dk, dv)`` from the op, in its layout."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(native_gqa={self.native_gqa})"


def _unseen_as(mask: BlockMask, what: str, seq_dim: int) -> Tensor:
    """The mask's empty rows shaped to fill an LSE ``[B, H, Q]`` or an output with its sequence on
    ``seq_dim`` (kept with the mask: every layer fills the same rows)."""
    def make() -> Tensor:
        rows_BQ = mask.unseen_BQ
        if what == "lse":
            return rows_BQ[:, None, :]
        return rows_BQ[:, None, :, None] if seq_dim == 2 else rows_BQ[:, :, None, None]

    return mask.derived(("unseen as", what, seq_dim), make)  # type: ignore[no-any-return]
