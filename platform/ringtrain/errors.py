"""The platform's exception hierarchy: small, picklable, with messages that say what to change.

Exceptions cross actor boundaries, so each one pickles through its constructor arguments
(``__reduce__``) instead of relying on ``BaseException``'s positional-args protocol, which
breaks for subclasses whose ``__init__`` takes keyword-only or differently ordered arguments.

Each class also says how a command that ends on it exits (``exit_code``) and what its one line
calls it (``label``); ``ending`` turns an error, or the user's Ctrl-C, into that code and line,
and ``end`` says it for a verb that returns its own exit code.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, ClassVar, Union

# A command's exit codes: 0 success, 1 the run failed, 2 bad input, 130 interrupted (128 + SIGINT).
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class RingtrainError(Exception):
    """Base class: every error the platform raises on purpose."""

    exit_code: ClassVar[int] = EXIT_FAILED
    label: ClassVar[str] = "error"  # "": the message alone follows "ringtrain: "

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message,))

    def __str__(self) -> str:
        return self.message


class ConfigError(RingtrainError):
    """A config value is missing, unknown or invalid; ``key`` is the dotted key to change."""

    exit_code = EXIT_USAGE
    label = "config error"

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.reason))


class CapacityError(ConfigError):
    """The cluster cannot place the requested mesh."""


class DataError(RingtrainError):
    """A data source cannot be read or holds too little data for the configured sequence: bad
    input, named by its file (and line) where no config key says which."""

    exit_code = EXIT_USAGE
    label = "data error"


class WorkerError(RingtrainError):
    """A training worker failed; names the rank and its host so the user knows where to look.

    ``kind``: "died" (the process is gone), "error" (an exception), "timeout" (no answer).
    """

    def __init__(self, rank: int, host: str, cause: str, kind: str = "error") -> None:
        super().__init__(f"rank {rank} on {host}: {cause}")
        self.rank = rank
        self.host = host
        self.cause = cause
        self.kind = kind

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.host, self.cause, self.kind))


class NonFiniteLoss(RingtrainError):
    """A step's loss was NaN or infinite."""


class ClusterError(RingtrainError):
    """Ray could not be reached or started."""


def first_line(exc: Union[BaseException, str]) -> str:
    """The first line of a library's exception, or of its message (transformers', lm-eval's,
    OmegaConf's and PyYAML's run to many), for a message of one line, without a colon that led
    into the next; its type's name when it says nothing."""
    text = str(exc).strip().splitlines()
    return text[0].rstrip(": ") if text else type(exc).__name__


@dataclass(frozen=True)
class Ending:
    """How a command ends: its exit code and the one line it leaves on stderr."""

    code: int
    line: str


def ending(exc: Union[RingtrainError, KeyboardInterrupt], command: str = "") -> Ending:
    """How a command that stopped on ``exc`` ends: its class's exit code, and one line naming
    ``command`` where given (a verb that reports its own errors), else the error's label; Ctrl-C
    exits 130."""
    if isinstance(exc, KeyboardInterrupt):
        return Ending(EXIT_INTERRUPTED, _line(command, "interrupted"))
    return Ending(exc.exit_code, _line(command or exc.label, str(exc)))


def end(exc: Union[RingtrainError, KeyboardInterrupt], command: str = "") -> int:
    """End a command that returns its own exit code on ``exc``: ``ending``'s line on stderr, its
    code returned."""
    said = ending(exc, command)
    print(said.line, file=sys.stderr)
    return said.code


def line_start(label: str) -> str:
    """How a line ``ending`` writes under ``label`` begins: what a reader of a command's output
    looks for to tell one kind of ending from another (``submit`` reads a job's)."""
    return f"ringtrain: {label}:"


def _line(label: str, text: str) -> str:
    return f"{line_start(label)} {text}" if label else f"ringtrain: {text}"
