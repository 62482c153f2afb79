"""Windowed models under context parallelism against transformers' own: each gloo rank runs its
zigzag shard of a 64-token sequence through ring, Ulysses or hybrid attention with windows of
8, 13 and 24 tokens (shorter and longer than a rank's chunk), and its logits equal transformers'
at the same true positions (fp32, 1e-5 relative; each rank's body is tests/hf/test_peer_cp.py's).
Tiny Gemma 3 (local and global layers, each with its RoPE), Mistral and Qwen2, one spawn per
layout; the table of gaps is printed (``-s``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringtrain_dev.ranks import run_ranks
from tests.hf.test_peer_cp import LAYOUTS, logit_gaps
from tests.hf.windowed_models import MODELS

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from tests.hf.windowed_models import save_windowed

    root = tmp_path_factory.mktemp("windowed")
    return {name: str(save_windowed(root / name, name)) for name in MODELS}


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUTS)
def test_windowed_logits_equal_transformers_under_cp(layout: str, folders: dict[str, str], tmp_path: Path) -> None:
    impl, cp, ulysses, exchange = LAYOUTS[layout]
    gaps = run_ranks(logit_gaps, cp, tmp_path, impl, ulysses, exchange, folders)
    assert set(gaps) == set(folders)
    for name, gap in gaps.items():
        print(f"{name} {layout}: relative logit gap {gap:.2e}")
    worst = max(gaps, key=gaps.get)
    assert gaps[worst] < 1e-5, f"{worst}: {gaps[worst]:.2e}"
