"""hsx regeneration: `hsx regenerate` (and `hsx run --regenerate-with`) — the target's own answers from the
OpenAI-compatible servers users already run, written exactly once as a new corpus (corpus/regenerated.py).

    config.py          RegenerateConfig: `hsx regenerate`'s settings, the pool's and regenerate.json's share
    regenerate.py      prepare_regeneration / execute_regeneration: the job, its resume and its parts
    regenerator.py     one record regenerated through the pool: turn replay, the record assembled, its Outcome
    answers.py         a server's answer: read bounded, parsed into a Turn, its ids checked against its text
    server_pool.py     the server pool: slots, set-aside, back-off, retries

Imports corpus, cluster (the progress bar), extractor and connectors; never torch models or Ray.
"""
