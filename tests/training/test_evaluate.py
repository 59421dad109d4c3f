"""evaluate_speculation on a tiny random Llama: none vs ngram, figures as vLLM computes them, and a losslessness
check that passes on the engine's outputs and fails loudly on outputs that differ."""

from __future__ import annotations

import json

import pytest
import torch

from extractor.metrics import Counter, Vector
from training.eval_result import EvalResult, LossyOutputError, SpecDecodeCounts, check_lossless, spec_decode_counts
from training.evaluate import comparison_table, eval_methods, evaluate_speculation, result_lines, spec_decode_lines

# repetitive prompts: the ngram proposer finds its suffix earlier in the context and drafts something
PROMPTS = ["one two three four one two three four one two three four one two",
           "the cat the dog the cat the dog the cat the",
           "a b c d e a b c d e a b c"]
NGRAM3 = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
MAX_TOKENS = 12


def oracle_outputs(model_dir: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Plain transformers greedy generate: the independent reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


@pytest.fixture(scope="module")
def oracle(tiny_llama):
    return oracle_outputs(tiny_llama, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def evaluated(tiny_llama, oracle):
    return evaluate_speculation(tiny_llama, PROMPTS, {"ngram k=3": NGRAM3}, MAX_TOKENS, reference_token_ids=oracle,
                                threads=1)


def test_none_and_ngram_decode_the_oracles_tokens_with_vllms_figures(evaluated, oracle):
    none, ngram = evaluated
    assert none.method == "none" and not none.speculative  # added first: the plain reference
    assert none.token_ids == oracle and ngram.token_ids == oracle
    assert none.lossless and ngram.lossless
    assert none.num_output_tokens == ngram.num_output_tokens == len(PROMPTS) * MAX_TOKENS
    c = ngram.counts
    assert c.num_drafts > 0 and len(c.accepted_per_pos) == 3  # the repetitive prompts did get drafted
    assert c.num_draft_tokens <= 3 * c.num_drafts
    assert ngram.mean_acceptance_length == pytest.approx(1 + c.num_accepted_tokens / c.num_drafts)
    assert ngram.acceptance_per_position == pytest.approx([n / c.num_drafts for n in c.accepted_per_pos])
    assert sum(c.accepted_per_pos) == c.num_accepted_tokens
    assert c.accepted_per_pos == sorted(c.accepted_per_pos, reverse=True)  # accepting token i needs 0..i-1
    assert none.mean_acceptance_length is None and none.speedup == pytest.approx(1.0)
    assert ngram.tokens_per_s > 0 and ngram.speedup == pytest.approx(ngram.tokens_per_s / none.tokens_per_s)


def test_the_warm_up_is_neither_counted_nor_timed(tiny_llama, evaluated):
    # a warm-up as long as the timed call itself (which drafts: see above) leaves the counts unchanged
    again = evaluate_speculation(tiny_llama, PROMPTS, {"ngram k=3": NGRAM3}, MAX_TOKENS, warmup_prompts=len(PROMPTS),
                                 warmup_tokens=MAX_TOKENS, threads=1)[1]
    assert evaluated[1].counts.num_drafts > 0
    assert again.counts == evaluated[1].counts
    # two timed calls count twice one call's drafts; the median time is of one call
    twice = evaluate_speculation(tiny_llama, PROMPTS, {"ngram k=3": NGRAM3}, MAX_TOKENS, repeats=2, threads=1)[1]
    assert twice.counts.num_drafts == 2 * again.counts.num_drafts
    assert twice.counts.accepted_per_pos == [2 * n for n in again.counts.accepted_per_pos]
    assert twice.num_output_tokens == again.num_output_tokens


def test_outputs_that_differ_from_the_reference_fail_loudly(tiny_llama, oracle, caplog):
    tampered = [list(t) for t in oracle]
    tampered[1][5] = (tampered[1][5] + 1) % 100
    with pytest.raises(LossyOutputError, match=r"ngram k=3: 1 prompts differ, first prompt 1: output token 5") as e:
        evaluate_speculation(tiny_llama, PROMPTS, {"ngram k=3": NGRAM3}, MAX_TOKENS, reference_token_ids=tampered,
                             threads=1)
    results = e.value.results
    assert [r.lossless for r in results] == [False, False]
    assert "NOT lossless" in caplog.text
    table = "\n".join(comparison_table(results))
    assert "**NO** (1 prompts differ)" in table
    assert "NOT LOSSLESS" in "\n".join(result_lines(results[1]))


def test_check_lossless_names_the_first_differing_token():
    assert check_lossless([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == []
    (m,) = check_lossless([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]])
    assert (m.prompt_index, m.position, m.expected, m.got) == (1, 1, 5, 6)
    (m,) = check_lossless([[1, 2, 3]], [[1, 2]])  # a shorter output is a mismatch too
    assert (m.position, m.expected, m.got) == (2, 3, None)
    with pytest.raises(ValueError, match="2 outputs for 1 reference"):
        check_lossless([[1]], [[1], [2]])


def test_counts_are_read_from_get_metrics_as_vllm_names_them():
    metrics = [Counter("vllm:prompt_tokens", {}, 10), Counter("vllm:spec_decode_num_drafts", {}, 4),
               Counter("vllm:spec_decode_num_draft_tokens", {}, 12),
               Counter("vllm:spec_decode_num_accepted_tokens", {}, 6),
               Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {}, [3, 2, 1])]
    c = spec_decode_counts(metrics)
    assert c == SpecDecodeCounts(4, 12, 6, [3, 2, 1])
    assert c.mean_acceptance_length == 2.5 and c.acceptance_per_position == [0.75, 0.5, 0.25]
    # vLLM's examples/offline_inference/spec_decode.py prints exactly these lines
    assert spec_decode_lines(99, c) == [
        "-" * 50, "total_num_output_tokens: 99", "num_drafts: 4", "num_draft_tokens: 12", "num_accepted_tokens: 6",
        "mean acceptance length: 2.50", "-" * 50, "acceptance at token 0: 0.75", "acceptance at token 1: 0.50",
        "acceptance at token 2: 0.25"]


def test_a_method_that_cannot_start_is_recorded_or_raised(tiny_llama, tmp_path):
    bad = {"medusa k=3": {"method": "no-such-method", "num_speculative_tokens": 3}}
    with pytest.raises(ValueError):
        evaluate_speculation(tiny_llama, PROMPTS[:1], bad, 4, threads=1)
    none, skipped = evaluate_speculation(tiny_llama, PROMPTS[:1], bad, 4, threads=1, errors="record")
    assert none.lossless and skipped.error and "no-such-method" in skipped.error
    assert "skipped" in "\n".join(comparison_table([none, skipped]))
    with pytest.raises(ValueError, match="temperature"):
        evaluate_speculation(tiny_llama, PROMPTS, {}, 4, temperature=0.7)


def test_hsx_eval_drafter_prints_the_table_and_writes_json(tiny_llama, tmp_path, capsys):
    """One evaluation per --max-num-seqs value (all at once, then one request at a time), each lossless; the flags
    map onto EvalDrafterConfig, which a --config file gives as well."""
    from cli.args import EXIT_USAGE
    from cli.main import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "results.json"
    assert main(["eval-drafter", "--model", tiny_llama, "--prompts", str(prompts), "--max-tokens", "6", "-k", "2",
                 "--threads", "1", "--json", str(out), "--max-num-seqs", "3", "1"]) == 0
    printed = capsys.readouterr().out
    assert "| ngram k=2 |" in printed and "mean acceptance length:" in printed and "one request at a time" in printed
    rows = json.loads(out.read_text())
    assert [(r["method"], r["max_num_seqs"]) for r in rows] == [("none", 3), ("ngram k=2", 3), ("none", 1),
                                                                 ("ngram k=2", 1)]
    assert all(r["lossless"] for r in rows)
    # the same greedy decoding either way: identical drafts and acceptance counts
    assert rows[1]["num_draft_tokens"] == rows[3]["num_draft_tokens"] > 0
    assert rows[1]["num_accepted_tokens"] == rows[3]["num_accepted_tokens"]
    config = tmp_path / "eval.yaml"  # the same settings from a file; the flags given still win
    config.write_text(f"model: {tiny_llama}\nprompts: {prompts}\nmax_tokens: 2\nngram: false\nthreads: 1\n"
                      f"json: {out}\nmax_num_seqs: [7]\n")
    assert main(["eval-drafter", "--config", str(config)]) == 0
    assert [(r["method"], r["max_num_seqs"]) for r in json.loads(out.read_text())] == [("none", 7)]
    assert main(["eval-drafter", "--config", str(config), "--max-num-seqs", "2"]) == 0
    assert [(r["method"], r["max_num_seqs"]) for r in json.loads(out.read_text())] == [("none", 2)]
    capsys.readouterr()
    for argv, message in ((["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
                          (["--drafter", str(tmp_path)], "no config.json"),
                          (["--model", str(tmp_path / "missing")], "is not a local folder")):
        with pytest.raises(SystemExit) as e:  # bad arguments: the CLI's usage error (one line, exit 2)
            main(["eval-drafter", "--model", tiny_llama, "--prompts", str(prompts), *argv])
        err = capsys.readouterr().err
        assert e.value.code == EXIT_USAGE and message in err and "Traceback" not in err, err


def test_eval_methods_lists_none_ngram_and_each_drafter_per_k():
    methods = eval_methods([("eagle3 (h)", "eagle3", "/d")], [3, 5])
    assert list(methods) == ["none", "ngram k=3", "eagle3 (h) k=3", "ngram k=5", "eagle3 (h) k=5"]
    assert methods["eagle3 (h) k=5"] == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 5}
    assert EvalResult("x", None).mean_acceptance_length is None


def test_failed_requests_fail_the_method(tiny_llama):
    too_long = PROMPTS[:2] + ["x " * 5000]  # longer than the model's 4096 positions: that request fails
    with pytest.raises(RuntimeError, match="1 of 3 requests failed"):
        evaluate_speculation(tiny_llama, too_long, {}, 2, threads=1)
    (none,) = evaluate_speculation(tiny_llama, too_long, {}, 2, threads=1, errors="record")
    assert "1 of 3 requests failed" in none.error and none.mean_acceptance_length is None


def test_hsx_eval_drafter_is_a_subcommand_with_the_cli_exit_codes(tiny_llama, tmp_path, capsys):
    from cli.args import EXIT_USAGE
    from cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["eval-drafter", "--model", str(tmp_path / "missing")])
    assert exit_.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "is not a local folder" in err and "Traceback" not in err


def test_tokens_per_target_step_counts_the_targets_own_forwards(tiny_llama):
    """tokens_per_target_step against the model's forward calls, counted per model instance by a hook on the model
    class: with requests one at a time every decode step, drafted or not, is one target forward. The draft model is
    the target itself, so its drafts are accepted and the figure is well above 1."""
    from collections import Counter

    from transformers import LlamaForCausalLM

    calls: Counter = Counter()

    def count(module, args, output):
        if isinstance(module, LlamaForCausalLM):
            calls[id(module)] += 1

    same = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3}
    handle = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        none, ngram, draft = evaluate_speculation(tiny_llama, PROMPTS, {"ngram k=3": NGRAM3, "self k=3": same},
                                                  MAX_TOKENS, warmup_prompts=1, warmup_tokens=1, threads=1,
                                                  max_num_seqs=1)
    finally:
        handle.remove()
    assert none.max_num_seqs == ngram.max_num_seqs == draft.max_num_seqs == 1
    # per target: the warm-up's prefill, one prefill per prompt, then its decode steps
    decode = len(PROMPTS) * (MAX_TOKENS - 1)
    expected = Counter(1 + len(PROMPTS) + steps for steps in (decode, ngram.target_steps, draft.target_steps))
    assert not expected - Counter(calls.values()), (expected, calls)
    assert draft.counts.num_accepted_tokens > 0 and draft.tokens_per_target_step > 2
    for r in (ngram, draft):
        assert r.tokens_per_target_step == pytest.approx(decode / r.target_steps)
        assert 0 < r.drafted_fraction <= 1 and r.counts.num_drafts <= r.target_steps
    assert none.tokens_per_target_step is None and none.drafted_fraction is None
    assert "| steps drafted | tokens per target step | drafter ms / step |" in "\n".join(
        comparison_table([none, ngram, draft]))
    # the drafter's time per step: one proposal per target step here (one request at a time); the draft model (the
    # target itself, k forwards a step) costs far more than prompt lookup; plain decoding has no drafter
    for r in (ngram, draft):
        assert r.counts.drafter_steps == r.target_steps and r.drafter_ms_per_step > 0
    assert draft.drafter_ms_per_step > 3 * ngram.drafter_ms_per_step and none.drafter_ms_per_step is None


def test_hsx_eval_drafter_exits_1_when_a_drafter_could_not_be_evaluated(oracle_run, tiny_llama, tmp_path, capsys):
    """A drafter it was given but could not evaluate (here a config.json whose hidden_size was damaged) fails the
    command: exit 1 naming it, the other methods still measured; nothing is quietly left out. (emb_dim is
    MLPSpeculator's name for the target's hidden size.)"""
    from cli.args import EXIT_FAILED
    from cli.main import main
    from training.train_config import TrainDrafterConfig
    from training_jobs.train import train_drafter

    drafter = tmp_path / "mlp"
    train_drafter(TrainDrafterConfig(run=oracle_run[0], model=tiny_llama, out=str(drafter), kind="mlp_speculator",
                                     steps=1, batch_tokens=64, device="cpu", progress=False))
    doc = json.loads((drafter / "config.json").read_text())
    doc["emb_dim"] = 48  # not the target's 64
    (drafter / "config.json").write_text(json.dumps(doc))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:1]))
    code = main(["eval-drafter", "--model", tiny_llama, "--prompts", str(prompts), "--max-tokens", "3", "-k", "2",
                 "--threads", "1", "--drafter", str(drafter), "--json", str(tmp_path / "r.json")])
    printed = capsys.readouterr()
    assert code == EXIT_FAILED, printed.out
    assert "NOT EVALUATED: mlp_speculator (mlp) k=2" in printed.out and "Traceback" not in printed.err
    rows = {r["method"]: r for r in json.loads((tmp_path / "r.json").read_text())}
    assert rows["none"]["lossless"] and rows["ngram k=2"]["error"] is None
    assert rows["mlp_speculator (mlp) k=2"]["error"]


ACCEPTANCE_HEADER_K2 = ["subset", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_length",
                        "acceptance_at_pos_0", "acceptance_at_pos_1"]
"""vllm-project/speculators' scripts/evaluate acceptance.csv columns for k = 2, written out by hand."""


@pytest.fixture(scope="module")
def repeater(tiny_llama, tmp_path_factory) -> str:
    """tiny_llama with its final norm zeroed: every logit 0, so greedy decoding repeats token 0 and ngram drafts
    (and the target accepts) from the third output token on."""
    import shutil

    from transformers import AutoModelForCausalLM

    out = str(tmp_path_factory.mktemp("repeater") / "model")
    shutil.copytree(tiny_llama, out)
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    model.save_pretrained(out)
    return out


def _read_csv(path) -> list[dict[str, str]]:
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_hsx_eval_drafter_out_writes_acceptance_per_category_in_the_published_layout(repeater, tmp_path, capsys):
    """--out DIR: per speculative method and width, DIR/<method>/acceptance.csv with exactly the published columns,
    a row per prompt category (in order of appearance) and "all" (the engine's counters, which the categories' own
    per-request counts add up to); summary.csv with tokens per target step; a PNG; results.json as --json has it.
    A re-run into the same DIR (its own output) replaces what is no longer evaluated."""
    import matplotlib.image

    from cli.main import main

    categories = ["code", "chat", "code", "chat"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n"
                               for p, c in zip([*PROMPTS, PROMPTS[0]], categories)))
    out, js = tmp_path / "eval", tmp_path / "r.json"
    assert main(["eval-drafter", "--model", repeater, "--prompts", str(prompts), "--max-tokens", "8", "-k", "2",
                 "--threads", "1", "--max-num-seqs", "4", "1", "--out", str(out), "--json", str(js)]) == 0
    printed = capsys.readouterr().out
    folders = ["ngram_k-2_max_num_seqs-4", "ngram_k-2_max_num_seqs-1"]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(folders)
    results = {(r["method"], r["max_num_seqs"]): r for r in json.loads((out / "results.json").read_text())}
    assert json.loads(js.read_text()) == json.loads((out / "results.json").read_text())
    for folder, width in zip(folders, (4, 1)):
        path = out / folder / "acceptance.csv"
        assert str(path) in printed
        assert path.read_text().splitlines()[0].split(",") == ACCEPTANCE_HEADER_K2
        rows = _read_csv(path)
        assert [r["subset"] for r in rows] == ["code", "chat", "all"]
        for r in rows:
            drafts, accepted = int(r["num_drafts"]), int(r["num_accepted_tokens"])
            assert float(r["acceptance_length"]) == pytest.approx(1 + accepted / drafts)
            assert float(r["acceptance_at_pos_0"]) >= float(r["acceptance_at_pos_1"])
            assert int(r["num_draft_tokens"]) <= 2 * drafts
        *cats, everything = rows
        for column in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            assert int(everything[column]) == sum(int(r[column]) for r in cats)
        drafts = int(everything["num_drafts"])
        accepted_at = [round(float(everything[f"acceptance_at_pos_{i}"]) * drafts) for i in range(2)]
        assert sum(accepted_at) == int(everything["num_accepted_tokens"])
        reported = results[("ngram k=2", width)]
        assert drafts == reported["num_drafts"] > 0 and all(int(r["num_accepted_tokens"]) > 0 for r in rows)
        assert set(reported["categories"]) == {"code", "chat"}
    summary = {r["method"]: r for r in _read_csv(out / "summary.csv")}
    assert list(summary) == ["none max_num_seqs=4", "ngram k=2 max_num_seqs=4", "none max_num_seqs=1",
                             "ngram k=2 max_num_seqs=1"]
    ngram = summary["ngram k=2 max_num_seqs=1"]
    assert ngram["folder"] == folders[1] and summary["none max_num_seqs=1"]["folder"] == ""
    assert float(ngram["tokens_per_target_step"]) == pytest.approx(
        results[("ngram k=2", 1)]["tokens_per_target_step"]) and float(ngram["tokens_per_target_step"]) > 1
    assert float(summary["none max_num_seqs=4"]["tokens_per_target_step"]) == 1.0
    png = out / "acceptance_per_position.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(str(png)).shape[0] > 100

    assert main(["eval-drafter", "--model", repeater, "--prompts", str(prompts), "--max-tokens", "2", "--no-ngram",
                 "--threads", "1", "--out", str(out)]) == 0
    assert not [p for p in out.iterdir() if p.is_dir()] and not png.exists()
    assert [r["method"] for r in _read_csv(out / "summary.csv")] == ["none"]


def test_acceptance_rows_follow_vllms_formulas(tmp_path):
    """Hand-made counts, hand-computed rows: AL = 1 + accepted / drafts, position i = accepted there / drafts; the
    categories from their own counts, "all" from the method's."""
    from training.acceptance import write_eval_outputs

    r = EvalResult("eagle3 (h) k=3", {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}, num_prompts=3,
                   num_output_tokens=30, timed_calls=1, seconds=1.0,
                   counts=SpecDecodeCounts(4, 12, 6, [3, 2, 1]),
                   category_counts={"qa": SpecDecodeCounts(3, 9, 5, [3, 1, 1]),
                                    "math, proofs": SpecDecodeCounts(1, 3, 1, [0, 1, 0])})
    written = write_eval_outputs(str(tmp_path), [EvalResult("none", None, num_prompts=3, num_output_tokens=30,
                                                            timed_calls=1, seconds=2.0), r])
    acceptance = tmp_path / "eagle3_h_k-3" / "acceptance.csv"
    assert written[0] == str(acceptance)
    assert acceptance.read_text().splitlines() == [
        "subset,num_drafts,num_draft_tokens,num_accepted_tokens,acceptance_length,acceptance_at_pos_0,"
        "acceptance_at_pos_1,acceptance_at_pos_2",
        f"qa,3,9,5,{1 + 5 / 3},1.0,{1 / 3},{1 / 3}",
        '"math, proofs",1,3,1,2.0,0.0,1.0,0.0',
        "all,4,12,6,2.5,0.75,0.5,0.25"]
    (none, eagle) = _read_csv(tmp_path / "summary.csv")
    assert (none["tokens_per_target_step"], none["folder"], eagle["folder"]) == ("1.0", "", "eagle3_h_k-3")
    assert float(eagle["tokens_per_target_step"]) == pytest.approx(27 / 21)  # 27 decoded, 6 of them accepted


def test_method_folders_are_safe_and_unique_names():
    from training.acceptance import method_slugs

    results = [EvalResult(name, {"method": "ngram"}) for name in
               ("eagle3 (run/a) k=3", "eagle3 (run\\a) k=3", "../.. k=3", "summary.csv", "EAGLE3 (RUN/A) K=3", "")]
    slugs = method_slugs(results)
    assert slugs[:2] == ["eagle3_run_a_k-3", "eagle3_run_a_k-3_2"]
    assert len({s.lower() for s in slugs}) == len(slugs)
    assert all(s and not s.startswith(".") and "/" not in s and "\\" not in s and ".." not in s for s in slugs)
    assert slugs[3] != "summary.csv"


def test_hsx_eval_drafter_refuses_a_bad_category_and_an_out_over_the_model_before_any_work(tiny_llama, tmp_path,
                                                                                          capsys, monkeypatch):
    from pathlib import Path

    from cli.args import EXIT_USAGE
    from cli.main import main
    from training import evaluate

    def no_work(*args, **kwargs):
        raise AssertionError("evaluated despite bad arguments")

    monkeypatch.setattr(evaluate, "evaluate_speculation", no_work)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b", "category": "code"}) + "\n"
                       + json.dumps({"prompt": "c d", "category": 7}) + "\n")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "a b", "category": "code"}) + "\n")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    before = sorted(p.name for p in Path(tiny_llama).iterdir())
    for argv, message in ((["--prompts", str(prompts)], f"{prompts}:2: 'category' is 7 (int); give a string"),
                          (["--prompts", str(good), "--out", tiny_llama], "--out"),
                          (["--prompts", str(good), "--out", f"{tiny_llama}/eval"], "lies inside"),
                          (["--prompts", str(good), "--out", str(busy)], "already holds 1 entry")):
        with pytest.raises(SystemExit) as e:
            main(["eval-drafter", "--model", tiny_llama, *argv])
        err = capsys.readouterr().err
        assert e.value.code == EXIT_USAGE and message in err and "Traceback" not in err, err
    assert sorted(p.name for p in Path(tiny_llama).iterdir()) == before
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]
    with pytest.raises(ValueError, match=r"prompt 1: 'category' is \[7\] \(list\)"):  # the API checks it too
        evaluate_speculation(tiny_llama, ["x", {"prompt": "y", "category": [7]}], {}, 1)
    (tmp_path / "all.jsonl").write_text(json.dumps({"prompt": "x", "category": "all"}) + "\n")
    with pytest.raises(ValueError, match="all.jsonl:1: category 'all' is reserved"):
        evaluate.load_prompts(str(tmp_path / "all.jsonl"))
