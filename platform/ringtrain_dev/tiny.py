"""The tiny models tests and benches train: config overrides shared by every tier, so a shape
change is one edit.

``TINY_MODEL`` is the gloo tiers' model (dim 64, 2 layers, grouped-query attention); ``TINIEST_MODEL``
the Ray tiers', whose runs start many processes and train through the CLI. Each test adds its
own data, mesh and schedule keys; ``TINY`` is the Ray tiers' whole tiny run (the quickstart job's
mesh and data, shrunk), which most of them start from.
"""

from __future__ import annotations

TINY_MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2"]
TINIEST_MODEL = ["model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1"]
TINY = [
    *TINIEST_MODEL,
    "data.seq_len=64",
    "train.global_batch=4",
    "train.warmup_steps=1",
    "cluster.num_cpus=2",
]
