"""ringtrain as an lm-evaluation-harness model: ``loglikelihood``, ``loglikelihood_rolling`` and
``generate_until`` answered by the training workers on their mesh.

The requests are tokenized here, on the driver, exactly as lm-eval's own Hugging Face model
(``HFLM``) tokenizes them: its ``tok_encode`` with lm-eval's helpers (the model folder's
tokenizer, no BOS rule of its own), context and continuation split by lm-eval's ``TemplateLM``,
rolling windows lm-eval's. Then every request of a call goes to the workers at once
(``WorkerGroup.score`` / ``generate``): scores come from one forward of the layout's attention,
continuations from the KV cache sharded over each CP group (``train.decode``), stopping at the
eos token and at the task's ``until`` strings, whose text is cut as ``HFLM`` cuts it.

``max_length`` is the job's ``data.seq_len``: a longer context is cut from the left, as ``HFLM``
cuts one longer than its own ``max_length``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Protocol

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    _add_special_kwargs,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from ringtrain.evaluation.generation import GenerationRequest, Sampling, ScoreRequest
from ringtrain.evaluation.stops import StopRule

# HFLM's default for a request that names no max_gen_toks.
MAX_GEN_TOKS = 256


class MeshModel(Protocol):
    """What the adapter asks of the workers (``actors.group.WorkerGroup``)."""

    def score(self, request: ScoreRequest) -> list[tuple[float, bool]]: ...
    def generate(self, request: GenerationRequest) -> list[list[int]]: ...


class RingtrainLM(TemplateLM):  # type: ignore[misc]
    def __init__(self, mesh: MeshModel, tokenizer: Any, max_length: int) -> None:
        super().__init__()
        self.mesh = mesh
        self.tokenizer = tokenizer
        self._max_length = max_length
        # HFLM's own attributes its tok_encode reads.
        self.add_bos_token: Optional[bool] = None
        self.custom_prefix_token_id: Optional[int] = None

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos if bos is not None else self.tokenizer.eos_token_id)

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None,
                   left_truncate_len: Optional[int] = None, **kwargs: Any) -> list[int]:
        """HFLM's ``tok_encode`` (lm_eval/models/huggingface.py), with its helpers: the
        tokenizer's own special tokens unless the text already starts with the prefix token."""
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        encoded = list(self.tokenizer.encode(string, **special))
        return encoded[-left_truncate_len:] if left_truncate_len else encoded

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens))

    def _loglikelihood_tokens(self, requests: list[Any], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """Each ``(key, context_ids, continuation_ids)`` scored: the continuation's summed
        log-probability and whether it is the greedy one, with the context cut from the left to
        ``max_length`` tokens of input (as HFLM cuts it)."""
        pairs = []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            scored = min(len(continuation), len(whole) - 1)
            pairs.append((whole[: len(whole) - scored], whole[len(whole) - scored:]))
        answers = self.mesh.score(ScoreRequest.of(pairs))
        for (key, _, _), answer in zip(requests, answers):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each string's log-probability over lm-eval's disjoint rolling windows."""
        windows: list[tuple[int, list[int], list[int]]] = []
        for index, (string,) in enumerate(req.args for req in requests):
            for context, predicted in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((index, context, predicted))
        scores = self._loglikelihood_tokens([(None, c, p) for _, c, p in windows])
        totals = [0.0] * len(requests)
        for (index, _, _), (logprob, _) in zip(windows, scores):
            totals[index] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each context continued until a stop string, the eos token or ``max_gen_toks``; the
        requests that share generation arguments go to the workers together."""
        results: list[Optional[str]] = [None] * len(requests)
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(requests[members[0]].args[1], MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            sampling = Sampling(float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
                                float(kwargs.get("top_p", 1.0)))
            contexts = [self.tok_encode(requests[i].args[0], left_truncate_len=self.max_length - max_gen)
                        for i in members]
            stop = StopRule(frozenset({self.eot_token_id}), tuple(s for s in until if s))
            generated = self.mesh.generate(GenerationRequest.of(contexts, max_gen, sampling, stop))
            for i, ids in zip(members, generated):
                text = postprocess_generated_text(self.tok_decode(ids), until, None)
                results[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return [r if r is not None else "" for r in results]
