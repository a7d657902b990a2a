"""The training spine: one straight-line loop for every topology, and its components.

``trainer.py`` is the loop; the other modules are the pieces it uses, each readable alone:
``distributed`` (process group, FSDP2, reductions), ``optim`` (AdamW, fp32 master weights,
LR schedule), ``checkpoint`` (atomic save, pointers, rotation, resume contract),
``evaluator`` (batch-size- and rank-invariant metrics), ``metrics`` (JSONL, progress bar),
``plot`` (the curves PNG).
"""
