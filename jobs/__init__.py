"""hsx jobs: Ray batch jobs over prompt corpora, the manifest and exactly-once resume (their commands: cli/jobs.py).

The only package that knows both the engine (extractor) and the storage side (connectors); the Ray session is
cluster.session's. In pipeline order:

    config.py        JobConfig: every setting of a job, typed; the CLI and job files map onto it one to one
    model.py         ModelFacts: layers, dtype, sizes, length limit resolved from the model's config (no weights)
    corpus.py        corpus files -> records (any fsspec URL, globs; a reader per format); bad lines -> failed records
    corpus_jsonl.py  the JSONL reader (compressed, JSON arrays, broken streams)
    corpus_parquet.py the Parquet reader (row batches, non-UTF-8 cells)
    corpus_regenerated.py the regenerated corpus (`hsx regenerate`'s OUTPUT), its one owner: regenerate.json, the
                     part writer, orphans; read as records: committed ones only, through its manifest
    records.py       CorpusFile, Record, sample ids and the text rules every reader applies
    sample_registry.py SampleRegistry actors: skip committed ids, fail duplicate ids
    chat.py          chat records -> ids + assistant loss mask, for any chat template
    tokenization.py  records -> token ids + loss mask (the CPU stage)
    worker.py        ExtractionWorker: one engine per Ray actor; samples -> files -> manifest rows
    runinfo.py       the job's RunSpec (run.json; the format is connectors.run's): written once, checked on resume
    manifest.py      ManifestWriter (buffered atomic parts), summaries for `hsx status`
    verify_config.py VerifyConfig: `hsx verify`'s settings (the parser builds without pyarrow or torch)
    verify.py        `hsx verify`: files against the manifest, recompute with transformers, mark bad samples
    report_config.py ReportConfig: `hsx report`'s settings
    report.py        `hsx report`: one HTML page of plots from the manifest and sampled files, and the checks they fail
    report_figures.py  the report page's figures, drawn from its numbers
    pipeline.py      prepare_job / execute_job: the Ray Data pipeline and the driver loop
    progress.py      progress bar and end-of-job summary
    estimate.py      `hsx estimate`: exact file sizes before a run
    device_fit.py    what the target needs of a device (weights, cache, activations) and the smallest tensor-parallel
                     size that fits one (`hsx estimate --device-memory`)
    submit.py        `hsx submit`: Ray's job submission API
    train_config.py  TrainJobConfig: `hsx train-drafter`'s settings, the trainer's (training) and Ray's
    train.py         train_drafter: in this process, or (--workers N) the trainer's data-parallel replicas on Ray Train
    live.py          `hsx train-drafter --online`: a drafter trained from a live extraction, nothing stored
    fanout.py        `hsx train-drafter --online --fanout`: several drafters trained from one live extraction
    regenerate.py    `hsx regenerate` (and `hsx run --regenerate-with`): the target's answers from OpenAI-compatible
                     servers as a new corpus, exactly once
    regenerate_config.py RegenerateConfig: `hsx regenerate`'s settings, the pool's and regenerate.json's share
    regenerator.py   one record regenerated through the pool: turn replay, the record assembled, its Outcome
    answers.py       a server's answer: read bounded, parsed into a Turn, its ids checked against its text
    server_pool.py   the OpenAI-server pool hsx regenerate sends requests to: slots, set-aside, back-off, retries
    demo.py          `hsx demo`: tiny model + corpus + a real run, no downloads
    tiny_models.py   small random models + a locally trained tokenizer: the demo's, the tests' and the benchmarks'
"""
