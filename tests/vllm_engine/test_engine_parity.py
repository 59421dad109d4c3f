"""`hsx run --engine vllm` (vllm_engine/engine.py on Ray workers) against `--engine hsx` on the same corpus: the same
token ids and states (float32, 1e-5 relative to the largest state), prompt-only and with generated tokens (greedy),
tensor parallel 2 equal to 1, layers stored in the order asked (vLLM captures them sorted), files read by vLLM's own
`load_hidden_states` and by `hsx verify --all`; a worker killed mid-job leaves every sample exactly once.

Each `hsx run` is a subprocess with a local Ray of its own, as a user runs it. Needs vLLM (the venv docs/engines.md
builds); without it these tests skip."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: these tests run in the venv docs/engines.md builds")

from harness.corpora import word_corpus, write_jsonl  # noqa: E402
from tests.jobs.test_job import assert_exactly_once  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

LAYERS = "2,1,4"  # not ascending: vLLM captures [1, 2, 4]; the files must keep 2, 1, 4
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    """A 4-layer Llama of head_dim 32 (vLLM's CPU attention has no kernel for 16)."""
    return tiny_model_factory("llama", num_attention_heads=2, num_key_value_heads=2)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Eight prompts of different lengths, and their ids."""
    folder = tmp_path_factory.mktemp("corpus")
    records = [{"id": f"p{i}", "prompt": f"def f{i}(x):\n    return x * {i} + " + "word " * (3 * i + 2)}
               for i in range(8)]
    return write_jsonl(folder / "c.jsonl", records), {r["id"] for r in records}


def hsx_run(model, corpus, output, *extra, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "cli", "run", "--model", model, "--corpus", corpus, "--output", output,
                           "--dtype", "float32", "--max-model-len", "256", "--layers", LAYERS, "--no-progress", *extra],
                          capture_output=True, text=True, env=ENV, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert " 0 failed" in proc.stdout, proc.stdout
    return proc.stdout


def run_files(output, ids) -> dict[str, str]:
    """sample id -> its file, once each (assert_exactly_once)."""
    from connectors.run import RunDir

    run = RunDir(output)
    return {sid: run.url_of(row["path"]) for sid, row in assert_exactly_once(output, ids).items()}


@pytest.fixture(scope="module")
def runs(model, corpus, tmp_path_factory):
    """{(engine, kind): {sample id: file}} for prompt-only ("prompt") and greedy generation with the generated
    tokens' states ("gen"); vLLM's prompt-only run with tensor parallel 2, its generation run with 1."""
    path, ids = corpus
    root = tmp_path_factory.mktemp("runs")
    gen = ["--max-tokens", "6", "--include-output-tokens"]
    settings = {("hsx", "prompt"): [], ("vllm-tp2", "prompt"): ["--engine", "vllm", "--tensor-parallel-size", "2"],
                ("hsx", "gen"): gen, ("vllm", "gen"): ["--engine", "vllm", *gen],
                ("vllm", "prompt"): ["--engine", "vllm"]}
    out = {}
    for (engine, kind), extra in settings.items():
        output = str(root / f"{engine}-{kind}")
        hsx_run(model, path, output, *extra)
        out[(engine, kind)] = run_files(output, ids)
    return out


def _assert_same(theirs: dict[str, str], ours: dict[str, str]) -> None:
    import torch

    from connectors import load_hidden_states

    assert theirs.keys() == ours.keys()
    for sid in ours:
        a, b = load_hidden_states(ours[sid]), load_hidden_states(theirs[sid])
        assert torch.equal(a["token_ids"], b["token_ids"]), sid
        scale = a["hidden_states"].abs().max()
        err = (a["hidden_states"] - b["hidden_states"]).abs().max() / scale
        assert err < 1e-5, f"{sid}: states differ by {err:.2e} of the largest"


@pytest.mark.timeout(1800)  # the runs fixture: five whole jobs, three of them starting vLLM
def test_vllm_and_hsx_store_the_same_tokens_and_states_prompt_only_and_with_generated_tokens(runs, model):
    """Prompt-only (TP 1 and 2) and greedy generation with include_output_tokens: same ids, same states; and the
    stored states are a plain transformers forward's (the independent oracle), in the order --layers lists them."""
    import torch

    from connectors import load_hidden_states, read_hidden_states_info
    from tests.extractor.oracle import load_reference, reference_states

    _assert_same(runs[("vllm", "prompt")], runs[("hsx", "prompt")])
    _assert_same(runs[("vllm-tp2", "prompt")], runs[("vllm", "prompt")])
    _assert_same(runs[("vllm", "gen")], runs[("hsx", "gen")])
    ref = load_reference(model)
    for sid, path in runs[("vllm", "gen")].items():
        obj = load_hidden_states(path)
        assert obj["token_ids"].shape[0] > len(load_hidden_states(runs[("vllm", "prompt")][sid])["token_ids"])
        torch.testing.assert_close(obj["hidden_states"], reference_states(ref, obj["token_ids"].tolist(), (2, 1, 4)),
                                   rtol=1e-4, atol=1e-4)
        info = read_hidden_states_info(path)
        assert tuple(info.spec.layer_ids) == (2, 1, 4) and info.metadata.get("engine") == "vllm"


@pytest.mark.timeout(1800)  # the runs fixture: five whole jobs, three of them starting vLLM
def test_vllms_own_loader_and_hsx_verify_read_the_vllm_runs_files(runs):
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states as vllm_load,
    )

    from connectors import load_hidden_states

    files = runs[("vllm-tp2", "prompt")]
    for path in files.values():
        theirs, ours = vllm_load(path), load_hidden_states(path)
        assert torch.equal(theirs["hidden_states"], ours["hidden_states"])
        assert torch.equal(theirs["token_ids"], ours["token_ids"])
    output = os.path.dirname(os.path.dirname(os.path.dirname(next(iter(files.values())))))
    proc = subprocess.run([sys.executable, "-m", "cli", "verify", output, "--all"], capture_output=True, text=True,
                          env=ENV, timeout=300)
    assert proc.returncode == 0 and f"checked {len(files)} of {len(files)}" in proc.stdout and " 0 failed" in \
        proc.stdout, proc.stdout + proc.stderr


WORKER = "ExtractionWorker"


def _worker_pids() -> list[int]:
    """Processes of extraction-worker actors (Ray names their process after the actor class)."""
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if WORKER.encode() in f.read() and int(pid) != os.getpid():
                        pids.append(int(pid))
            except OSError:
                pass
    return pids


def test_a_vllm_worker_killed_mid_job_leaves_every_sample_exactly_once(model, tmp_path):
    """kill -9 of the worker that holds the vLLM engine once rows are committed: Ray restarts it (a new engine),
    its blocks run again, the job ends by itself with every sample once and nothing failed."""
    from connectors.manifest import read_manifest

    corpus, ids = word_corpus(tmp_path, 48)
    output = str(tmp_path / "out")
    proc = subprocess.Popen([sys.executable, "-m", "cli", "run", "--model", model, "--corpus", corpus, "--output",
                             output, "--engine", "vllm", "--dtype", "float32", "--max-model-len", "256",
                             "--tokens-per-task", "64", "--manifest-flush-rows", "4", "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 400
        while not (os.path.isdir(os.path.join(output, "manifest")) and
                   read_manifest(output, ["status"]).num_rows >= 4):
            assert proc.poll() is None, f"the job ended first: {proc.returncode}\n{proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no rows committed"
            time.sleep(0.2)
        at_kill = read_manifest(output, ["status"]).num_rows
        assert at_kill < len(ids), "the job finished before the kill"
        pids = _worker_pids()
        assert pids, "no extraction worker process found"
        os.kill(pids[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-2000:] + err[-4000:]
    assert " 0 failed" in out, out
    assert_exactly_once(output, ids)


def test_online_training_extracts_through_vllm(model, corpus, tmp_path):
    """`hsx train-drafter --online --extract '{"engine": "vllm", ...}'`: the stream's workers hold vLLM engines (their
    files pass through a local folder of the worker, vLLM writing from its own processes), the trainer trains on them,
    the first pass stored by --cache is vLLM's (its files say so), and nothing is left in the temp folder."""
    import json
    import tempfile

    path, ids = corpus
    out = tmp_path / "online"
    before = set(os.listdir(tempfile.gettempdir()))
    extract = {"engine": "vllm", "layers": "1,2,4", "dtype": "float32", "max_model_len": 256}
    proc = subprocess.run([sys.executable, "-m", "cli", "train-drafter", "--online", "--model", model, "--corpus", path,
                           "--out", str(out), "--extract", json.dumps(extract), "--cache", str(tmp_path / "cache"), "--steps", "2", "--batch-tokens", "64",
                           "--draft-vocab-size", "48", "--device", "cpu", "--no-progress"],
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "trained eagle3 for 2 steps" in proc.stdout, proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["online"]["extracted"] > 0 and report["online"].get("failed", 0) == 0, report["online"]
    assert not {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("hsx")}
    from connectors import read_hidden_states_info

    cached = run_files(str(tmp_path / "cache"), ids)
    assert {read_hidden_states_info(p).metadata.get("engine") for p in cached.values()} == {"vllm"}
