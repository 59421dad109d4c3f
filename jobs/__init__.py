"""hsx jobs: Ray batch jobs over prompt corpora, the manifest and exactly-once resume, the `hsx` CLI.

The only package that knows both the engine (extractor) and the storage side (connectors). In pipeline order:

    config.py        JobConfig: every setting of a job, typed; the CLI and job files map onto it one to one
    model.py         ModelFacts: layers, dtype, sizes, length limit resolved from the model's config (no weights)
    corpus.py        corpus files -> records (JSONL / Parquet, any fsspec URL, globs); bad lines -> failed records
    registry.py      SampleRegistry actor: skip committed ids, fail duplicate ids
    chat.py          chat records -> ids + assistant loss mask, for any chat template
    tokenization.py  records -> token ids + loss mask (the CPU stage)
    worker.py        ExtractionWorker: one engine per Ray actor; samples -> files -> manifest rows
    layout.py        OUTPUT layout (run.json, data/<shard>/, manifest/) and atomic small writes
    runinfo.py       run.json: written once, checked on every resume
    manifest.py      the Parquet manifest: atomic parts, committed ids, summaries
    pipeline.py      prepare_job / execute_job: the Ray Data pipeline and the driver loop
    progress.py      progress bar and end-of-job summary
    estimate.py      `hsx estimate`: exact file sizes before a run
    submit.py        `hsx submit`: Ray's job submission API
    demo.py          `hsx demo`: tiny model + corpus + a real run, no downloads
    cli.py           the `hsx` command
    export.py        `hsx export`: rewrite a run for another trainer's layout
"""
