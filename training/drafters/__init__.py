"""Drafters trained on hsx runs (EAGLE-3, Medusa, MLPSpeculator): models, training, checkpoints, proposers.

    base.py    TargetHead, DrafterBatch, StepResult, Drafter (the interface every family implements)
"""
