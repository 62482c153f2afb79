"""Durable checkpoints: step-tagged sets of named byte shards under a file:// or s3:// URI.

The store holds bytes and knows nothing of tensors or ranks; see store.py for its guarantees
and layout.py for where each object lives.
"""

from ringtrain.checkpoint.loaded import CheckpointRef, LoadedCheckpoint, Skipped
from ringtrain.checkpoint.manifest import CHECKSUM_ALGOS, CheckpointCorrupt, Manifest
from ringtrain.checkpoint.options import S3Options
from ringtrain.checkpoint.store import CheckpointStore, Compatible, open_store

__all__ = [
    "CHECKSUM_ALGOS",
    "CheckpointCorrupt",
    "CheckpointRef",
    "CheckpointStore",
    "Compatible",
    "LoadedCheckpoint",
    "Manifest",
    "S3Options",
    "Skipped",
    "open_store",
]
