"""hsx jobs: extraction jobs over corpora on Ray — plan, workers, the manifest's rows, resume, and what reads a finished
run back (verify, report, status); their commands are cli/jobs.py.

The only package that knows both the engine (extractor) and the storage side (connectors); the corpus it reads is
corpus/'s, the regeneration it may run first regeneration/'s, the Ray session cluster.session's. In pipeline order:

    config.py        JobConfig: every setting of a job, typed; the CLI and job files map onto it one to one;
                     --engine's kind and settings (extractor.engines' registry)
    model.py         ModelFacts: layers, dtype, sizes, length limit resolved from the model's config (no weights)
    plan.py          prepare_job -> JobPlan: everything decided before Ray starts (facts, run.json, resume set); a
                     finished run's re-run answered from run.json's plan key, no model loaded
    worker.py        ExtractionWorker: one engine per Ray actor, built by its kind; samples -> files -> manifest rows
    runinfo.py       the job's RunSpec (run.json; the format is connectors.run's): written once, checked on resume
    pipeline.py      execute_job / run_job: the Ray Data pipeline and the driver loop
    estimate.py      `hsx estimate`: exact file sizes before a run
    device_fit.py    what the target needs of a device (weights, cache, activations) and the smallest tensor-parallel
                     size that fits one (`hsx estimate --device-memory`)
    submit.py        `hsx submit`: Ray's job submission API
    verify_config.py VerifyConfig: `hsx verify`'s settings (the parser builds without pyarrow or torch)
    verify.py        `hsx verify`: files against the manifest, recompute with transformers, mark bad samples
    report_config.py ReportConfig: `hsx report`'s settings
    report.py        `hsx report`: one HTML page of plots from the manifest and sampled files, and the checks they fail
    report_figures.py  the report page's figures, drawn from its numbers
    demo.py          `hsx demo`: a tiny model (reference/) + corpus + a real run, no downloads
"""
