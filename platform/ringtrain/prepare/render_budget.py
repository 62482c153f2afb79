"""The render budget of `ringtrain prepare --format chat`: what one chat record may cost to render.

Rendering a conversation runs the model's chat template, code that came with the tokenizer, on
data that came from anyone. Its cost is not bounded by the record's bytes: masking a template
without ``{% generation %}`` markers renders every prefix of the conversation, which grows with
the square of its messages (a 292 KB JSONL record of 8,000 messages, a 7 KB Parquet record of a
million, each rendered for hours), and a template's own loops or string doubling run until the
system stops them. So each record is held to a budget, and a record over it is a bad record at
its line, which ``--on-bad-record skip`` skips and the run goes on:

- ``--max-messages``: counted before anything is rendered (before a Parquet row is decoded);
- ``--max-record-tokens``: the rendered record's tokens. Tokenizing runs in native code that
  nothing interrupts, so a rendered text of more than ``CHARS_PER_TOKEN`` characters per token
  of the bound is over it untokenized (real text averages 1.5 to 5);
- ``--render-timeout`` and ``--render-memory``: the seconds and the memory growth of rendering
  and tokenizing one record, enforced by a watchdog thread (``Watchdog``) that raises
  ``OverBudget`` in the rendering thread. The check costs a few attribute writes a record; the
  watchdog wakes every ``IDLE_POLL_S``, and every ``POLL_S`` while a render lasts longer than
  that, reads the resident memory only while a record renders, and stops a render within a
  poll of its limit, or, where the render is inside native code, as soon as it returns to
  Python (so memory may pass its budget by what one such call allocates).

A subprocess or a resource-limited worker per record would bound the same with certainty, at a
cost per record that millions of records cannot pay.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

# Defaults that cover real datasets: multi-turn and agent conversations hold tens to hundreds of
# messages; 2^20 tokens is a long-context model's whole window.
DEFAULT_MAX_MESSAGES = 1024
DEFAULT_MAX_RECORD_TOKENS = 1 << 20
# A real record renders in milliseconds (a 1,024-message conversation masked from its prefixes
# in about a second), using a few times its text in memory.
DEFAULT_RENDER_TIMEOUT_S = 60.0
DEFAULT_RENDER_MEMORY_MIB = 1024
CHARS_PER_TOKEN = 8
# How often the watchdog looks at a render that has lasted longer than this already, and at
# the renders of a process otherwise (a look takes the GIL from the rendering thread: every
# 10 ms costs a record-sized render some 3 %, every 50 ms about 1 %).
POLL_S = 0.01
IDLE_POLL_S = 0.05
MAX_MESSAGES_FLAG = "--max-messages"
MAX_TOKENS_FLAG = "--max-record-tokens"
TIMEOUT_FLAG = "--render-timeout"
MEMORY_FLAG = "--render-memory"


class OverBudget(BaseException):
    """Raised in a rendering thread by its watchdog. A BaseException, so that the template's
    and the renderer's ``except Exception`` handlers let it through to the budget's caller."""


@dataclass(frozen=True)
class RenderBudget:
    """The bounds of one record's rendering; picklable."""

    max_messages: int = DEFAULT_MAX_MESSAGES
    max_tokens: int = DEFAULT_MAX_RECORD_TOKENS
    timeout_s: float = DEFAULT_RENDER_TIMEOUT_S
    memory_mib: int = DEFAULT_RENDER_MEMORY_MIB

    def messages_over(self, count: int) -> Optional[str]:
        """Why a conversation of ``count`` messages is not rendered, or None."""
        return too_many_messages(count, self.max_messages)

    def text_over(self, chars: int) -> Optional[str]:
        """Why a rendered text of ``chars`` characters is not tokenized, or None."""
        if chars <= CHARS_PER_TOKEN * self.max_tokens:
            return None
        return (
            f"the chat template renders it as {chars:,} characters, over {CHARS_PER_TOKEN} a token of the "
            f"{self.max_tokens:,}-token limit ({MAX_TOKENS_FLAG})"
        )

    def tokens_over(self, count: int) -> Optional[str]:
        """Why a rendered record of ``count`` tokens is not kept, or None."""
        if count <= self.max_tokens:
            return None
        return f"it renders as {count:,} tokens, over the {self.max_tokens:,}-token limit ({MAX_TOKENS_FLAG})"


def too_many_messages(count: int, limit: int) -> Optional[str]:
    """Why a conversation of ``count`` messages is over ``limit``, or None."""
    if count <= limit:
        return None
    return f"{count:,} messages, over the {limit:,}-message limit ({MAX_MESSAGES_FLAG})"


def resident_bytes() -> int:
    """This process's resident memory, 0 where /proc cannot tell."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return 0


PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class Watchdog:
    """Holds the renders of one process to a budget's time and memory, from a thread of its own.

    ``watch()`` brackets one record's render in the calling thread; the watchdog raises
    ``OverBudget`` there once the render passes ``timeout_s`` or grows the process's resident
    memory by more than ``memory_mib``, and ``reason`` says which."""

    def __init__(self, budget: RenderBudget, poll_s: float = POLL_S) -> None:
        self.budget = budget
        self.poll_s = poll_s
        self.reason = ""
        self._lock = threading.Lock()
        self._target: Optional[int] = None  # the thread rendering now
        self._started = 0.0
        self._deadline = 0.0
        self._baseline = 0  # resident bytes as the render began
        # The resident bytes the last poll saw, a render's baseline without a read of its own
        # (renders are shorter than a poll); None after a render that grew it past the budget.
        self._sample: Optional[int] = None
        self._fired = False
        self._thread: Optional[threading.Thread] = None

    @contextmanager
    def watch(self) -> Iterator[None]:
        """One record's render. Catch ``OverBudget`` around the ``with``, not inside it: it can be
        raised anywhere in the block, and as the block ends."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ringtrain-render-watchdog", daemon=True)
            self._thread.start()
        with self._lock:
            self._target = threading.get_ident()
            self._started = time.monotonic()
            self._deadline = self._started + self.budget.timeout_s
            self._baseline = self._sample if self._sample is not None else resident_bytes()
            self._fired = False
        try:
            yield
        finally:
            with self._lock:
                target, self._target = self._target, None
                if self._fired and target is not None:
                    # Fired as the render finished, not yet raised: the record made it.
                    _set_async_exc(target, None)

    def _run(self) -> None:
        limit = self.budget.memory_mib << 20
        interval = IDLE_POLL_S
        while True:
            time.sleep(interval)
            with self._lock:
                interval = IDLE_POLL_S
                if self._target is None or self._fired:
                    continue
                resident = resident_bytes()
                now = time.monotonic()
                over_time = now > self._deadline
                over_memory = resident - self._baseline > limit
                # After a render that grew past its budget, the next reads its own baseline.
                self._sample = None if over_memory else resident
                if not (over_time or over_memory):
                    # Records render in milliseconds: one still going is watched closely.
                    interval = self.poll_s if now - self._started > self.poll_s else IDLE_POLL_S
                    continue
                if over_time:
                    self.reason = f"rendering it took over {self.budget.timeout_s:g} s ({TIMEOUT_FLAG})"
                else:
                    self.reason = f"rendering it took over {self.budget.memory_mib:,} MiB of memory ({MEMORY_FLAG})"
                self._fired = True
                _set_async_exc(self._target, OverBudget)


def _set_async_exc(thread_id: int, exc: Optional[type[BaseException]]) -> None:
    """Raise ``exc`` in thread ``thread_id`` at its next Python instruction (None: cancel one
    not yet raised). CPython's own mechanism, as ``threading`` has no other to interrupt a thread."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)
