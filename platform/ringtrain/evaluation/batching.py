"""Which prompts decode together, and on which replica; pure.

Prompts are taken longest first, so a batch's rows are of like length and little of it is
padding; a batch grows while its rows, each padded to its longest, stay within a token budget
(one prompt at least). Batch i goes to replica i mod dp, and the list is padded with copies of
its last batch to a multiple of dp, so every replica runs as many batches: under ZeRO-3 every
rank takes part in every forward. The plan depends on the prompts alone, so every rank makes
the same one.
"""

from __future__ import annotations

from collections.abc import Sequence


def plan_batches(lengths: Sequence[int], budget_tokens: int, replicas: int) -> list[list[int]]:
    """Batches of prompt indices (longest first), a multiple of ``replicas`` of them."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    if batches:
        batches += [batches[-1]] * (-len(batches) % replicas)
    return batches


def replica_batches(batches: Sequence[Sequence[int]], replicas: int, replica: int) -> list[Sequence[int]]:
    """The batches replica ``replica`` decodes."""
    return [b for i, b in enumerate(batches) if i % replicas == replica]
