"""`hsx report`: the page of a run shows what is wrong with it. Planted bad runs (a post-norm last layer labelled
pre-norm, a dead layer) are built from a plain transformers forward of the tiny Llama (the oracle), written through
the real connector; the report's numbers are read back from the page itself, and the page is opened in a real
headless browser (Debian's chromium, driven by selenium)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from cli.main import main
from harness.runs import ORACLE_LAYERS, oracle_samples, write_run
from jobs.report import read_report_data, write_report
from jobs.report_config import ReportConfig

N_LAYERS = 4  # the tiny Llama's decoder layers: ORACLE_LAYERS = (1, 2, 4), 4 = N stored pre-norm


@pytest.fixture(scope="module")
def planted(tmp_path_factory, tiny_llama, oracle_model):
    """{name: OUTPUT}: the same 12 texts as a good run, a run whose last layer went through the final norm (while
    run.json says pre-norm), and a run whose layer 2 is all zeros."""
    from connectors import HiddenStatesSpec
    from reference.tiny_models import sample_text

    model, tokenizer = oracle_model
    spec = HiddenStatesSpec(layer_ids=ORACLE_LAYERS, num_hidden_layers=N_LAYERS, hidden_size=model.config.hidden_size,
                            dtype="float32", model=tiny_llama)
    texts = sample_text(12, seed=3, min_words=8, max_words=40)
    good = oracle_samples(model, texts, tokenizer, ORACLE_LAYERS)
    post = oracle_samples(model, texts, tokenizer, ORACLE_LAYERS)
    dead = oracle_samples(model, texts, tokenizer, ORACLE_LAYERS)
    with torch.no_grad():
        for s in post:
            s.hidden_states[:, -1] = model.model.norm(s.hidden_states[:, -1])
    for s in dead:
        s.hidden_states[:, 1] = 0
    runs = {}
    for name, samples in (("good", good), ("post_norm", post), ("dead_layer", dead)):
        runs[name] = str(tmp_path_factory.mktemp(f"report-{name}"))
        write_run(runs[name], samples, spec, check_states=False)
    return runs


def _report(output: str, tmp_path, name: str = "report.html", **kw) -> tuple[str, dict]:
    path, data = write_report(ReportConfig(output=output, out=str(tmp_path / name), **kw))
    with open(path, encoding="utf-8") as f:
        page = f.read()
    assert read_report_data(page) == data  # the numbers behind the plots are in the page
    return page, data


def _checks(data) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for f in data["flags"]:
        out.setdefault(f["check"], []).append(f)
    return out


def test_report_flags_a_post_norm_last_layer_labelled_pre_norm(planted, tmp_path):
    _, good = _report(planted["good"], tmp_path, "good.html")
    _, bad = _report(planted["post_norm"], tmp_path, "bad.html")
    ids = good["states"]["layer_ids"]
    last = ids.index(N_LAYERS)
    # the series the chart draws: the real pre-norm last layer varies from token to token like the aux layers; after
    # the final norm (RMSNorm, weight 1 in a fresh model) its per-token RMS is flat
    assert good["states"]["token_rms_cv"][last] > 0.05
    assert bad["states"]["token_rms_cv"][last] < 0.01
    assert bad["states"]["token_rms_cv"][:last] == pytest.approx(good["states"]["token_rms_cv"][:last])
    assert bad["states"]["rms_by_position"][last] != pytest.approx(good["states"]["rms_by_position"][last])
    assert "last_layer_norm" not in _checks(good) and "dead_layer" not in _checks(good)
    (flag,) = _checks(bad)["last_layer_norm"]
    assert flag["severity"] == "error" and f"layer {N_LAYERS}" in flag["message"] and "pre-norm" in flag["message"]
    assert "(pre-norm per run.json)" in bad["states"]["labels"][last]


def test_report_flags_a_dead_layer(planted, tmp_path):
    page, data = _report(planted["dead_layer"], tmp_path)
    s = data["states"]
    dead = s["layer_ids"].index(2)
    assert s["zero_row_fraction"][dead] == 1.0 and s["mean_rms"][dead] == 0.0
    assert all(v == 0.0 for v in s["rms_by_position"][dead])
    assert all(s["zero_row_fraction"][j] == 0.0 for j in range(len(s["layer_ids"])) if j != dead)
    flags = _checks(data)["dead_layer"]
    assert [("layer 2:" in f["message"]) for f in flags] == [True]
    assert "last_layer_norm" not in _checks(data)
    assert "layer 2: 100% of the sampled rows are all zeros" in page  # the check is on the page, for people


def test_report_figures_against_the_manifest(planted, tmp_path):
    """Lengths, bytes per token, loss-mask coverage: the report's numbers equal the ones computed here from the
    manifest and the samples, and --sample bounds what is read."""
    from connectors.manifest import ok_rows
    from connectors.run import RunDir

    _, data = _report(planted["good"], tmp_path, sample=5, seed=1)
    rows = ok_rows(RunDir(planted["good"])).to_pylist()
    assert data["counts"]["ok"] == len(rows) == 12
    assert data["states"]["sampled"] == 5
    assert data["lengths"]["longest"] == max(r["num_tokens"] for r in rows)
    assert sum(sum(c) for c in data["lengths"]["prompt"]["by_file"].values()) == 12
    assert data["bytes_per_token"]["mean"] == pytest.approx(
        sum(r["bytes"] / r["num_tokens"] for r in rows) / len(rows))
    # oracle_samples mask the second half of every sample
    assert all(0.4 <= c <= 0.6 for c in data["states"]["loss_mask_coverage"])
    assert _checks(data)["not_verified"][0]["severity"] == "info"
    _, again = _report(planted["good"], tmp_path, "again.html", sample=5, seed=1)
    assert again["states"] == data["states"]  # the same seed draws the same samples


def test_report_cli_and_status_mention(planted, tmp_path, capsys):
    out = tmp_path / "r.html"
    (tmp_path / "empty").mkdir()
    assert main(["report", planted["dead_layer"], "--out", str(out), "--sample", "4"]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "dead_layer" in printed
    assert main(["status", planted["good"]]) == 0
    assert "hsx report" in capsys.readouterr().out
    # never written over the run, nor over a file's folder that holds a model; no run: a clear error, exit 2
    with pytest.raises(SystemExit) as e:
        main(["report", planted["good"], "--out", os.path.join(planted["good"], "report.html")])
    assert e.value.code == 2 and "inside the OUTPUT folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["report", str(tmp_path / "empty"), "--out", str(tmp_path / "x.html")])
    assert e.value.code == 2 and "no run.json" in capsys.readouterr().err


def test_report_of_a_damaged_sample_lists_it_and_goes_on(planted, tmp_path):
    from connectors.manifest import ok_rows
    from connectors.run import RunDir

    damaged = str(tmp_path / "damaged")
    shutil.copytree(planted["good"], damaged)
    victim = ok_rows(RunDir(damaged)).to_pylist()[0]
    with open(os.path.join(damaged, victim["path"]), "r+b") as f:
        f.truncate(40)
    _, data = _report(damaged, tmp_path, sample=12)
    assert [u["sample_id"] for u in data["states"]["unread"]] == [victim["sample_id"]]
    assert data["states"]["sampled"] == 11
    assert "unread" in _checks(data)


@pytest.mark.s3
def test_report_of_an_s3_run(s3_bucket, oracle_run, tmp_path):
    """The same report from a run on the loopback S3 server (moto), read through fsspec."""
    _, samples, spec = oracle_run
    url, options = s3_bucket
    write_run(f"{url}/run", samples, spec, storage_options=options)
    path, data = write_report(ReportConfig(output=f"{url}/run", out=str(tmp_path / "s3.html"), sample=3,
                                           storage_options=options))
    assert data["counts"]["ok"] == len(samples) and data["states"]["sampled"] == 3
    assert not data["states"]["unread"] and "dead_layer" not in _checks(data)


def _browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("no headless browser: install Debian's chromium and chromium-driver (.ci/run does) to render "
                    "the report page in a real browser")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=options)


def test_report_renders_in_a_headless_browser(planted, tmp_path):
    page, data = _report(planted["post_norm"], tmp_path)
    browser = _browser()
    try:
        browser.get(f"file://{tmp_path / 'report.html'}")
        images = browser.execute_script(
            "return Array.from(document.images).map(i => [i.alt, i.complete, i.naturalWidth, i.naturalHeight])")
        assert len(images) == 4 and all(ok and w > 100 and h > 100 for _, ok, w, h in images), images
        embedded = browser.execute_script(
            "return JSON.parse(document.getElementById('hsx-report-data').textContent)")
        assert embedded["flags"] == data["flags"]
        checks = browser.execute_script("return document.getElementById('checks').innerText")
        assert "last_layer_norm" in checks
        errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
        assert not errors, errors
    finally:
        browser.quit()


def test_lengths_cut_names_the_limit_that_cut_them():
    """Answers all stopped at --max-tokens (stored: the prompt and all generated tokens but the last) are named as
    such; equal lengths without a generation limit are a cut at one value; varied lengths raise nothing."""
    from jobs.report import _flags, _lengths

    def flags(rows, max_tokens):
        states = {"layer_ids": [], "token_rms_cv": [], "zero_row_fraction": [], "nonfinite_row_fraction": [],
                  "mean_rms": [], "loss_mask_coverage": [], "unread": []}
        data = {"lengths": _lengths(rows), "states": states, "counts": {"failed": 0, "truncated": 0},
                "run": {"num_hidden_layers": 4, "last_layer_normalized": False, "max_tokens": max_tokens},
                "verify": {"failures": 0}}
        return [f["message"] for f in _flags(data) if f["check"] == "lengths_cut"]

    def row(prompt, total):
        return {"num_prompt_tokens": prompt, "num_tokens": total, "source": "c.jsonl:1"}

    generated = [row(10 + i, 10 + i + 63) for i in range(10)]
    (message,) = flags(generated, 64)
    assert "10 of 10 generated answers (100%) stopped at --max-tokens 64" in message
    (message,) = flags([row(128, 128)] * 8 + [row(40, 40)] * 2, 0)
    assert "8 of 10 samples (80%) have exactly the longest length, 128 tokens" in message
    assert flags([row(10 + i, 20 + 2 * i) for i in range(10)], 64) == []


def test_failures_by_reason_count_failed_samples_as_hsx_status_does(tmp_path, capsys):
    """A committed sample with a failed row is no failure; one failing twice counts once; the page and `hsx
    status` agree."""
    import json

    from connectors import HiddenStatesSpec
    from harness.runs import random_samples

    spec = HiddenStatesSpec(layer_ids=(1, 2), num_hidden_layers=2, hidden_size=8, dtype="float32")
    samples = random_samples(4, spec, seed=1)

    def failed(sid, error):
        return {"sample_id": sid, "path": "", "num_tokens": 0, "num_prompt_tokens": 0, "status": "failed",
                "error": error, "bytes": 0}

    out = str(tmp_path / "run")
    write_run(out, samples, spec, extra_rows=[failed("bad-1", "tokenizer error: x"), failed("bad-1", "tokenizer error: y"),
                                              failed("bad-2", "tokenizer error: z"),
                                              failed(samples[0].sample_id, "engine: out of memory")])
    _, data = _report(out, tmp_path)
    assert data["failures"] == {"tokenizer error": 2} and data["counts"]["failed"] == 2
    assert main(["status", out, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["error_kinds"] == data["failures"]
