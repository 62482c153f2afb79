"""SDC verdicts: each round's probe digests, compared with every rank's golden values and across ranks.

The probes (``ringtrain.train.sdc_probes``) compute fixed inputs, so on identical hardware and
software every rank's digest of a probe is the same bits, every round. Two checks follow:

- Across ranks: a digest that differs from a strict majority of the ranks' digests of that
  probe marks its rank an outlier.
- Against golden values: each rank's first round (taken at job start, or when it joined) is
  its golden set. When there is no majority (two ranks disagree, or an even split), the ranks
  whose digest left their golden value are the outliers, and so is a rank without a golden
  value that differs from the value a rank still at its golden value reports.

When every rank agrees but all left their golden value together, no rank can be named from
digests: the corruption is in what they share (a collective's contribution, a link), or the
software changed under the job. That is reported as kind ``shared`` with every rank.

A rank's golden value of a probe is set only from a round where the rank agreed with the
majority, so a chip that is bad from the start does not make its own corruption golden.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from ringtrain.policies.faults import Failure
from ringtrain.incidents import Kind

BASES = ("majority", "golden", "unresolved")
KINDS = ("outlier", "shared", "unresolved")


@dataclass(frozen=True)
class Finding:
    rank: int
    probe: str
    digest: str
    expected: str  # what it should have been ("" when no value can be trusted)
    basis: str  # majority: the other ranks; golden: its own first round; unresolved: neither


@dataclass(frozen=True)
class SdcVerdict:
    step: int
    kind: str  # outlier: ranks named; shared: every rank changed alike; unresolved: no evidence decides
    ranks: tuple[int, ...]
    probes: tuple[str, ...]
    findings: tuple[Finding, ...]
    explanation: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "kind": self.kind,
            "ranks": list(self.ranks),
            "probes": list(self.probes),
            "explanation": self.explanation,
            "findings": [
                {"rank": f.rank, "probe": f.probe, "digest": f.digest, "expected": f.expected, "basis": f.basis}
                for f in self.findings
            ],
        }


def _strict_majority(values: Iterable[str]) -> Optional[str]:
    votes = Counter(values)
    if not votes:
        return None
    (top, count), = votes.most_common(1)
    return top if count * 2 > sum(votes.values()) else None


class SdcScanner:
    """Golden values per rank and the judgement of each probe round.

    ``cross_rank=False`` for heterogeneous ranks (different GPU models or library builds), whose
    digests need not agree with each other: then each rank is compared with its golden only.
    """

    def __init__(self, *, cross_rank: bool = True) -> None:
        self.cross_rank = cross_rank
        self.golden: dict[int, dict[str, str]] = {}

    def forget(self, ranks: Iterable[int]) -> None:
        """Drop golden values: the ranks were replaced, or their probe inputs changed (a resize)."""
        for r in ranks:
            self.golden.pop(r, None)

    def reseat(self, seats: Sequence[Optional[int]]) -> None:
        """The world re-formed: new rank ``i`` is the worker that was rank ``seats[i]`` (None: a
        new worker). Golden values belong to the worker, so they move with it."""
        self.golden = {new: self.golden[old] for new, old in enumerate(seats) if old is not None and old in self.golden}

    def check(self, step: int, digests: Mapping[int, Mapping[str, str]]) -> Optional[SdcVerdict]:
        """Judge one round (rank -> probe -> digest, taken after ``step``); None when clean."""
        findings: list[Finding] = []
        for probe in sorted({p for d in digests.values() for p in d}):
            values = {r: d[probe] for r, d in digests.items() if probe in d}
            findings.extend(self._check_probe(probe, values))
        flagged = {(f.rank, f.probe) for f in findings}
        for r, d in digests.items():
            for probe, value in d.items():
                if (r, probe) not in flagged:
                    self.golden.setdefault(r, {}).setdefault(probe, value)
        return _verdict(step, findings, sorted(digests)) if findings else None

    def _check_probe(self, probe: str, values: Mapping[int, str]) -> list[Finding]:
        golden = {r: self.golden.get(r, {}).get(probe) for r in values}
        majority = _strict_majority(values.values()) if self.cross_rank else None
        if majority is not None:
            odd = [Finding(r, probe, v, majority, "majority") for r, v in values.items() if v != majority]
            if odd:
                return odd
            drifted = [r for r, v in values.items() if golden[r] is not None and golden[r] != v]
            return [Finding(r, probe, values[r], golden[r] or "", "golden") for r in drifted]
        out = [Finding(r, probe, v, g, "golden") for r, v in values.items() for g in [golden[r]] if g and g != v]
        # A rank still at its golden value vouches for that value; one without a golden value
        # that differs from it is the odd one.
        vouched = {v for r, v in values.items() if golden[r] == v}
        if self.cross_rank and len(vouched) == 1:
            (ref,) = vouched
            out += [Finding(r, probe, v, ref, "golden") for r, v in values.items() if golden[r] is None and v != ref]
        if self.cross_rank and not out and len(set(values.values())) > 1:
            # Ranks disagree and none has a golden value that says which one moved.
            out = [Finding(r, probe, v, "", "unresolved") for r, v in values.items()]
        return out


def _verdict(step: int, findings: list[Finding], reporting: list[int]) -> SdcVerdict:
    probes = tuple(sorted({f.probe for f in findings}))
    named = sorted({f.rank for f in findings if f.basis != "unresolved"})
    everyone_golden = all(f.basis == "golden" for f in findings) and named == reporting and len(reporting) > 1
    if everyone_golden and all(_agree(findings, p) for p in probes):
        kind = "shared"
        text = (f"every rank's {', '.join(probes)} changed from its golden value in the same way: the corruption "
                "is in what they share (a collective's contribution or a link) or the software changed")
    elif named:
        kind = "outlier"
        parts = []
        for r in named:
            mine = [f for f in findings if f.rank == r]
            why = "the other ranks" if all(f.basis == "majority" for f in mine) else "its golden value"
            parts.append(f"rank {r}: {', '.join(f.probe for f in mine)} differ from {why}")
        text = "; ".join(parts)
    else:
        kind = "unresolved"
        text = f"ranks disagree on {', '.join(probes)} with no majority and no golden value to decide"
    ranks = tuple(named) if named else tuple(sorted({f.rank for f in findings}))
    return SdcVerdict(step, kind, ranks, probes, tuple(findings), f"step {step}: {text}")


def _agree(findings: list[Finding], probe: str) -> bool:
    return len({f.digest for f in findings if f.probe == probe}) == 1


def scan_due(step: int, *, every: int, last_step: int) -> bool:
    """Whether the probes run after ``step``: on the cadence, and after the run's last step, so
    the state a run ends with has been vouched for."""
    return every > 0 and (step % every == 0 or step == last_step)


def sdc_failure(verdict: SdcVerdict, *, node_of: Mapping[int, str], evict_node: bool) -> Failure:
    """The failure to recover from: the named ranks (with every rank on their nodes when
    ``evict_node``), or no rank when digests cannot name one (shared, unresolved)."""
    if verdict.kind != "outlier":
        return Failure(Kind.SDC, (), verdict.explanation)
    ranks = set(verdict.ranks)
    if evict_node:
        nodes = {node_of[r] for r in verdict.ranks if node_of.get(r)}
        ranks |= {r for r, node in node_of.items() if node in nodes}
    return Failure(Kind.SDC, tuple(sorted(ranks)), verdict.explanation)
