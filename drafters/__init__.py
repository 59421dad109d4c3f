"""Drafters trained on hsx runs (EAGLE, EAGLE-3, P-EAGLE, DFlash, Medusa, MLPSpeculator): one module per family (model, checkpoint,
proposer), the registry, and the checkpoint I/O they share.

    base.py            TargetHead, DrafterBatch, StepResult, Drafter (the interface every family implements:
                       for_run -> prepare -> training_step -> save_pretrained / from_pretrained)
    eagle3.py          Eagle3Config, Eagle3Drafter (fc over the aux layers, a Llama layer over [embedding ; fused
                       state], draft vocabulary, test-time-training unroll; speculators checkpoint)
    eagle3_proposer.py Eagle3Proposer: EAGLE-3 decoding in the engine (its own KV cache, rolled back per row);
                       EagleProposer: the same loop for EAGLE
    eagle.py           EagleConfig, EagleDrafter (EAGLE-1, vLLM's eagle: fc over [embedding ; post-norm feature],
                       Llama layers, the target's lm_head; feature regression + token loss; vLLM's eagle layout)
    peagle.py          PEagleConfig, PEagleDrafter, PEagleProposer (P-EAGLE: EAGLE-3 + mask_hidden, all k drafts in
                       one forward; COD depth sampling; speculators peagle checkpoint; parallel_drafting)
    dflash.py          DFlashConfig, DFlashDrafter, DFlashProposer (DFlash block drafter: a block of block_size slots,
                       bidirectional inside, over the fused aux-layer context; speculators dflash checkpoint)
    vocab.py           DraftVocab, build_draft_vocab: EAGLE-3's draft vocabulary and its d2t / t2d maps
    medusa.py          MedusaConfig, MedusaDrafter, MedusaProposer (heads on the last post-norm state)
    mlp_speculator.py  MLPSpeculatorConfig, MLPSpeculatorDrafter, MLPSpeculatorProposer (IBM's architecture)
    registry.py        Family, families(), family(name), register(family), drafter_class(name): the one registry
                       (extractor.methods) the trainer, the evaluator and the engine read; entry points `hsx.drafters`

The trainer is training/trainer.py, the evaluation training/evaluate.py.

Nothing is imported here: `import drafters` is cheap; import the module you need.
"""
