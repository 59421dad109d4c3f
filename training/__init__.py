"""hsx training: feeding an extraction run to drafter training, training and measuring drafters, or rewriting a run
for another trainer.

    dataset.py     HiddenStatesDataset(output, ...), HiddenStatesDatasetConfig, read_run_info(output) -> RunSpec
    sampler.py     ShardSampler: each distributed rank a disjoint share, all ranks together every sample once
    collate.py     PadCollator, PackCollator: batches padded to the longest sample, or packed rows for varlen attention
    export/        export_run(output, dest, fmt): the run in speculators', SpecForge's or ModelOpt's on-disk layout
                   (`hsx export`), one module per layout
    train_config.py  TrainDrafterConfig: one training's settings in this process (training_jobs/config.py adds Ray's)
    checks.py      the checks before training: the target folder, the run, the layers --kind needs
    feed.py        CheckedFeed (every item checked), BatchSource (what a source of batches offers), RunBatches
    checkpoint.py  resumable checkpoints: atomic, durable writes, the resume checks, the sample-id log
    loop.py        Loop: the optimizer steps of one process or of one data-parallel replica (training_jobs/train.py starts
                   those): a step (forward, backward, finite guard) and its hooks (replica exchange, logging)
    trainer.py     Trainer(config, data, replicas).run() -> report: one `hsx train-drafter` session for any
                   registered family, whatever feeds it (a stored run here; jobs/: a live extraction, Ray Train)
    curves.py      Curves: the training's TensorBoard curves (a resumed training continues them)
    replicas.py    OneProcess / TorchDistributed: a replica's share of each global batch and its collectives
    evaluate.py    `hsx eval-drafter`: greedy speculative decoding per drafter, ngram and none: acceptance length,
                   tokens/s, losslessness against plain greedy decoding; on the engine --engine names (its kind's
                   speculative_engine, extractor.engines)
    eval_result.py EvalResult, SpecDecodeCounts, check_lossless: what an evaluation finds, per method
    acceptance.py  what `hsx eval-drafter --out DIR` writes: acceptance.csv per method in the layout drafter
                   benchmarks publish, summary.csv, the acceptance-per-position plot
    plot_text.py   text from data drawn as it is in hsx's plots (no mathtext, no TeX, "_" labels kept): here
                   and in `hsx report` (jobs/report.py)
    mtp_target.py         MergeMtpConfig, merge_mtp: `hsx merge-mtp`, a target folder with tuned MTP layers

Reads runs through `connectors.run` (the run format's one owner) and `connectors.format`. This package imports
connectors, extractor, drafters, reference (eval-drafter's default target), torch and transformers; never ray or jobs. The names below load lazily: `import training` is cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "HiddenStatesDataset": "training.dataset",
    "HiddenStatesDatasetConfig": "training.dataset",
    "read_run_info": "training.dataset",
    "FinalNorm": "extractor.norm",
    "ShardSampler": "training.sampler",
    "PadCollator": "training.collate",
    "PackCollator": "training.collate",
    "ExportConfig": "training.export",
    "ExportSummary": "training.export",
    "export_run": "training.export",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'training' has no attribute {name!r}")
