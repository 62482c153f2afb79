"""What of Ray's own console output reaches a ringtrain user: advice that contradicts ringtrain's
settings dropped, a dead worker's raylet report condensed to one line.

Two things Ray prints mislead here. On every start with token authentication (ringtrain's
default) its token-setup logger suggests ``RAY_AUTH_MODE=disabled``: the opposite of the security
defaults, so the warning is dropped. When a worker process dies, the raylet publishes a paragraph
to the driver that guesses at the OOM killer and ``ray stop --force`` and ends with advice on
resource isolation; for an injected crash, a preemption or a killed pid that guess is wrong, and
ringtrain's own incident line (printed right after) says what happened and what it does. So the
paragraph becomes one line with what Ray knows for certain: the worker's pid, address and exit.

The rules are pure (``condense``); ``quiet_ray_console`` installs them where Ray prints: a
logging filter, and a wrapper around the driver's error printer (``print_to_stdstream`` in
``ray._private.worker``, which Ray's error listener looks up by name on every message).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Optional

# Ray's logger that, on every start with token authentication, suggests RAY_AUTH_MODE=disabled.
AUTH_ADVICE_LOGGER = "ray._private.authentication.authentication_token_setup"
AUTH_ADVICE = "RAY_AUTH_MODE=disabled"
# The raylet's report of a dead worker, as Ray 2.60 words it.
WORKER_DIED = "A worker died or was killed while executing a task"
_FIELDS = {
    "pid": re.compile(r"Worker PID: (\d+)"),
    "address": re.compile(r"Worker IP address: (\S+)"),
    "exit_type": re.compile(r"Worker exit type: (\w+)"),
    # The detail up to Ray's list of guesses.
    "detail": re.compile(r"Worker exit detail: (.*?)(?:\s+Some common causes include|\s*$)", re.S),
}


def condense(message: str) -> Optional[str]:
    """One raylet message as ringtrain prints it: a dead worker's report as one line, advice to
    turn authentication off dropped (None), anything else unchanged."""
    if AUTH_ADVICE in message:
        return None
    if WORKER_DIED not in message:
        return message
    found = {name: pattern.search(message) for name, pattern in _FIELDS.items()}
    values = {name: " ".join(m.group(1).split()) if m else "?" for name, m in found.items()}
    return (
        f"Ray: worker pid {values['pid']} at {values['address']} exited ({values['exit_type']}: "
        f"{values['detail']}); ringtrain's incident line says what happened and what it does"
    )


class _DropAuthAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return AUTH_ADVICE not in record.getMessage()


def _condensed_printer(printer: Callable[..., Any]) -> Callable[..., Any]:
    def print_condensed(data: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if data.get("pid") != "raylet":
            return printer(data, *args, **kwargs)
        lines = [line for line in map(condense, data.get("lines", [])) if line is not None]
        if not lines:
            return None
        return printer({**data, "lines": lines}, *args, **kwargs)

    print_condensed.ringtrain_condensed = True  # type: ignore[attr-defined]
    return print_condensed


def quiet_ray_console() -> None:
    """Install the rules where Ray prints; once per process, however often it connects."""
    advice = logging.getLogger(AUTH_ADVICE_LOGGER)
    if not any(isinstance(f, _DropAuthAdvice) for f in advice.filters):
        advice.addFilter(_DropAuthAdvice())
    import ray._private.worker as ray_worker

    printer = getattr(ray_worker, "print_to_stdstream", None)
    if printer is not None and not getattr(printer, "ringtrain_condensed", False):
        ray_worker.print_to_stdstream = _condensed_printer(printer)
