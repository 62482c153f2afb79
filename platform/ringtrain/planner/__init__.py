"""Capacity planning: will a model at a sequence length fit on N GPUs, in which layout, how fast."""
