"""ringtrain: elastic long-context training on Ray, DeepSpeed ZeRO and context-parallel attention."""

__version__ = "0.1.0"
