"""Preference pairs to token ids and loss masks: the prompt once, each completion after it.

A pair is stored as three documents, in order: the prompt (the template's text of its messages
with the generation prompt: what the model answers; no target), the chosen completion and the
rejected one (the tokens the template renders after that prompt when the completion follows it,
masked by ``--format chat``'s rules: the completion's assistant turns, their end-of-turn tokens
by ``--train-on-eos``). Each completion's rendering must begin with the prompt's tokens, so a
pair's prompt is one sequence both completions continue; the training side lays them out from
it (``train/pairs.py``).
"""

from __future__ import annotations

from typing import Union

import numpy as np

from ringtrain.prepare.chat_records import BadConversation, ChatRecord, Conversation
from ringtrain.prepare.chat_render import ChatEncoder, ChatRenderer, Rendered
from ringtrain.prepare.preference_records import CHOSEN, PAIR_FIELDS, REJECTED, PreferenceRecord, read_preference
from ringtrain.prepare.sources import BadRecord

Pair = tuple[Rendered, Rendered, Rendered]  # the prompt, the chosen completion, the rejected one


def render_pair(renderer: ChatRenderer, pair: PreferenceRecord) -> Pair:
    """``pair`` as three documents; BadConversation where the template renders the prompt
    differently before a completion than alone."""
    prompt = renderer.prompt_ids(ChatRecord(pair.prompt, context=pair.context))
    out = [Rendered(np.asarray(prompt, dtype=np.int64), np.zeros(len(prompt), dtype=np.uint8))]
    for name, completion in ((CHOSEN, pair.chosen), (REJECTED, pair.rejected)):
        flags = (False,) * len(pair.prompt) + (None,) * len(completion)  # the prompt's turns never train
        ids, mask = renderer.render(ChatRecord(pair.prompt + completion, flags, pair.context))
        if ids[: len(prompt)].tolist() != prompt:
            raise BadConversation(f"the chat template renders the prompt differently before the {name} completion "
                                  "than alone, so the two cannot share it")  # fmt: skip
        if len(ids) == len(prompt):
            raise BadConversation(f"the {name} completion renders as no tokens")
        out.append(Rendered(ids[len(prompt) :], mask[len(prompt) :]))
    return out[0], out[1], out[2]


class PreferenceEncoder(ChatEncoder):
    """A tokenizer actor's preference half: a record to its pair's three documents (or a bad
    record), and a chunk of them to flat (tokens, lengths, mask) as chat conversations are."""

    def convert(self, record: Conversation, line: int) -> Union[Pair, BadRecord]:  # type: ignore[override]
        """A record's pair rendered within the budget (its prompt's and completions' messages
        counted together), or the bad record at ``line`` it makes."""
        count = sum(len(v) for v in (record.fields.get(name) for name in PAIR_FIELDS) if isinstance(v, list))
        docs = self.within_budget(count, line, lambda: render_pair(self.renderer, read_preference(record, self.renderer.context_fields)))
        return docs if isinstance(docs, BadRecord) else (docs[0], docs[1], docs[2])
