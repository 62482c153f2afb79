"""Hang diagnosis: from every rank's collective records and stacks, the rank that stopped the job and why.

Input is one ``RankDiagnostics`` per rank, built from what ``ringtrain.train.collectives`` reports
(``RankDiagnostics.from_probe``) or marked unreachable when the rank did not answer. Output is
a ``Verdict`` naming the culprit rank(s) with their replica, ring position, host, the
collective in question and a stack excerpt.

How the culprit is found:

- Records are aligned by ``(group, seq)``: the n-th call on a group is the same call on every
  member, so members that disagree there, or never reached it, explain why its waiters wait.
- Every rank runs the same program (SPMD), so the i-th collective a process issues
  (``index``) has the same op and call site on every rank, whatever group it is on. A rank
  whose i-th call differs from the majority's went another way: it skipped a collective. This
  breaks the tie of a wait cycle (rank 1 waits for rank 3 in a data-parallel all-reduce while
  rank 3 waits for rank 1 in the next world all-reduce: rank 3 is the one that skipped).
- A rank absent from a collective but itself waiting in another one is a victim: the search
  follows it to the collective it waits in.

Kinds, most decisive first: ``unreachable`` (no answer), ``mismatch_op`` (entered another op
at that sequence number), ``mismatch_shape`` (same op, other shapes or dtype), ``missing``
(never entered it, and went elsewhere or finished), ``compute`` (stuck outside any collective
while peers wait), ``transport`` (every member entered and it still does not complete: the
network or the collective library).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

KINDS = ("unreachable", "mismatch_op", "mismatch_shape", "missing", "compute", "transport")
_PRIORITY = {kind: i for i, kind in enumerate(KINDS)}
STACK_EXCERPT_FRAMES = 5

Key = tuple[str, int]  # (group name, sequence number on that group)
Signature = tuple[str, tuple[tuple[int, ...], ...], str]  # (op, shapes, dtype)
T = TypeVar("T")


def stalled(last_progress_time: float, now: float, hang_timeout_s: float) -> bool:
    """True when nothing has progressed for ``hang_timeout_s`` seconds."""
    if hang_timeout_s <= 0:
        raise ValueError(f"hang_timeout_s must be > 0 (got {hang_timeout_s})")
    return now - last_progress_time >= hang_timeout_s


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective call on one rank, as ``train.collectives`` records it."""

    group: str
    group_ranks: tuple[int, ...]
    seq: int  # 1-based count of calls on ``group`` by this rank, this one included
    index: int  # 0-based count of calls by this rank on any group, before this one
    op: str
    shapes: tuple[tuple[int, ...], ...] = ()
    dtype: str = ""
    start: float = 0.0
    end: Optional[float] = None  # None while in flight
    site: str = ""
    thread: str = ""
    error: Optional[str] = None
    peers: tuple[int, ...] = ()
    device_done: Optional[bool] = None  # CUDA: whether the GPU finished it; None on CPU

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CollectiveRecord:
        return cls(
            group=str(d["group"]),
            group_ranks=tuple(int(r) for r in d.get("group_ranks") or ()),
            seq=int(d["seq"]),
            index=int(d.get("index", -1)),
            op=str(d["op"]),
            shapes=tuple(tuple(int(n) for n in s) for s in d.get("shapes") or ()),
            dtype=str(d.get("dtype") or ""),
            start=float(d.get("start") or 0.0),
            end=None if d.get("end") is None else float(d["end"]),
            site=str(d.get("site") or ""),
            thread=str(d.get("thread") or ""),
            error=None if d.get("error") is None else str(d["error"]),
            peers=tuple(int(p) for p in d.get("peers") or ()),
            device_done=None if d.get("device_done") is None else bool(d["device_done"]),
        )

    @property
    def key(self) -> Key:
        return (self.group, self.seq)

    @property
    def signature(self) -> Signature:
        """What every member of the group must pass identically."""
        return (self.op, self.shapes, self.dtype)

    def where(self) -> str:
        ranks = ",".join(str(r) for r in self.group_ranks)
        return f"{self.op} #{self.seq} on group {self.group} (ranks {ranks})"

    def args(self) -> str:
        shapes = ", ".join("[" + ",".join(str(n) for n in s) + "]" for s in self.shapes) or "no tensors"
        return f"{shapes} {self.dtype}".strip()


@dataclass(frozen=True)
class RankDiagnostics:
    """What one rank reported when the job stalled (or that it did not answer)."""

    rank: int
    replica: int = -1
    ring_pos: int = -1
    host: str = ""
    reachable: bool = True
    busy: bool = True  # running a step; False when idle between calls (it finished its work)
    records: tuple[CollectiveRecord, ...] = ()
    in_collective: Optional[CollectiveRecord] = None  # the call a thread is blocked in
    last_progress: float = 0.0
    last_thread: str = ""  # the thread that issued the latest collective: the training thread
    stacks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def from_probe(
        cls,
        rank: int,
        diagnostics: Mapping[str, Any],
        *,
        replica: int = -1,
        ring_pos: int = -1,
        host: str = "",
        busy: bool = True,
    ) -> RankDiagnostics:
        """From ``CollectiveRecorder.diagnostics()`` of that rank."""
        state = diagnostics.get("state") or {}
        inside = state.get("in_collective")
        return cls(
            rank=rank,
            replica=replica,
            ring_pos=ring_pos,
            host=host,
            busy=busy,
            records=tuple(CollectiveRecord.from_dict(r) for r in diagnostics.get("records") or ()),
            in_collective=CollectiveRecord.from_dict(inside) if inside else None,
            last_progress=float(state.get("last_progress") or 0.0),
            last_thread=str(state.get("last_thread") or ""),
            stacks={str(k): tuple(v) for k, v in (diagnostics.get("stacks") or {}).items()},
        )

    @classmethod
    def unreachable(cls, rank: int, *, replica: int = -1, ring_pos: int = -1, host: str = "") -> RankDiagnostics:
        return cls(rank=rank, replica=replica, ring_pos=ring_pos, host=host, reachable=False)

    def placement(self) -> str:
        parts = (f"replica {self.replica}" if self.replica >= 0 else "",
                 f"ring_pos {self.ring_pos}" if self.ring_pos >= 0 else "")
        where = ", ".join(p for p in parts if p)
        host = f" on {self.host}" if self.host else ""
        return f"rank {self.rank}" + (f" ({where})" if where else "") + host


@dataclass(frozen=True)
class Culprit:
    rank: int
    kind: str
    replica: int
    ring_pos: int
    host: str
    op: str  # the collective in question: the one waited in, or the culprit's own for a mismatch
    group: str
    group_ranks: tuple[int, ...]
    seq: int
    detail: str  # why this rank, in one clause
    stack: tuple[str, ...]  # the innermost frames of its training thread, innermost last


@dataclass(frozen=True)
class Verdict:
    kind: str
    culprits: tuple[Culprit, ...]  # the ranks of ``kind``, by rank
    explanation: str  # one line for logs and incident records
    waiting: tuple[int, ...] = ()  # ranks blocked in a collective
    others: tuple[Culprit, ...] = ()  # less decisive findings (e.g. a slow rank behind a skipped call)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(c.rank for c in self.culprits)

    def to_dict(self) -> dict[str, Any]:
        def culprit(c: Culprit) -> dict[str, Any]:
            return {
                "rank": c.rank, "kind": c.kind, "replica": c.replica, "ring_pos": c.ring_pos, "host": c.host,
                "op": c.op, "group": c.group, "group_ranks": list(c.group_ranks), "seq": c.seq,
                "detail": c.detail, "stack": list(c.stack),
            }

        return {
            "kind": self.kind,
            "ranks": list(self.ranks),
            "explanation": self.explanation,
            "waiting": list(self.waiting),
            "culprits": [culprit(c) for c in self.culprits],
            "others": [culprit(c) for c in self.others],
        }


_LIBRARY_PATHS = ("/torch/", "/deepspeed/", "ringtrain/train/collectives.py", "ringtrain/train/forensics.py")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>[^\n]+)(?:\n\s*(?P<code>.*))?')


def _short(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    if "ringtrain" in parts:
        return "/".join(parts[parts.index("ringtrain"):])
    return "/".join(parts[-2:])


def stack_excerpt(d: RankDiagnostics, thread: str = "", frames: int = STACK_EXCERPT_FRAMES) -> tuple[str, ...]:
    """The innermost ``frames`` frames of the rank's training thread, one line each."""
    if not d.stacks:
        return ()
    wanted = thread or d.last_thread
    chosen = next((s for name, s in d.stacks.items() if wanted and name.split(" (")[0] == wanted), None)
    if chosen is None:
        chosen = next((s for s in d.stacks.values() if any("ringtrain" in f for f in s)), None)
    if chosen is None:
        main = (s for name, s in d.stacks.items() if name.startswith("MainThread"))
        chosen = next(main, next(iter(d.stacks.values())))
    # The innermost frames of a blocked thread are the collective library's and the recorder's;
    # the excerpt starts at the caller.
    end = len(chosen)
    while end > 0 and any(lib in chosen[end - 1].replace("\\", "/") for lib in _LIBRARY_PATHS):
        end -= 1
    lines = []
    for frame in (chosen[:end] or chosen)[-frames:]:
        m = _FRAME.search(frame)
        if m is None:
            lines.append(frame.strip().splitlines()[0] if frame.strip() else frame)
            continue
        code = (m.group("code") or "").strip()
        lines.append(f"{_short(m.group('file'))}:{m.group('line')} {m.group('func')}" + (f": {code}" if code else ""))
    return tuple(lines)


class _Analysis:
    def __init__(self, ranks: Sequence[RankDiagnostics]) -> None:
        self.by_rank = {d.rank: d for d in ranks}
        self.live = {d.rank: d for d in ranks if d.reachable}
        self.at_key: dict[int, dict[Key, CollectiveRecord]] = {}
        self.at_index: dict[int, dict[int, CollectiveRecord]] = {}
        for r, d in self.live.items():
            recs = list(d.records) + ([d.in_collective] if d.in_collective else [])
            self.at_key[r] = {rec.key: rec for rec in recs}
            self.at_index[r] = {rec.index: rec for rec in recs if rec.index >= 0}
        self.deviants = self._deviants()

    def _deviants(self) -> dict[int, tuple[CollectiveRecord, tuple[str, str]]]:
        """Each rank's first call whose (op, site) differs from a strict majority at that index,
        with the majority's (op, site)."""
        first: dict[int, tuple[CollectiveRecord, tuple[str, str]]] = {}
        for i in sorted({i for recs in self.at_index.values() for i in recs}):
            here = {r: recs[i] for r, recs in self.at_index.items() if i in recs}
            top = _strict_majority(Counter((rec.op, rec.site) for rec in here.values()))
            for r, rec in here.items():
                if top is not None and (rec.op, rec.site) != top and r not in first:
                    first[r] = (rec, top)
        return first

    def culprit(self, rank: int, kind: str, rec: Optional[CollectiveRecord], detail: str) -> Culprit:
        d = self.by_rank[rank]
        thread = d.in_collective.thread if d.in_collective else ""
        return Culprit(
            rank=rank, kind=kind, replica=d.replica, ring_pos=d.ring_pos, host=d.host,
            op=rec.op if rec else "", group=rec.group if rec else "", group_ranks=rec.group_ranks if rec else (),
            seq=rec.seq if rec else 0, detail=detail, stack=stack_excerpt(d, thread),
        )

    def _expected_signature(self, present: Mapping[int, CollectiveRecord]) -> Optional[Signature]:
        """What the members should have passed: their majority, else the same call's on every rank."""
        inside = _strict_majority(Counter(rec.signature for rec in present.values()))
        if inside is not None:
            return inside
        # No majority inside the group (two members disagree): the same call, by index and site,
        # on the other ranks decides, whatever group they issued it on.
        spots = {(rec.index, rec.site) for rec in present.values()}
        votes: Counter[Signature] = Counter()
        for recs in self.at_index.values():
            for index, site in spots:
                rec = recs.get(index)
                if rec is not None and rec.site == site:
                    votes[rec.signature] += 1
        return _strict_majority(votes)

    def _mismatches(self, present: Mapping[int, CollectiveRecord]) -> list[Culprit]:
        if len({rec.signature for rec in present.values()}) <= 1:
            return []
        expected = self._expected_signature(present)
        odd = sorted(m for m, rec in present.items() if expected is None or rec.signature != expected)
        ops = {rec.op for rec in present.values()}
        out = []
        for m in odd:
            rec = present[m]
            if expected is None:
                kind = "mismatch_op" if len(ops) > 1 else "mismatch_shape"
                others = sorted({f"{o.op} {o.args()}" for n, o in present.items() if n != m})
                detail = f"entered {rec.op} {rec.args()} as call #{rec.seq} on group {rec.group} where other " \
                         f"members passed {' or '.join(others)} (no majority says which is right)"
            else:
                kind = "mismatch_op" if rec.op != expected[0] else "mismatch_shape"
                want = CollectiveRecord(rec.group, rec.group_ranks, rec.seq, -1, *expected)
                detail = f"entered {rec.op} {rec.args()} as call #{rec.seq} on group {rec.group} where the " \
                         f"others passed {want.op} {want.args()}"
            out.append(self.culprit(m, kind, rec, detail))
        return out

    def blame(self, waited: CollectiveRecord, visited: frozenset[Key]) -> list[Culprit]:
        """Why the waiters of ``waited`` wait: the members absent or different there, followed."""
        key = waited.key
        visited = visited | {key}
        present = {m: self.at_key[m][key] for m in waited.group_ranks if m in self.live and key in self.at_key[m]}
        found = self._mismatches(present)
        if found:
            return found
        for m in waited.group_ranks:
            if m in present:
                continue
            d = self.by_rank.get(m)
            if d is None or not d.reachable:
                found.append(self.culprit(m, "unreachable", waited, f"did not answer; {waited.where()} waits for it"))
            elif m in self.deviants:
                went, _ = self.deviants[m]
                found.append(self.culprit(m, "missing", waited, f"never entered {waited.where()}: it issued "
                                                              f"{went.where()} at {went.site} instead"))
            elif d.in_collective is not None and d.in_collective.key not in visited:
                found.extend(self.blame(d.in_collective, visited) or [
                    self.culprit(m, "missing", waited, f"never entered {waited.where()}; "
                                                       f"it waits in {d.in_collective.where()}")])
            elif d.in_collective is not None:
                found.append(self.culprit(m, "missing", waited, f"never entered {waited.where()}; it waits in "
                                                              f"{d.in_collective.where()}, which waits for this one"))
            elif not d.busy:
                found.append(self.culprit(m, "missing", waited, f"finished its work without entering {waited.where()}"))
            else:
                found.append(self.culprit(m, "compute", waited, f"is outside any collective{_innermost(d)} while "
                                                              f"{waited.where()} waits for it"))
        if not found and len(present) == len(waited.group_ranks):
            found = [self.culprit(m, "transport", waited, f"entered {waited.where()}, which every member entered "
                                                          "and which does not complete") for m in sorted(present)]
        return found


def _strict_majority(votes: Counter[T]) -> Optional[T]:
    """The value with more than half the votes, or None."""
    if not votes:
        return None
    (top, count), = votes.most_common(1)
    return top if count * 2 > sum(votes.values()) else None


def _innermost(d: RankDiagnostics) -> str:
    frame = stack_excerpt(d, frames=1)
    return f" (in {frame[0]})" if frame else ""


def _merge(culprits: Sequence[Culprit]) -> list[Culprit]:
    """One finding per rank, the most decisive; ordered by rank."""
    best: dict[int, Culprit] = {}
    for c in culprits:
        if c.rank not in best or _PRIORITY[c.kind] < _PRIORITY[best[c.rank].kind]:
            best[c.rank] = c
    return [best[r] for r in sorted(best)]


def _explain(kind: str, culprits: Sequence[Culprit], a: _Analysis, waiting: Sequence[int]) -> str:
    first = culprits[0]
    who = a.by_rank[first.rank].placement()
    if len(culprits) > 1:
        who = f"ranks {', '.join(str(c.rank) for c in culprits)}; {who}"
    more = f" (and {len(culprits) - 1} more)" if len(culprits) > 1 else ""
    if not waiting:
        return f"no rank is in a collective: {who} {first.detail}{more}"
    return f"{kind}: {who} {first.detail}{more}; waiting: ranks {', '.join(str(r) for r in waiting)}"


def diagnose(ranks: Sequence[RankDiagnostics]) -> Optional[Verdict]:
    """The culprit of a stall from every rank's diagnostics; None when no rank is stuck."""
    a = _Analysis(ranks)
    waited = {r: d.in_collective for r, d in a.live.items() if d.in_collective is not None}
    waiting = sorted(waited)
    found: list[Culprit] = []
    for d in ranks:
        if not d.reachable:
            theirs = {w: rec for w, rec in waited.items() if d.rank in rec.group_ranks}
            first = min(theirs.values(), key=lambda rec: rec.start, default=None)
            found.append(a.culprit(d.rank, "unreachable", first, "did not answer the diagnostic call" + (
                f"; ranks {', '.join(map(str, sorted(theirs)))} wait for it" if theirs else "")))
    # The longest-waiting collectives first: they are nearest the cause.
    keys: dict[Key, CollectiveRecord] = {}
    for rec in sorted(waited.values(), key=lambda rec: rec.start):
        keys.setdefault(rec.key, rec)
    for rec in keys.values():
        found.extend(a.blame(rec, frozenset()))
    # A rank that left the common program is at fault even where no one waits for it yet.
    for r, (went, (op, site)) in sorted(a.deviants.items()):
        found.append(a.culprit(r, "missing", went, f"issued {went.where()} at {went.site} as its call "
                                                   f"#{went.index} where the other ranks issued {op} at {site}"))
    if not waited and not found:
        found = [a.culprit(r, "compute", None, f"is outside any collective{_innermost(d)}")
                 for r, d in sorted(a.live.items()) if d.busy]
    merged = _merge(found)
    if not merged:
        return None
    kind = min((c.kind for c in merged), key=_PRIORITY.__getitem__)
    culprits = tuple(c for c in merged if c.kind == kind)
    others = tuple(c for c in merged if c.kind != kind)
    return Verdict(kind=kind, culprits=culprits, explanation=_explain(kind, culprits, a, waiting),
                   waiting=tuple(waiting), others=others)
