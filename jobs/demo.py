"""`hsx demo DIR`: the whole job on one machine with nothing downloaded.

    build_demo(dir) -> (model dir, corpus files)     a tiny random Llama + local tokenizer, a mixed-format corpus
    run_demo(dir)   -> exit code                      a real `hsx run` (local Ray, local output) + where things are;
                                                      verbose=True: Ray's and transformers' console output as well

The corpus mixes every record shape the job reads — plain prompts and OpenAI chats (JSONL), ShareGPT chats
(gzipped JSONL), pre-tokenized samples with a loss mask (Parquet) — plus two broken records, to show that bad input
becomes failed manifest rows instead of a failed job.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import random
from collections.abc import Iterator

from connectors.storage import open_url, put_atomic
from jobs.config import JobConfig
from reference.tiny_models import build_tiny_model, sample_text

DEMO_RECORDS = 48
DEMO_FILES = ("prompts_and_chats.jsonl", "sharegpt.jsonl.gz", "pretokenized.parquet")


def build_demo(root: str, verbose: bool = False) -> tuple[str, list[str]]:
    root = os.path.abspath(root)
    model = os.path.join(root, "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        with contextlib.nullcontext() if verbose else _no_transformers_bars():
            build_tiny_model("llama", model)
    corpus = os.path.join(root, "corpus")
    os.makedirs(corpus, exist_ok=True)
    files = [os.path.join(corpus, name) for name in DEMO_FILES]
    if not all(os.path.exists(f) for f in files):  # kept once written: a re-run finds the same job (jobs.plan)
        _write_corpus(*files)
    return model, files


def _write_corpus(prompts: str, sharegpt: str, tokens: str) -> None:
    """The demo's corpus files, each written whole or not at all (connectors.storage.put_atomic)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    text = sample_text(4 * DEMO_RECORDS, seed=7)
    n = DEMO_RECORDS // 4

    lines = [json.dumps({"id": f"prompt-{i}", "prompt": text[i]}) for i in range(n)]
    lines += [json.dumps({"id": f"openai-{i}", "messages": [
        {"role": "system", "content": "You are a helpful model."},
        {"role": "user", "content": text[n + i]},
        {"role": "assistant", "content": text[2 * n + i]}]}) for i in range(n)]
    lines.append('{"id": "broken-1", "prompt": ')                 # malformed JSON: a failed row, not a failed job
    lines.append(json.dumps({"id": "broken-2", "text": "no prompt field"}))
    _put(prompts, "".join(line + "\n" for line in lines).encode())

    chats = [json.dumps({"id": f"sharegpt-{i}", "conversations": [
        {"from": "human", "value": text[3 * n + i]}, {"from": "gpt", "value": text[i]},
        {"from": "human", "value": "Why?"}, {"from": "gpt", "value": text[n + i]}]}) for i in range(n)]
    _put(sharegpt, gzip.compress("".join(c + "\n" for c in chats).encode()))

    rows = []
    for i in range(n):
        ids = [rng.randrange(4, 500) for _ in range(rng.randint(8, 64))]
        cut = len(ids) // 2
        rows.append({"id": f"tokens-{i}", "input_ids": ids, "loss_mask": [0] * cut + [1] * (len(ids) - cut)})
    table = pa.Table.from_pylist(rows)
    _put(tokens, lambda f: pq.write_table(table, f))


def _put(path: str, content) -> None:
    fs, where = open_url(path)
    put_atomic(fs, where, content)


@contextlib.contextmanager
def _no_transformers_bars() -> Iterator[None]:
    """No "Writing model shards" bar from save_pretrained: the job's bar is the one to watch."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def demo_config(root: str, model: str, corpus: list[str], *, workers: int = 1, progress: bool = True,
                verbose: bool = False) -> JobConfig:
    """The job `hsx demo ROOT` runs (a re-run with the same settings is answered from its run.json: jobs.plan)."""
    return JobConfig(model=model, corpus=tuple(corpus), output=os.path.join(os.path.abspath(root), "output"),
                     workers=workers, progress=progress, tokens_per_task=2048, verbose=verbose)


def run_demo(root: str, workers: int = 1, progress: bool = True, verbose: bool = False) -> int:
    from jobs.pipeline import run_job  # pyarrow: the CLI's parser must stay cheap

    root = os.path.abspath(root)
    print(f"hsx demo: building a tiny model and a corpus in {root} (no downloads) ...", flush=True)
    model, corpus = build_demo(root, verbose=verbose)
    config = demo_config(root, model, corpus, workers=workers, progress=progress, verbose=verbose)
    output = config.output
    print(f"hsx demo: hsx run --model {model} --corpus {' '.join(corpus)} --output {output}", flush=True)
    result = run_job(config)  # a finished demo: answered from its run.json and manifest (jobs.plan)
    print("\n".join(result.lines()))
    from connectors.manifest import committed_rows, read_manifest  # pyarrow: the CLI's parser must stay cheap

    table = read_manifest(output)  # every row (failed ones too); committed_rows: each sample's committed "ok" row
    ok = committed_rows(table)
    example = os.path.join(output, ok["path"][0].as_py()) if ok.num_rows else None
    print("\nWhere things are:")
    print(f"  data files  {output}/data/<2 hex>/<16 hex of the id's sha256>-<readable id>.safetensors, one per sample"
          + (f"\n              e.g. {example}" if example else ""))
    print(f"  manifest    {output}/manifest/   ({table.num_rows} rows; pyarrow.parquet.read_table(...))")
    print(f"  run info    {output}/run.json")
    print(f"  status      hsx status {output}")
    if example:
        print("\nLoad one:\n  from connectors import load_hidden_states\n"
              f"  load_hidden_states({example!r})   # token_ids [T], hidden_states [T, L, H], loss_mask [T]")
    return 0
