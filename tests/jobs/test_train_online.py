"""`hsx train-drafter --online` (training_jobs/live.py, training_jobs/fanout.py): a drafter trained from a live extraction through Ray's object
store, nothing stored; the streamed states against a plain transformers forward; resume skips what was consumed."""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter

import pytest
import torch

from reference.tiny_models import sample_text
from training_jobs.config import TrainJobConfig

pytestmark = [pytest.mark.ray]

LAYERS = (1, 2, 4)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus" / "prompts.jsonl"
    path.parent.mkdir()
    texts = sample_text(12, seed=3, min_words=4, max_words=30)
    path.write_text("".join(json.dumps({"id": f"p{i:02d}", "prompt": t}) + "\n" for i, t in enumerate(texts)))
    return str(path), texts


def _config(tiny_llama, corpus, out, **kw) -> TrainJobConfig:
    defaults = dict(online=True, model=tiny_llama, corpus=(corpus[0],), out=str(out), extract={"layers": "1,2,4"},
                    batch_tokens=64, draft_vocab_size=48, lr=3e-3, device="cpu", progress=False,
                    log_sample_ids=True, checkpoint_every=2)
    return TrainJobConfig(**{**defaults, **kw})


def test_streamed_states_equal_a_plain_transformers_forward(tiny_llama, corpus, ray_cluster, tmp_path):
    from corpus.sample_registry import DoneSet
    from tests.extractor.oracle import load_reference, reference_states
    from training.collate import PackCollator
    from training.feed import CheckedFeed
    from training_jobs.live import LiveBatches, extraction_config, plan_stream

    config = _config(tiny_llama, corpus, tmp_path / "out")
    plan = plan_stream(extraction_config(config))
    assert plan.spec.layer_ids == LAYERS
    source = LiveBatches(config, plan, CheckedFeed(None, skip=False, spec=plan.spec), PackCollator(64), False, None)
    items = list(source.items(DoneSet()))
    assert sorted(it["sample_id"] for it in items) == [f"p{i:02d}" for i in range(12)]
    ref = load_reference(tiny_llama)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    for it in items:
        text = corpus[1][int(it["sample_id"][1:])]
        ids = tok(text).input_ids
        assert it["input_ids"].tolist() == ids
        torch.testing.assert_close(it["hidden_states"], reference_states(ref, ids, LAYERS), rtol=1e-4, atol=1e-4)
    assert source.extracted == 12 and source.failed == 0


def test_online_training_writes_only_its_out_and_a_resume_skips_what_it_trained_on(tiny_llama, corpus, ray_cluster,
                                                                                  tmp_path, capsys):
    from cli.main import main
    from training_jobs.train import train_drafter

    out = tmp_path / "online"
    before = set(os.listdir(tempfile.gettempdir()))
    code = main(["train-drafter", "--online", "--model", tiny_llama, "--corpus", corpus[0], "--out", str(out),
                 "--extract", '{"layers": "1,2,4"}', "--steps", "2", "--batch-tokens", "64", "--draft-vocab-size",
                 "48", "--lr", "3e-3", "--device", "cpu", "--no-progress", "--log-sample-ids",
                 "--checkpoint-every", "2"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "trained eagle3 for 2 steps" in printed.out
    first = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    consumed = {i for line in first for i in line["ids"]}
    assert [x["step"] for x in first] == [1, 2] and 0 < len(consumed) < 12
    # nothing stored but --out: no run, no staging folder, the corpus folder as it was
    assert sorted(os.listdir(out)) == [".hsx-output.json", "checkpoint", "config.json", "model.safetensors",
                                       "report.json", "samples.jsonl", "tensorboard"]
    assert os.listdir(os.path.dirname(corpus[0])) == ["prompts.jsonl"]
    assert not {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("hsx")}

    report = train_drafter(_config(tiny_llama, corpus, out))  # the rest of the pass (epochs 1)
    assert report["resumed_from_step"] == 2 and report["epochs"] == 1
    assert report["online"]["extracted"] == 12 - len(consumed)  # what the first training consumed is not extracted
    log = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == list(range(1, report["steps"] + 1))
    seen = Counter(i for line in log for i in line["ids"])
    assert sorted(seen) == [f"p{i:02d}" for i in range(12)] and set(seen.values()) == {1}
    assert report["tokens"] == sum(x["tokens"] for x in log)


@pytest.mark.slow
def test_an_online_training_killed_9_resumes_and_trains_on_the_rest_of_the_pass(tiny_llama, corpus, ray_cluster,
                                                                             tmp_path):
    import signal
    import subprocess
    import sys

    from tests.jobs.conftest import wait_for_file
    from training_jobs.train import train_drafter

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "killed"
    argv = ["train-drafter", "--online", "--model", tiny_llama, "--corpus", corpus[0], "--out", str(out), "--extract",
            '{"layers": "1,2,4"}', "--epochs", "1", "--batch-tokens", "32", "--draft-vocab-size", "48", "--lr", "3e-3",
            "--device", "cpu", "--no-progress", "--log-sample-ids", "--checkpoint-every", "2", "--address",
            ray_cluster.address]
    proc = subprocess.Popen([sys.executable, "-m", "cli", *argv], cwd=repo, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        wait_for_file(out / "checkpoint" / "step.json", proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (out / "model.safetensors").exists()
    stopped = torch.load(out / "checkpoint" / "state.pt", weights_only=False)["step"]
    report = train_drafter(_config(tiny_llama, corpus, out, batch_tokens=32))
    assert report["resumed_from_step"] == stopped and report["epochs"] == 1
    log = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == list(range(1, report["steps"] + 1))
    seen = Counter(i for line in log for i in line["ids"])
    assert sorted(seen) == [f"p{i:02d}" for i in range(12)] and set(seen.values()) == {1}


def test_a_cached_online_training_stores_the_first_pass_as_a_run_and_reads_it_in_later_epochs(
        tiny_llama, corpus, ray_cluster, tmp_path):
    """--cache: the first pass is an `hsx run` into the cache (every sample once, checksums that verify), later
    epochs read it (the target runs once per sample in all); stopped after 2 steps and resumed, each epoch still
    trains on every sample once."""
    from connectors.manifest import ok_rows, read_manifest
    from jobs.verify import verify_run
    from jobs.verify_config import VerifyConfig
    from training_jobs.train import train_drafter

    out, cache = tmp_path / "hybrid", tmp_path / "cache"
    first = train_drafter(_config(tiny_llama, corpus, out, cache=str(cache), steps=2))
    assert first["steps"] == 2
    report = train_drafter(_config(tiny_llama, corpus, out, cache=str(cache), epochs=2))
    assert report["resumed_from_step"] == 2 and report["epochs"] == 2
    log = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == list(range(1, report["steps"] + 1))
    for epoch in (0, 1):
        seen = Counter(i for line in log if line["epoch"] == epoch for i in line["ids"])
        assert sorted(seen) == [f"p{i:02d}" for i in range(12)] and set(seen.values()) == {1}, epoch
    # the cache is an ordinary run: every sample committed once, files that verify
    assert sorted(ok_rows(str(cache))["sample_id"].to_pylist()) == [f"p{i:02d}" for i in range(12)]
    statuses = Counter(read_manifest(str(cache), ["status"])["status"].to_pylist())
    assert statuses == {"ok": 12}
    checked = verify_run(VerifyConfig(output=str(cache)))
    assert checked.checked == 12 and not checked.failures
    # the second training's later epoch read the run: the target ran only for what the first left to extract
    assert first["online"]["target_forwards"] + report["online"]["target_forwards"] == 12


def test_fanout_trains_three_drafters_from_one_stream_each_as_if_alone(tiny_llama, corpus, ray_cluster, tmp_path):
    """--fanout: three trainers (two EAGLE-3 seeds and lrs, a Medusa) from one pass of the target; each trains on
    every sample once, and the first ends with the weights it reaches trained alone from its own stream."""
    from training_jobs.train import train_drafter

    fanout = tmp_path / "fanout.yaml"
    fanout.write_text(f"""trainers:
  - {{out: {tmp_path / 'a'}, seed: 0}}
  - {{out: {tmp_path / 'b'}, seed: 1, lr: 0.001}}
  - {{out: {tmp_path / 'c'}, kind: medusa, draft_vocab_size: null, num_speculative_tokens: 2}}
""")
    result = train_drafter(_config(tiny_llama, corpus, tmp_path / "x", fanout=str(fanout)))
    assert result["online"]["passes"] == 1 and result["online"]["target_forwards"] == 12  # one pass for all three
    for name, kind in (("a", "eagle3"), ("b", "eagle3"), ("c", "medusa")):
        report = next(r for r in result["trainers"] if r["out"] == str(tmp_path / name))
        assert report["kind"] == kind and report["steps"] > 0, report
        log = [json.loads(x) for x in (tmp_path / name / "samples.jsonl").read_text().splitlines()]
        seen = Counter(i for line in log for i in line["ids"])
        assert sorted(seen) == [f"p{i:02d}" for i in range(12)] and set(seen.values()) == {1}
    alone = train_drafter(_config(tiny_llama, corpus, tmp_path / "alone", seed=0))
    assert alone["online"]["target_forwards"] == 12
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "alone" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_online_extraction_captures_the_layers_the_families_declare_unless_extract_names_them(tiny_llama, corpus,
                                                                                            tmp_path):
    """No --extract layers: the stream captures what the trainers' families read (drafters.features: EAGLE-3 its
    three aux layers and N, Medusa N alone, a fan-out the union); with --cache, hsx run's default, which trains any
    family later; --extract's layers always win."""
    from transformers import AutoConfig

    from extractor.layers import default_layer_ids
    from training_jobs.live import extraction_config

    n = AutoConfig.from_pretrained(tiny_llama).num_hidden_layers
    eagle3 = tuple(sorted({min(max(i, 0), n) for i in (2, n // 2, n - 3)} | {n}))
    plain = dict(extract={}, draft_vocab_size=None)
    assert extraction_config(_config(tiny_llama, corpus, tmp_path / "a", **plain)).layers == eagle3
    medusa = _config(tiny_llama, corpus, tmp_path / "b", kind="medusa", **plain)
    assert extraction_config(medusa).layers == (n,)
    assert extraction_config(medusa, [medusa, _config(tiny_llama, corpus, tmp_path / "c", **plain)]).layers == eagle3
    cached = _config(tiny_llama, corpus, tmp_path / "d", kind="medusa", cache=str(tmp_path / "cache"), **plain)
    assert extraction_config(cached).layers == default_layer_ids(n)  # the engine's own default, as `hsx run`
    assert extraction_config(_config(tiny_llama, corpus, tmp_path / "e", kind="medusa", draft_vocab_size=None)
                             ).layers == (1, 2, 4)


def test_online_settings_are_checked_before_any_work(tiny_llama, corpus, tmp_path):
    from training_jobs.train import train_drafter

    with pytest.raises(ValueError, match="give --corpus FILES and no --run"):
        TrainJobConfig(online=True, model=tiny_llama, out=str(tmp_path / "o"))
    from training_jobs.live import train_online

    fanout = tmp_path / "fanout.yaml"
    fanout.write_text("trainers: []\n")
    with pytest.raises(ValueError, match="call training_jobs.train.train_drafter"):  # one trainer never drops the others
        train_online(_config(tiny_llama, corpus, tmp_path / "f", fanout=str(fanout)))
    assert not (tmp_path / "f").exists()
    for bad, match in [
                       (dict(run="./run"), "no --run"),
                       (dict(workers=2), "one process"),
                       (dict(lr_schedule="cosine"), "needs --steps"),
                       (dict(epochs=1.5), "whole number")]:
        with pytest.raises(ValueError, match=match):
            _config(tiny_llama, corpus, tmp_path / "o", **bad)
    with pytest.raises(ValueError, match="belong to --online"):
        _config(tiny_llama, corpus, tmp_path / "o", online=False, run="./run")
    for extract, match in [({"output": "x"}, "--online decides"), ({"layerz": "1"}, "--extract: .*layerz"),
                           ({"layers": "1,2"}, "needs layers .* add \"layers\": \"1,2,4\" to --extract")]:
        with pytest.raises(ValueError, match=match):
            train_drafter(_config(tiny_llama, corpus, tmp_path / "o", extract=extract))
    assert not (tmp_path / "o").exists()
