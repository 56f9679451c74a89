"""The training library (level 3): losses (pure), diagnostics, drift, log-probs and the
reference, the pool, packing, the chunked LM head, group order, checkpoints, distributed
ranks, the update loop and the torchrun launcher. The `train` stage's entry is
stages/train.py. Imports levels 0-2 and its own modules.
"""
