"""Evaluation scoring, pure: position buckets, loss tallies, passkey prompts and their scores.

Nothing here imports torch or Ray (``tokenizer`` alone, which loads a Hugging Face tokenizer,
sits a layer lower down): the per-rank computation is ``ringtrain.train.evaluator``, the fan-out
over a worker group ``ringtrain.actors.evaluation``.
"""
