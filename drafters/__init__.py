"""Drafters trained on hsx runs (EAGLE-3, Medusa, MLPSpeculator): models, training, checkpoints, proposers.

    base.py            TargetHead, DrafterBatch, StepResult, Drafter (the interface every family implements:
                       for_run -> prepare -> training_step -> save_pretrained / from_pretrained)
    eagle3.py          Eagle3Config, Eagle3Drafter (fc over the aux layers, a Llama layer over [embedding ; fused
                       state], draft vocabulary, test-time-training unroll; speculators checkpoint), Eagle3Proposer
    vocab.py           DraftVocab, build_draft_vocab: EAGLE-3's draft vocabulary and its d2t / t2d maps
    medusa.py          MedusaConfig, MedusaDrafter, MedusaProposer (heads on the last post-norm state)
    mlp_speculator.py  MLPSpeculatorConfig, MLPSpeculatorDrafter, MLPSpeculatorProposer (IBM's architecture)
    train.py           TrainDrafterConfig, train_drafter(config) -> report: `hsx train-drafter` (checks before
                       training, packed batches, progress bar, resumable checkpoints, report.json)

Nothing is imported here: `import drafters` is cheap; import the module you need.
"""
