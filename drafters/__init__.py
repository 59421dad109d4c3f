"""Drafters trained on hsx runs, one family per module pair (the families: registry.py, filled from pyproject.toml).

One convention for every family NAME: drafters/NAME.py holds its config, its Drafter (model, training step,
checkpoint), FEATURES (what it reads from a run) and FAMILY (its registry entry); drafters/NAME_proposer.py holds its
Proposer, the decoding loop in hsx's engine, which only the engine imports (through Family.proposer_class), so
training never loads decoding code.

    base.py            TargetHead, DrafterBatch, StepResult, Drafter (the interface every family implements:
                       for_run -> prepare -> training_step -> save_pretrained / from_pretrained); checkpoint files
    features.py        Features (what a family reads from a run, as data), run_fit, union_layer_ids: the questions
                       the trainer's layer check, online extraction and `hsx run`'s default layers ask
    registry.py        Family, families(), family(name), register(family), drafter_class(name),
                       trainable_families(), family_features(name), default_layer_ids(n): the one registry (extractor.methods) the
                       trainer, the evaluator and the engine read; entry points `hsx.drafters`

    eagle3.py          Eagle3Config, Eagle3Drafter (fc over the aux layers, a Llama layer over [embedding ; fused
                       state], draft vocabulary, test-time-training unroll; speculators checkpoint)
    eagle3_proposer.py Eagle3Proposer: EAGLE-3 decoding in the engine (its own KV cache, rolled back per row); the
                       loop EAGLE's and P-EAGLE's proposers build on
    eagle.py           EagleConfig, EagleDrafter (EAGLE-1, vLLM's eagle: fc over [embedding ; post-norm feature],
                       Llama layers, the target's lm_head; feature regression + token loss; vLLM's eagle layout)
    eagle_proposer.py  EagleProposer
    peagle.py          PEagleConfig, PEagleDrafter (P-EAGLE: EAGLE-3 + mask_hidden, all k drafts in one forward;
                       COD depth sampling; speculators peagle checkpoint; parallel_drafting)
    peagle_proposer.py PEagleProposer
    dflash.py          DFlashConfig, DFlashDrafter (DFlash block drafter: a block of block_size slots,
                       bidirectional inside, over the fused aux-layer context; speculators dflash checkpoint)
    dflash_proposer.py DFlashProposer
    dspark.py          DSparkConfig, MarkovHead, ConfidenceHead, DSparkDrafter (DSpark: DFlash's block with every slot
                       drafting, a low-rank Markov head over the previous token, a confidence head; speculators
                       dspark checkpoint)
    dspark_proposer.py DSparkProposer (the Markov correction slot by slot; the confidence early stop)
    medusa.py          MedusaConfig, MedusaDrafter (heads on the last post-norm state)
    medusa_proposer.py MedusaProposer
    mlp_speculator.py  MLPSpeculatorConfig, MLPSpeculatorDrafter (IBM's architecture)
    mlp_speculator_proposer.py   MLPSpeculatorProposer
    mtp.py             MtpHead, checkpoint_tensors, MtpConfig, MtpDrafter, FAMILY: a target's own MTP layers read
                       from its checkpoint (DeepSeek-V3 / GLM-4.5 / Qwen3-Next / Qwen3.5 layouts) as its drafter, and
                       their fine-tuning (`hsx train-drafter --kind mtp`)
    mtp_styles.py      MtpStyle, STYLES, mtp_style: where each family's checkpoint keeps its MTP layers, what they compute
    mtp_checkpoint.py  mtp_weight_map, expert_sources, read_mtp_tensors (the target's MTP tensors read),
                       write_target_with (`hsx merge-mtp`), check_source, preflight (made for this target?)
    mtp_proposer.py    MtpProposer (EAGLE-3's row cache and loop, step s reading MTP layer s % L)
    target_identity.py target_digest, check_made_for: which target a draft was made for, told by the values of the
                       tensors it shares with it (another target of the same shape is refused, a copy of the same one
                       in another dtype is not)

    what families share (public, each named by its concept):
    llama_layers.py    llama_layer_config, with_draft_attention: draft layers sized like the target's (EAGLE-3, EAGLE, DFlash)
    attention.py       Layout, ranged_attention, TTTAttention: attention within each packed document with no [T, T]
                       term (the TTT families' unroll, DFlash's blocks)
    memory.py          MemoryOptions, cross_entropy, recompute_in_backward: the memory levers of training
                       (--ce-chunk-tokens, --gradient-checkpointing, --autocast)
    ttt.py             shift_left, needed_chains, unroll_chains: the test-time-training unroll (EAGLE-3, EAGLE,
                       P-EAGLE), each step over the chains it trains
    vocab.py           DraftVocab, build_draft_vocab: EAGLE-3's draft vocabulary and its d2t / t2d maps
    images.py          override_embeddings, shifted_overrides: the target's merged embeddings at image tokens in
                       a head's token embedding (EAGLE-3, EAGLE, P-EAGLE training and decoding)
    last_state.py      predicted_mask, TeacherLogits, head_loss, ...: heads on the last post-norm state (Medusa,
                       MLPSpeculator)
    last_state_proposer.py   LastStateProposer: their proposer base (the newest verified state per row)

The trainer is training/trainer.py, the evaluation training/evaluate.py.

Nothing is imported here: `import drafters` is cheap; import the module you need.
"""
