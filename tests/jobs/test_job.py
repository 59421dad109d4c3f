"""End-to-end jobs on the session's local Ray: real engine, real files, checked against a transformers oracle;
bad input, S3, the job-submission API (faults — a worker or node lost, the storage down, the driver killed — are in
test_faults.py)."""

from __future__ import annotations

import glob
import json
import os
import posixpath
import re
import subprocess
import sys
from typing import NamedTuple

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from cli.args import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from cli.main import main
from connectors import load_hidden_states, read_hidden_states_info
from connectors.manifest import committed_ids, read_manifest
from connectors.run import RunDir
from harness.corpora import write_jsonl, write_jsonl_gz, write_parquet
from jobs.config import JobConfig
from jobs.estimate import estimate
from jobs.pipeline import run_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _manifest(output: str, storage_options: dict | None = None):
    return read_manifest(output, storage_options=storage_options)


def _ok_rows(output: str, storage_options: dict | None = None) -> dict[str, dict]:
    table = _manifest(output, storage_options)
    ok = table.filter(pc.equal(table["status"], "ok")).to_pylist()
    by_id = {r["sample_id"]: r for r in ok}
    assert len(by_id) == len(ok), "a sample has more than one ok row"
    return by_id


def assert_exactly_once(output: str, expected_ids: set[str], storage_options: dict | None = None) -> dict[str, dict]:
    """One ok row per expected sample; each points at a complete, loadable file of that sample (or, --layout
    sharded, at that sample's own byte range of a shard, ranges of a shard never overlapping); no other visible data
    files or shards remain (orphans of killed runs were overwritten or removed). `output`: a folder or a URL."""
    run = RunDir(output, storage_options or {})
    rows = _ok_rows(output, storage_options)
    assert set(rows) == expected_ids
    for sid, row in rows.items():
        url = run.url_of(row["path"])
        where = None if row.get("offset") is None else (row["offset"], row["bytes"])
        obj = load_hidden_states(url, storage_options=storage_options, byte_range=where)
        assert obj["token_ids"].shape[0] == row["num_tokens"] == obj["hidden_states"].shape[0]
        info = read_hidden_states_info(url, storage_options=storage_options, byte_range=where)
        assert info.size == row["bytes"] and info.metadata["sample_id"] == sid
    spans: dict[str, list[tuple[int, int]]] = {}
    for row in rows.values():
        if row.get("offset") is not None:
            spans.setdefault(row["path"], []).append((row["offset"], row["offset"] + row["bytes"]))
    for shard, ranges in spans.items():
        ranges.sort()
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), f"samples of {shard} overlap"
        assert run.fs.size(run.path(shard)) == ranges[-1][1], f"{shard} is not as long as its last sample's end"
    run.fs.invalidate_cache()
    files = {posixpath.relpath(p, run.root) for folder in ("data", "shards") if run.exists(folder)
             for p in run.fs.find(run.path(folder)) if p.endswith((".safetensors", ".hsxshard"))}
    assert files == {r["path"] for r in rows.values()}
    return rows


# -- the README command: hsx demo -----------------------------------------------------------------------------------
class Demo(NamedTuple):
    root: str
    code: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def demo(ray_cluster, tmp_path_factory) -> Demo:
    """`hsx demo ROOT` as a user runs it: a process of its own on a local Ray of its own, started with Ray's
    defaults (token auth as Ray sets it up, in a HOME of its own), the progress bar on."""
    root = str(tmp_path_factory.mktemp("demo"))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["HOME"] = str(tmp_path_factory.mktemp("home"))
    proc = subprocess.run([sys.executable, "-m", "cli", "demo", root], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    return Demo(root, proc.returncode, proc.stdout, proc.stderr)


RAY_LINE = re.compile(r"\w\.py:\d+ -- |\w\.cc:\d+:|\bpid=\d+|\(raylet\)|Started a local Ray|Token authentication|"
                      r"[Dd]ashboard|Registered dataset logger|Executing DAG|Loading weights|Writing model shards")
"""Ray's console lines: its log formats (Python's "LEVEL file.py:N --", its C++ core's "file.cc:N:"), its workers'
output with their "(Actor pid=N)" prefix, its notices, and the bars of transformers in its workers."""


def test_demo_console_shows_one_progress_bar_and_hsx_lines_alone(demo):
    assert demo.code == EXIT_OK, demo.stderr[-3000:]
    lines = [line for text in (demo.stdout, demo.stderr) for line in re.split(r"[\r\n]+", text) if line.strip()]
    assert [line for line in lines if RAY_LINE.search(line)] == []
    others = [line for line in re.split(r"[\r\n]+", demo.stderr) if line.strip()
              and not line.startswith("extracting: ")  # the bar, redrawn
              and not re.match(r"[\d-]+ [\d:,]+ \w+ (jobs|connectors|extractor|cli)\.", line)]  # hsx's logging
    assert others == []
    assert "hsx run finished in" in demo.stdout and ": 48 ok, 2 failed" in demo.stdout
    assert "Where things are:" in demo.stdout


def _demo_args(root: str) -> list[str]:
    corpus = sorted(glob.glob(os.path.join(root, "corpus", "*")))
    return ["--model", os.path.join(root, "model"), "--corpus", *corpus, "--output", os.path.join(root, "output")]


def test_demo_files_match_a_transformers_forward_and_the_records(demo, oracle_factory):
    root = demo.root
    assert demo.code == EXIT_OK, demo.stderr[-3000:]
    output = os.path.join(root, "output")
    rows = assert_exactly_once(output, {f"{kind}-{i}" for kind in ("prompt", "openai", "sharegpt", "tokens")
                                        for i in range(12)})
    run = json.load(open(os.path.join(output, "run.json")))
    layers = run["layer_ids"]
    assert run["layer_id_convention"] == "vllm" and run["last_layer_normalized"] is False
    oracle = oracle_factory(os.path.join(root, "model"))
    tok = oracle.tokenizer
    records = {}
    for path in glob.glob(os.path.join(root, "corpus", "*.jsonl*")):
        import gzip

        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                records[r.get("id")] = r
    for r in pq.read_table(os.path.join(root, "corpus", "pretokenized.parquet")).to_pylist():
        records[r["id"]] = r
    for sid, row in rows.items():
        rec = records[sid]
        if "prompt" in rec:
            ids = tok(rec["prompt"]).input_ids
            mask = [1] * len(ids)
        elif "input_ids" in rec:
            ids, mask = rec["input_ids"], rec["loss_mask"]
        else:
            msgs = rec.get("messages") or [{"role": {"human": "user", "gpt": "assistant"}[t["from"]],
                                            "content": t["value"]} for t in rec["conversations"]]
            ref = tok.apply_chat_template(msgs, return_assistant_tokens_mask=True, return_dict=True)
            ids, mask = list(ref["input_ids"]), list(ref["assistant_masks"])
            assert sum(mask) > 0
        obj = load_hidden_states(os.path.join(output, row["path"]))
        assert obj["token_ids"].tolist() == list(ids), sid
        assert obj["loss_mask"].tolist() == list(mask), sid
        assert row["num_prompt_tokens"] == len(ids)
        expected = oracle.states(ids, layers)
        torch.testing.assert_close(obj["hidden_states"], expected, atol=1e-4, rtol=1e-4)


def test_demo_reports_its_broken_records_as_failed_rows(demo):
    root = demo.root
    table = _manifest(os.path.join(root, "output"))
    failed = {r["sample_id"]: r["error"] for r in table.filter(pc.equal(table["status"], "failed")).to_pylist()}
    assert len(failed) == 2
    assert any("malformed JSON" in e and "prompts_and_chats.jsonl:" in e for e in failed.values())
    assert "none of the fields" in failed["broken-2"]


def test_estimate_is_within_one_percent_of_the_written_bytes(demo):
    root = demo.root
    corpus = tuple(sorted(glob.glob(os.path.join(root, "corpus", "*"))))
    est = estimate(JobConfig(model=os.path.join(root, "model"), corpus=corpus))
    rows = _ok_rows(os.path.join(root, "output"))
    real = sum(r["bytes"] for r in rows.values())
    assert est.samples == len(rows) and est.failed == 2
    assert est.tokens == sum(r["num_tokens"] for r in rows.values())
    assert abs(est.bytes - real) <= 0.01 * real
    assert est.bytes == real  # in practice: to the byte


def test_status_reports_counts_from_the_manifest(demo, capsys):
    root = demo.root
    capsys.readouterr()
    assert main(["status", os.path.join(root, "output"), "--json"]) == EXIT_OK
    status = json.loads(capsys.readouterr().out)
    assert (status["ok"], status["failed"], status["duplicate_ok_rows"]) == (48, 2, 0)
    assert status["run"]["model"] == os.path.join(root, "model")


def test_rerunning_the_same_command_skips_committed_samples(demo, capsys):
    root = demo.root
    output = os.path.join(root, "output")
    before = _manifest(output).num_rows
    # the two broken records fail the same way every time: a re-run finds nothing to do (without starting Ray)
    assert main(["run", *_demo_args(root), "--no-progress"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "0 ok, 0 failed, 50 skipped" in out and _manifest(output).num_rows == before
    assert main(["status", output]) == EXIT_OK
    assert "2 failed the same way every time: re-runs skip them" in capsys.readouterr().out
    assert main(["run", *_demo_args(root), "--retry-failed", "--no-progress"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "0 ok, 2 failed, 48 skipped" in out
    table = _manifest(output)
    assert table.num_rows == before + 2  # only the two broken records were retried
    assert_exactly_once(output, set(_ok_rows(output)))
    # the job ended by merging its parts (every row kept); `hsx compact` then has nothing to do
    from connectors.manifest import live_manifest_parts

    assert len(live_manifest_parts(output)) == 1
    assert main(["compact", output]) == EXIT_OK
    assert "nothing to merge" in capsys.readouterr().out


def test_rerunning_the_finished_demo_loads_no_model_torch_or_ray_and_a_changed_model_is_checked_in_full(demo):
    """The re-run of a finished job is answered from run.json's plan key and the manifest (the 2-second goal:
    benchmarks/bench_cli_startup.py times it); once the model folder changes, the full planning runs again."""
    root = demo.root
    assert demo.code == EXIT_OK, demo.stderr[-3000:]
    script = ("import json, runpy, sys\n"
              f"sys.argv = ['hsx', 'demo', {root!r}]\n"
              "try:\n    runpy.run_module('cli', run_name='__main__')\nexcept SystemExit as e:\n    code = e.code\n"
              "print(json.dumps({'code': code, 'loaded': sorted(m for m in ('torch', 'transformers', 'ray') "
              "if m in sys.modules)}))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer == {"code": 0, "loaded": []}, proc.stdout[-2000:]
    assert "0 ok, 0 failed, 50 skipped" in proc.stdout

    from jobs.demo import build_demo, demo_config
    from jobs.plan import finished_result, prepare_job

    config = demo_config(root, *build_demo(root))
    plan = prepare_job(config)
    finished_result(plan)  # gives the lease back
    assert plan.nothing_left and plan.facts is None  # the key matched: no model read
    config_json = os.path.join(root, "model", "config.json")
    st = os.stat(config_json)
    os.utime(config_json, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    plan = prepare_job(config)
    finished_result(plan)
    assert plan.nothing_left and plan.facts is not None  # the model folder changed: planned (and checked) in full


def test_resume_with_other_layers_or_dtype_is_refused(demo, capsys):
    root = demo.root
    for extra, named in ((["--layers", "1,2"], "--layers"), (["--dtype", "bfloat16"], "--dtype")):
        with pytest.raises(SystemExit) as e:
            main(["run", *_demo_args(root), *extra])
        assert e.value.code == EXIT_USAGE
        err = capsys.readouterr().err
        assert "cannot resume" in err and named in err


# -- failure isolation -----------------------------------------------------------------------------------------------
RAISING_TEMPLATE = ("{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('conversations must start with "
                    "the user') }}{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                    "<|im_end|>\n{% endfor %}")


def test_bad_records_each_become_a_failed_row_and_good_ones_are_done(ray_cluster, tiny_llama, tmp_path, capsys):
    good = [{"id": f"good-{i}", "prompt": f"The quick model number {i} jumps."} for i in range(6)]
    bad = [
        {"id": "empty", "prompt": ""},
        {"id": "no-fields", "text": "hello"},
        {"id": "not-a-string", "prompt": ["a"]},
        {"id": "too-long", "prompt": "the cat " * 80},
        {"id": "mask-mismatch", "input_ids": [5, 6, 7], "loss_mask": [1]},
        {"id": "out-of-vocab", "input_ids": [5, 10_000_000]},
        {"id": "template-error", "messages": [{"role": "assistant", "content": "hi"}]},
        {"id": "unknown-role", "conversations": [{"from": "alien", "value": "hi"}]},
        {"id": "good-0", "prompt": "a second record with an existing id"},
    ]
    corpus = write_jsonl(tmp_path / "mixed.jsonl", good + bad, raw_lines=[b'{"id": "broken", ', b'{"id": "bytes", '
                                                                          b'"prompt": "caf\xe9"}'])
    template = tmp_path / "template.jinja"
    template.write_text(RAISING_TEMPLATE)
    output = str(tmp_path / "out")
    argv = ["run", "--model", tiny_llama, "--corpus", corpus, "--output", output, "--chat-template", str(template),
            "--max-model-len", "64", "--overlength", "skip", "--no-progress"]
    assert main(argv) == EXIT_OK
    summary = capsys.readouterr().out
    assert "6 ok, 11 failed" in summary
    table = _manifest(output)
    failed = table.filter(pc.equal(table["status"], "failed")).to_pylist()
    by_source_line = {int(r["source"].rsplit(":", 1)[1]): r["error"] for r in failed}
    expect = {7: "empty sample", 8: "none of the fields", 9: "must be a string", 10: "over-length",
              11: "1 values for 3", 12: "outside the vocabulary", 13: "conversations must start with the user",
              14: "unknown role", 15: "duplicate sample id 'good-0'", 16: "malformed JSON", 17: "not valid UTF-8"}
    assert set(by_source_line) == set(expect)
    for line, needle in expect.items():
        assert needle in by_source_line[line], (line, by_source_line[line])
        assert f"mixed.jsonl:{line}" in by_source_line[line]
    assert_exactly_once(output, {f"good-{i}" for i in range(6)})
    # with --fail-on-error the same failures exit 1 (the good samples are skipped, the bad ones fail again)
    assert main(argv + ["--fail-on-error"]) == EXIT_FAILED


# -- storage dtypes --------------------------------------------------------------------------------------------------
def test_an_fp8_run_records_its_storage_dtype_and_reads_back_within_fp8_error(ray_cluster, tiny_llama, tmp_path,
                                                                              oracle_factory, capsys):
    from connectors.format import HIDDEN_STATES_SCALES
    from connectors.quant import FP8_RELATIVE_ERROR
    from training import HiddenStatesDataset

    records = [{"id": f"s{i}", "prompt": f"Sample {i} of the storage test, with a few more words in it."}
               for i in range(5)]
    corpus = write_jsonl(tmp_path / "c.jsonl", records)
    runs = {}
    for storage in ("fp8", "model"):
        runs[storage] = str(tmp_path / storage)
        argv = ["run", "--model", tiny_llama, "--corpus", corpus, "--output", runs[storage], "--layers", "0,2,4",
                "--storage-dtype", storage, "--no-progress"]
        assert main(argv) == EXIT_OK
    capsys.readouterr()
    run = json.load(open(os.path.join(runs["fp8"], "run.json")))
    assert run["storage_dtype"] == "float8_e4m3fn" and run["dtype"] == "float32"
    assert "storage_dtype" not in json.load(open(os.path.join(runs["model"], "run.json")))
    oracle = oracle_factory(tiny_llama)
    rows = assert_exactly_once(runs["fp8"], {f"s{i}" for i in range(5)})
    for row in rows.values():
        path = os.path.join(runs["fp8"], row["path"])
        info = read_hidden_states_info(path)
        assert info.dtype == torch.float8_e4m3fn and HIDDEN_STATES_SCALES in info.tensors
        got = load_hidden_states(path, verify=True)
        expected = oracle.states(got["token_ids"].tolist(), [0, 2, 4])  # [T, 3, H] float32
        assert got["hidden_states"].dtype == torch.float32
        err = (got["hidden_states"] - expected).abs() / expected.abs().amax(dim=-1, keepdim=True)
        assert float(err.max()) <= FP8_RELATIVE_ERROR + 1e-5
    ds = HiddenStatesDataset(runs["fp8"])
    assert ds[0]["hidden_states"].dtype == torch.float32 and len(ds) == 5
    with pytest.raises(ValueError, match="storage_dtype"):  # a run of another storage dtype never mixes in
        HiddenStatesDataset([runs["fp8"], runs["model"]])
    assert main(["verify", runs["fp8"], "--recompute", "2", "--no-mark"]) == EXIT_OK  # within fp8's own error
    with pytest.raises(SystemExit) as e:  # resuming with another storage dtype would mix files
        main(["run", "--model", tiny_llama, "--corpus", corpus, "--output", runs["fp8"], "--layers", "0,2,4",
              "--no-progress"])
    assert e.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "cannot resume" in err and "--storage-dtype" in err


def test_a_topk_target_run_stores_the_aux_layers_and_the_models_top_k_and_resumes_only_with_the_same_target(
        ray_cluster, tiny_llama, tmp_path, oracle_factory, capsys):
    from transformers import AutoModelForCausalLM

    from connectors.format import TARGET_TOPK_IDS, TARGET_TOPK_LOGPROBS
    from jobs.config import JobConfig
    from jobs.estimate import estimate

    records = [{"id": f"s{i}", "prompt": f"Sample {i} of the top-k test: " + "more words " * (3 * i)} for i in range(5)]
    corpus = write_jsonl(tmp_path / "c.jsonl", records)
    output = str(tmp_path / "topk")
    argv = ["run", "--model", tiny_llama, "--corpus", corpus, "--output", output, "--layers", "0,2,4",
            "--storage-dtype", "fp8", "--target", "top_k:16", "--max-num-batched-tokens", "16", "--no-progress"]
    est = estimate(JobConfig(model=tiny_llama, corpus=(corpus,), layers=(0, 2, 4), storage_dtype="fp8",
                             target="top_k:16"))
    assert main(argv) == EXIT_OK
    run = json.load(open(os.path.join(output, "run.json")))
    assert (run["target"], run["layer_ids"], run["storage_dtype"]) == ("top_k:16", [0, 2], "float8_e4m3fn")
    rows = assert_exactly_once(output, {f"s{i}" for i in range(5)})
    assert est.bytes == sum(r["bytes"] for r in rows.values())  # estimate sizes the top-k tensors exactly
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    oracle = oracle_factory(tiny_llama)
    for row in rows.values():
        got = load_hidden_states(os.path.join(output, row["path"]), verify=True)
        with torch.no_grad():
            top = model(got["token_ids"][None]).logits[0].float().log_softmax(-1).topk(16)
        torch.testing.assert_close(got[TARGET_TOPK_LOGPROBS], top.values, rtol=1e-4, atol=1e-4)
        assert (got[TARGET_TOPK_IDS].long() == top.indices).float().mean() > 0.99
        expected = oracle.states(got["token_ids"].tolist(), [0, 2])
        assert float((got["hidden_states"] - expected).norm() / expected.norm()) < 0.04
    assert main(["verify", output, "--recompute", "2", "--no-mark"]) == EXIT_OK  # the top-K recomputed too
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # resuming with the states target would mix files
        main([*argv[:-5], "--max-num-batched-tokens", "16", "--no-progress"])
    assert e.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "cannot resume" in err and "--target" in err


def test_planted_nan_inf_and_zero_states_fail_by_default_and_a_resume_with_on_nonfinite_skip_skips_them_for_good(
        ray_cluster, tiny_llama, tmp_path, capsys):
    """The model itself produces the bad states (as an overflow or a broken checkpoint would): token 7's embedding
    row is NaN, token 8's Inf, tokens 9's and 10's zero: a sample of those two has an all-zero embedding layer. By
    default each is a failed row (retried by a resume); a resume with --on-nonfinite skip retries them and records
    each as a "skipped" row with its reason, final: not a failure for --fail-on-error, counted apart by hsx status,
    and never extracted again, whatever a later resume's policy."""
    import shutil

    from transformers import AutoModelForCausalLM

    model_dir = str(tmp_path / "model")
    shutil.copytree(tiny_llama, model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[7], emb[8], emb[9], emb[10] = float("nan"), float("inf"), 0.0, 0.0
    model.save_pretrained(model_dir)
    good = [{"id": f"good-{i}", "input_ids": [20 + i, 30, 40 + i, 50, 60]} for i in range(4)]
    # (the bad token leads: a NaN in attention's values reaches the earlier tokens too, 0 * NaN being NaN)
    bad = [{"id": "nan", "input_ids": [7, 20, 21, 22, 23]}, {"id": "inf", "input_ids": [8, 20, 21]},
           {"id": "zeros", "input_ids": [9, 10, 9, 10]}]
    corpus = write_jsonl(tmp_path / "c.jsonl", good + bad)
    output = str(tmp_path / "out")
    argv = ["run", "--model", model_dir, "--corpus", corpus, "--output", output, "--layers", "0,2,4", "--no-progress"]
    assert main(argv) == EXIT_OK
    assert "4 ok, 3 failed" in capsys.readouterr().out
    table = _manifest(output)
    failed = {r["sample_id"]: r["error"] for r in table.filter(pc.equal(table["status"], "failed")).to_pylist()}
    assert set(failed) == {"nan", "inf", "zeros"}
    reasons = {"nan": "non-finite value (nan) at token 0, layer 0 (hidden-state id 0)",
               "inf": "non-finite value (inf) at token 0, layer 0 (hidden-state id 0)",
               "zeros": "layer 0 (hidden-state id 0) is all zeros over all 4 tokens"}
    assert all(reasons[sid] in failed[sid] for sid in reasons)
    assert all("hidden states not committed" in e for e in failed.values())
    assert_exactly_once(output, {f"good-{i}" for i in range(4)})
    assert not glob.glob(os.path.join(output, "data", "**", "nan*"), recursive=True)  # nothing written for them
    assert main(["status", output]) == EXIT_OK
    out = capsys.readouterr().out
    assert "hidden states not committed" in out and "3 failed" in out and "skipped" not in out  # counted by kind

    # skip: the failed samples are tried again (the good ones are done) and end as skipped rows, exit 0 even so
    assert main([*argv, "--on-nonfinite", "skip", "--fail-on-error"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "0 ok, 0 failed, 3 skipped for bad states, 4 skipped (already done)" in out
    assert "first skipped for bad states" in out
    table = _manifest(output)
    skipped = {r["sample_id"]: r for r in table.filter(pc.equal(table["status"], "skipped")).to_pylist()}
    assert set(skipped) == set(reasons)
    assert all(reasons[sid] in r["error"] and r["path"] is None for sid, r in skipped.items())
    assert_exactly_once(output, {f"good-{i}" for i in range(4)})  # still no file for them
    assert main(["status", output]) == EXIT_OK
    out = capsys.readouterr().out
    assert "4 ok, 0 failed, 3 skipped" in out and "failures by kind" not in out
    assert all(f"{sid}: " in out and reasons[sid] in out for sid in reasons)  # each skip with its reason
    assert main(["status", output, "--json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert (doc["ok"], doc["failed"], doc["skipped"]) == (4, 0, 3)

    # final: a resume, with the default policy too, finds nothing left (no Ray started, no row added)
    rows = table.num_rows
    assert main(argv) == EXIT_OK
    assert "0 ok, 0 failed, 7 skipped (already done)" in capsys.readouterr().out
    assert _manifest(output).num_rows == rows


# -- object storage --------------------------------------------------------------------------------------------------
@pytest.mark.s3
def test_s3_corpus_and_s3_output_with_generated_tokens(ray_cluster, tiny_llama, s3_bucket, tmp_path):
    import s3fs

    url, options = s3_bucket
    options = {**options, "key": os.environ["AWS_ACCESS_KEY_ID"], "secret": os.environ["AWS_SECRET_ACCESS_KEY"]}
    fs = s3fs.S3FileSystem(**options)
    local = write_jsonl(tmp_path / "a.jsonl", [{"id": f"s{i}", "prompt": f"River number {i} is green."}
                                               for i in range(5)])
    fs.put(local, f"{url}/corpus/a.jsonl")
    fs.put(write_jsonl_gz(tmp_path / "b.jsonl.gz", [{"id": "chat", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}]),
        f"{url}/corpus/b.jsonl.gz")
    config = JobConfig(model=tiny_llama, corpus=(f"{url}/corpus/*",), output=f"{url}/run", storage_options=options,
                       corpus_storage_options=options, max_tokens=3, include_output_tokens=True, progress=False)
    result = run_job(config)
    assert (result.ok, result.failed) == (6, 0)
    fs.invalidate_cache()
    table = pq.read_table(f"{url}/run/manifest".removeprefix("s3://"), filesystem=fs)
    assert sorted(table["sample_id"].to_pylist()) == ["chat", "s0", "s1", "s2", "s3", "s4"]
    for row in table.to_pylist():
        obj = load_hidden_states(f"{url}/run/{row['path']}", storage_options=options)
        generated = obj["token_ids"].shape[0] - row["num_prompt_tokens"]
        assert 0 <= generated <= 2  # up to max_tokens - 1 rows of generated tokens
        assert obj["loss_mask"][row["num_prompt_tokens"]:].tolist() == [1] * generated
    assert json.loads(fs.cat_file(f"{url}/run/run.json"))["max_tokens"] == 3
    # what a resume on S3 skips: every committed id, read back from the S3 manifest
    assert committed_ids(RunDir(f"{url}/run", options)) == set(table["sample_id"].to_pylist())


# -- job submission API ----------------------------------------------------------------------------------------------
def test_submit_runs_the_job_through_ray_job_submission(dashboard_url, tiny_llama, tmp_path, capsys):
    corpus = write_parquet(tmp_path / "c.parquet", [{"id": f"p{i}", "input_ids": [5, 6, 7 + i]} for i in range(4)])
    output = str(tmp_path / "out")
    argv = ["submit", "--address", dashboard_url, "--model", tiny_llama, "--corpus", corpus, "--output", output,
            "--no-progress", "--submission-id", "hsx-test-1"]
    # right after the head starts, its dashboard answers "No available agent ... try again later" for a while:
    # submit waits for the agent instead of failing
    code = main([*argv, "--wait"])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out[-3000:]
    assert out.splitlines()[0] == "hsx-test-1"
    assert "4 ok, 0 failed" in out
    assert_exactly_once(output, {f"p{i}" for i in range(4)})
    with pytest.raises(SystemExit) as e:  # a refused job (this id was used): one line naming why, no traceback
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == EXIT_USAGE and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "refused the job" in err and "hsx-test-1" in err and "already exists" in err, err


# -- job-level failure -------------------------------------------------------------------------------------------------
def test_workers_that_cannot_start_fail_the_job_with_exit_1_and_the_cause(ray_cluster, tiny_llama, tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "hello"}])
    code = main(["run", "--model", tiny_llama, "--corpus", corpus, "--output", str(tmp_path / "out"),
                 "--attn-implementation", "no_such_kernel", "--no-progress"])
    err = capsys.readouterr().err
    assert code == EXIT_FAILED
    assert "hsx: job failed" in err and "no_such_kernel" in err.splitlines()[-1]
