"""The writer lease of a checkpoint store: one run writes a store at a time.

Two runs writing one store replace each other's steps and apply retention to each other's
checkpoints. So a run takes the store's lease before it writes: the object ``writer.lease`` at
the store's root, naming its holder (the job, the run directory, host, pid and a random id) and
when it expires. The holder renews it every third of its term while it trains and removes it
when it ends. A second writer finds a live lease and is refused (``LeaseHeld``, a ConfigError
naming the holder and the expiry); a lease whose holder stopped renewing it (the run was
killed) expires after its term, and the next run takes it over. A holder on this very host
whose process is gone (its pid no longer runs, or runs another process: ``liveness``) is taken
over at once, so a crashed run is resumed without waiting for its lease; another host's lease,
or one of a process still running, waits for its expiry.

Taking and renewing are conditional writes (``ObjectBackend.put_if``): two runs racing for a free
or expired lease cannot both win, and a holder whose lease was taken over learns it at its next
renewal (``LeaseLost``), after which it must not write. Expiry is judged by each machine's clock:
the term is far longer than clocks drift apart.

The lease fences every write, not only the first: the store asks ``confirm`` (a read of the lease
object) before each shard, the manifest commit and each deletion, so a run whose lease was taken
over in the middle of a save writes no further shard, commits nothing and deletes nothing. At the
end of a run ``seal`` refuses every later write first, and the lease is released only once no
save is in flight (commands/run.py): a save still writing when a run stops cannot outlive the
lease it wrote under.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, Optional

from ringtrain.checkpoint import liveness
from ringtrain.checkpoint.backends import ObjectBackend, ObjectMissing, ObjectTooLarge
from ringtrain.checkpoint.fence import FenceLost
from ringtrain.checkpoint.s3_access import cause
from ringtrain.errors import ConfigError

log = logging.getLogger(__name__)

LEASE_KEY = "writer.lease"
LEASE_FORMAT = "ringtrain-writer-lease/1"
STORE_KEY = "checkpoint.uri"
# How often a holder renews, as a share of the term: two renewals may fail before it lapses.
RENEWALS_PER_TERM = 3
ACQUIRE_ATTEMPTS = 3
# A lease object is a few hundred bytes; one larger than this is not a lease (and is not read whole).
MAX_LEASE_BYTES = 64 * 1024


@dataclass(frozen=True)
class Holder:
    """Who holds a lease: enough for a person to find the run."""

    id: str
    job: str
    run_dir: str
    host: str
    pid: int
    # Where the pid means something and when that process started (``liveness``); "" and 0 in
    # leases written before they were recorded, whose holders are never judged gone.
    boot: str = ""
    started: int = 0

    @classmethod
    def this_process(cls, job: str, run_dir: str) -> Holder:
        pid = os.getpid()
        return cls(uuid.uuid4().hex, job, run_dir, socket.gethostname(), pid, liveness.this_boot(), liveness.started(pid) or 0)

    def describe(self) -> str:
        return f"run {self.job!r} (pid {self.pid} on {self.host}, run directory {self.run_dir})"

    def gone(self) -> bool:
        """Whether this holder's process is known to have ended (only on its own host)."""
        return liveness.is_gone(self.boot, self.pid, self.started)


@dataclass(frozen=True)
class LeaseRecord:
    holder: Holder
    expires_at: float  # unix seconds
    term_s: float

    def encode(self) -> bytes:
        body = {"format": LEASE_FORMAT, "holder": asdict(self.holder), "expires_at": self.expires_at, "term_s": self.term_s}
        return (json.dumps(body, sort_keys=True) + "\n").encode()

    @classmethod
    def decode(cls, data: bytes) -> Optional[LeaseRecord]:
        """The record, or None for bytes that are not one (treated as a lease nobody holds)."""
        try:
            body = json.loads(data)
            holder = Holder(**body["holder"])
            record = cls(holder, float(body["expires_at"]), float(body["term_s"]))
        except (ValueError, TypeError, KeyError):
            return None
        if not (isinstance(holder.pid, int) and isinstance(holder.boot, str) and isinstance(holder.started, int)):
            # Not ours to judge: a holder whose process cannot be told gone waits for expiry.
            record = dataclasses.replace(record, holder=dataclasses.replace(holder, pid=0, boot="", started=0))
        return record


def _when(unix: float) -> str:
    return datetime.fromtimestamp(unix, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class LeaseHeld(ConfigError):
    """Another run holds the store's lease: a second writer is bad input (exit 2)."""

    def __init__(self, store_uri: str, holder: str, expires_at: float, term_s: float) -> None:
        super().__init__(
            STORE_KEY,
            f"{store_uri} is being written by {holder}, whose lease runs until {_when(expires_at)}; two runs writing "
            f"one store would replace each other's checkpoints. Wait for it to end (a lease its holder stops renewing "
            f"expires {term_s:g} s later), or give this run another {STORE_KEY}",
        )
        self.store_uri, self.holder, self.expires_at, self.term_s = store_uri, holder, expires_at, term_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.store_uri, self.holder, self.expires_at, self.term_s))


class LeaseLost(FenceLost):
    """This run no longer holds the store's lease: it must not write to the store."""


class WriterLease:
    """The lease of one store for one holder; see the module docstring."""

    def __init__(
        self, backend: ObjectBackend, holder: Holder, term_s: float, *, clock: Callable[[], float] = time.time
    ) -> None:
        if not term_s > 0:
            raise ValueError(f"a lease term must be > 0 s, got {term_s}")
        self.backend, self.holder, self.term_s, self.clock = backend, holder, term_s, clock
        self.uri = backend.uri(LEASE_KEY)
        self._version: Optional[str] = None
        self._expires_at = 0.0
        self._lost: Optional[str] = None
        self._sealed: Optional[str] = None  # why this run writes no more (seal), the lease still held
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def held(self) -> bool:
        return self._version is not None and self._lost is None

    def check_free(self) -> None:
        """LeaseHeld when another run's lease is live; reads only (a refusal writes nothing)."""
        self._read_unless_held()

    def acquire(self) -> None:
        """Take the lease: free, expired, or already ours; LeaseHeld when another run's is live."""
        for _ in range(ACQUIRE_ATTEMPTS):
            version, current = self._read_unless_held()
            now = self.clock()
            if current is not None and current.holder.id != self.holder.id and current.expires_at <= now:
                log.warning("taking over the expired lease of %s on %s", current.holder.describe(), self.backend.root_uri)
            if self._write(now, version):
                return
        # Lost every race: other runs took it between each of our reads and writes.
        raise LeaseHeld(self.backend.root_uri, "another run", self.clock() + self.term_s, self.term_s)

    def _read_unless_held(self) -> tuple[Optional[str], Optional[LeaseRecord]]:
        """(version, record) of the lease object, both None when there is none; LeaseHeld when
        it is another run's and live."""
        try:
            data, version = self.backend.get_versioned(LEASE_KEY, MAX_LEASE_BYTES)
        except ObjectMissing:
            return None, None
        except ObjectTooLarge as exc:
            raise ConfigError(STORE_KEY, f"{exc}; it is not a writer lease: remove it if no run writes {self.backend.root_uri}") from None
        current = LeaseRecord.decode(data)
        if current is not None and current.holder.id != self.holder.id and current.expires_at > self.clock():
            if not current.holder.gone():
                raise LeaseHeld(self.backend.root_uri, current.holder.describe(), current.expires_at, current.term_s)
            log.warning(
                "the writer lease of %s on %s is live, but its process has ended: taking it over",
                current.holder.describe(), self.backend.root_uri,
            )  # fmt: skip
        return version, current

    def renew(self) -> None:
        """Push the expiry a term ahead; LeaseLost when the lease is no longer ours."""
        with self._lock:
            if self._lost is not None:
                raise LeaseLost(self._lost)
            if not self._write(self.clock(), self._version):
                self._lost = f"the writer lease {self.uri} was taken over by another run: this run no longer writes checkpoints there"
                raise LeaseLost(self._lost)

    def check(self) -> None:
        """Before each write: LeaseLost when the lease was lost, or lapsed unrenewed, or sealed."""
        if self._lost is not None:
            raise LeaseLost(self._lost)
        if self._sealed is not None:
            raise LeaseLost(self._sealed)
        if self._version is None:
            raise LeaseLost(f"this run never took the writer lease {self.uri}")
        if self.clock() >= self._expires_at:
            raise LeaseLost(f"the writer lease {self.uri} lapsed at {_when(self._expires_at)} without being renewed")

    def confirm(self) -> None:
        """Before each write to the store: ``check``, then ask the store itself whether the lease
        object is still the one this run last wrote (one small read); LeaseLost when it is not:
        taken over, or removed."""
        self.check()
        with self._lock:
            before = self._version
        try:
            _, stored = self.backend.get_versioned(LEASE_KEY, MAX_LEASE_BYTES)
        except (ObjectMissing, ObjectTooLarge):  # gone, or replaced by something that is no lease of ours
            stored = None
        with self._lock:
            # A renewal that ran during the read moved our version on: either one is ours.
            if stored is not None and stored in (before, self._version) and self._lost is None:
                return
            if self._lost is None:
                self._lost = f"the writer lease {self.uri} was taken over by another run (or removed): this run no longer writes checkpoints there"
            lost = self._lost
        raise LeaseLost(lost)

    def seal(self, reason: str = "this run is ending: it writes no more checkpoints") -> None:
        """Refuse every later write under this lease (``check`` and ``confirm`` raise LeaseLost
        with ``reason``); the lease itself is kept until ``release``."""
        self._sealed = reason

    def release(self) -> None:
        """Give the lease up, if it is still ours (a failure leaves it to expire)."""
        with self._lock:
            version, self._version = self._version, None
        if version is None:
            return
        try:
            self.backend.delete_if(LEASE_KEY, version)
        except Exception as exc:  # the lease expires on its own; the run's outcome stands
            log.warning("could not remove the writer lease %s (it expires on its own): %s", self.uri, exc)

    def start(self) -> None:
        """Renew the (acquired) lease on a background thread until ``stop``."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_until, args=(self._stop,), name="writer-lease", daemon=True)
        self._thread.start()

    def stop(self, *, release: bool = True) -> None:
        """Stop renewing and release the lease; with ``release`` false (a save may still be
        writing) it is left to expire on its own instead."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=self.term_s)
            self._thread = None
        if release:
            self.release()
        elif self._version is not None:
            log.warning(
                "left the writer lease %s to expire (in %g s at most): a save may still be writing", self.uri, self.term_s
            )

    @contextmanager
    def kept(self) -> Iterator[WriterLease]:
        """Renewed on a background thread until the block ends, then released."""
        self.start()
        try:
            yield self
        finally:
            self.stop()

    def _renew_until(self, stop: threading.Event) -> None:
        while not stop.wait(self.term_s / RENEWALS_PER_TERM):
            try:
                self.renew()
            except LeaseLost as exc:
                log.error("%s", exc)
                return
            except Exception as exc:  # a network blip: the next renewal may succeed before expiry
                said = cause(exc)
                log.warning("renewing the writer lease %s failed (the next renewal tries again): %s", self.uri, said or exc)

    def _write(self, now: float, version: Optional[str]) -> bool:
        record = LeaseRecord(self.holder, now + self.term_s, self.term_s)
        new_version = self.backend.put_if(LEASE_KEY, record.encode(), version)
        if new_version is None:
            return False
        self._version, self._expires_at = new_version, record.expires_at
        return True
