"""The output projection and cross-entropy over chunks of tokens, never the whole [tokens x vocab] logits.

At long context the full-vocabulary logits are the largest single activation: t tokens x V
vocabulary entries, whose fp32 log-softmax and its two gradients take 12 t V bytes at the start
of the backward (see planner/memory.py). ``chunked_cross_entropy_sum``
computes the same summed loss a chunk of ``chunk_tokens`` tokens at a time: the forward keeps
only the hidden states it was given, the weight, the labels and one fp32 log-sum-exp per token,
and the backward recomputes each chunk's logits to form that chunk's gradient. Peak memory of
the loss is then chunk_tokens x V, whatever t is.

The gradient of a token's loss ``lse(z) - z_y`` with respect to its logits ``z`` is
``softmax(z) - onehot(y)`` (e.g. Goodfellow et al. 2016, "Deep Learning", section 6.2.2.3);
a token whose label is IGNORE_INDEX contributes neither loss nor gradient, as in
``F.cross_entropy(..., ignore_index=IGNORE_INDEX, reduction="sum")``.

Given per-token ``weights`` (``train.loss_norm: sequence``: 1 / N_i for a token of conversation
i), the result is the weighted sum, each token's loss and gradient scaled by its weight; without
them the unweighted path runs exactly as before. ``chunked_cross_entropy_tokens`` keeps each
token's loss apart ([T]), its backward scaling each token's gradient by the incoming one.

The result is the sum over labelled tokens, in fp32: the caller divides it exactly as it divides
the unchunked sum (trainer.py normalises by the labels of the micro batch across CP ranks).

Where ``train.fused_ops`` runs liger-kernel's fused linear cross-entropy (CUDA, train/fused.py),
the model takes that instead; this torch path is the reference on CPU and the fallback.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from ringtrain.train.data import IGNORE_INDEX


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over labelled t of CE(hidden[t] @ weight.T, labels[t]), computed chunk by chunk; with
    ``per_token``, each token's CE instead ([T], 0 where unlabelled)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden_TE: torch.Tensor, weight_VE: torch.Tensor, labels_T: torch.Tensor, chunk_tokens: int,
        weights_T: Optional[torch.Tensor] = None, per_token: bool = False,
    ) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden_TE.device)
        lse_T = torch.empty(hidden_TE.shape[0], dtype=torch.float32, device=hidden_TE.device)
        loss_T = torch.zeros(hidden_TE.shape[0] if per_token else 0, dtype=torch.float32, device=hidden_TE.device)
        for start in range(0, hidden_TE.shape[0], chunk_tokens):
            stop = start + chunk_tokens
            # The logits in the activation dtype, then fp32, exactly as the unchunked path casts.
            logits_CV = F.linear(hidden_TE[start:stop], weight_VE).float()
            labels_C = labels_T[start:stop]
            lse_C = torch.logsumexp(logits_CV, dim=-1)
            lse_T[start:stop] = lse_C
            valid_C = labels_C != IGNORE_INDEX
            target_C = logits_CV.gather(1, labels_C.clamp(min=0).unsqueeze(1)).squeeze(1)
            loss_C = lse_C - target_C
            if weights_T is not None:
                loss_C = loss_C * weights_T[start:stop]
            if per_token:
                loss_T[start:stop] = torch.where(valid_C, loss_C, 0.0)
            else:
                total += torch.where(valid_C, loss_C, 0.0).sum()
        ctx.save_for_backward(hidden_TE, weight_VE, labels_T, lse_T, weights_T)
        ctx.chunk_tokens = chunk_tokens
        ctx.per_token = per_token
        return loss_T if per_token else total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        hidden_TE, weight_VE, labels_T, lse_T, weights_T = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden_TE) if need_hidden else None
        # Accumulated in fp32 over chunks: the sum over tokens the unchunked matmul makes at once.
        grad_weight = torch.zeros(weight_VE.shape, dtype=torch.float32, device=weight_VE.device) if need_weight else None
        for start in range(0, hidden_TE.shape[0], ctx.chunk_tokens):
            stop = start + ctx.chunk_tokens
            h_CE = hidden_TE[start:stop]
            labels_C = labels_T[start:stop]
            logits_CV = F.linear(h_CE, weight_VE).float()
            valid_C = labels_C != IGNORE_INDEX
            # softmax(z) - onehot(y), zero on ignored tokens, times the incoming gradient.
            grad_CV = torch.exp(logits_CV - lse_T[start:stop].unsqueeze(1))
            rows = torch.arange(grad_CV.shape[0], device=grad_CV.device)
            grad_CV[rows, labels_C.clamp(min=0)] -= 1.0
            scale_C = valid_C.to(grad_CV.dtype) * (grad_out[start:stop] if ctx.per_token else grad_out)
            if weights_T is not None:
                scale_C = scale_C * weights_T[start:stop]
            grad_CV *= scale_C.unsqueeze(1)
            grad_CV = grad_CV.to(hidden_TE.dtype)
            if grad_hidden is not None:
                grad_hidden[start:stop] = grad_CV @ weight_VE
            if grad_weight is not None:
                grad_weight += (grad_CV.t() @ h_CE).float()
        return grad_hidden, grad_weight.to(weight_VE.dtype) if grad_weight is not None else None, None, None, None, None


def chunked_cross_entropy_sum(
    hidden_TE: torch.Tensor, weight_VE: torch.Tensor, labels_T: torch.Tensor, chunk_tokens: int,
    weights_T: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The fp32 sum of the cross-entropy of ``hidden_TE @ weight_VE.T`` against ``labels_T`` over
    labelled tokens, materialising at most ``chunk_tokens`` rows of logits at a time."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 (got {chunk_tokens})")
    weights = None if weights_T is None else weights_T.float()
    return _ChunkedLinearCrossEntropy.apply(hidden_TE, weight_VE, labels_T, chunk_tokens, weights)


def chunked_cross_entropy_tokens(
    hidden_TE: torch.Tensor, weight_VE: torch.Tensor, labels_T: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """Each token's fp32 cross-entropy [T] (0 where unlabelled), chunk by chunk as
    ``chunked_cross_entropy_sum``: what an objective of per-sequence sums (train/preference.py)
    differentiates through, without the whole logits."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 (got {chunk_tokens})")
    return _ChunkedLinearCrossEntropy.apply(hidden_TE, weight_VE, labels_T, chunk_tokens, None, True)


def logits_cross_entropy_sum(
    logits_TV: torch.Tensor, labels_T: torch.Tensor, weights_T: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The fp32 sum of the token losses of whole logits over labelled tokens, weighted if given."""
    if weights_T is None:
        return F.cross_entropy(logits_TV.float(), labels_T, ignore_index=IGNORE_INDEX, reduction="sum")
    losses_T = F.cross_entropy(logits_TV.float(), labels_T, ignore_index=IGNORE_INDEX, reduction="none")
    return (losses_T * weights_T.float()).sum()


def full_cross_entropy_sum(
    hidden_TE: torch.Tensor, weight_VE: torch.Tensor, labels_T: torch.Tensor, weights_T: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The unchunked reference: the whole logits, then ``F.cross_entropy`` (what trainer.py does)."""
    return logits_cross_entropy_sum(F.linear(hidden_TE, weight_VE), labels_T, weights_T)
