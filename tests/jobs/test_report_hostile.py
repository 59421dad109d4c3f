"""`hsx report` against data and paths that try to break it: a `$` in a corpus file name and in a record's role (through
the failure-reason labels) is text, not math; a corpus file named `_hidden.jsonl` keeps its legend entry; a figure
that cannot be drawn is a note, never a lost page; a failure reason holding `<!--<script>` stays inside the embedded
JSON; --out never replaces a corpus file run.json lists nor a file hsx did not write; a run with a live writer is
refused unless --snapshot, which the page then says."""

from __future__ import annotations

import json
import os

import pytest

from cli.main import main
from harness.runs import random_samples, write_manifest, write_run
from jobs.report import read_report_data

DOLLAR_FILE = "price$_$list.jsonl"
UNDERSCORE_FILE = "_hidden.jsonl"
SCRIPT_REASON = "bad record <!--<script> x </script> y"
"""A failure reason that, put raw into <script>, makes a browser's parser miss the element's end."""


def _role_error() -> str:
    """What hsx records for a chat whose role is `x$_$` (the real message, from the real normalizer)."""
    from corpus.chat import normalize_messages

    with pytest.raises(ValueError) as e:
        normalize_messages({"messages": [{"role": "x$_$", "content": "hi"}]})
    return f"/corpus/{DOLLAR_FILE}:3: {e.value}"


def _run(root, corpus_names: tuple[str, ...], failures: dict[str, str]) -> tuple[str, list[str]]:
    """(OUTPUT, corpus files): 6 samples from corpus files named `corpus_names` (all listed in run.json), and a failed
    sample per `failures` entry (sample id -> the reason recorded)."""
    from connectors import HiddenStatesSpec
    from connectors.run import RunSpec

    corpus = []
    for name in corpus_names:
        (root / name).write_text(json.dumps({"id": name, "text": "a b c"}) + "\n")
        corpus.append(str(root / name))
    spec = HiddenStatesSpec(layer_ids=(1, 2), num_hidden_layers=2, hidden_size=8, dtype="float32")
    out = str(root / "run")
    rows = write_run(out, random_samples(6, spec, seed=2), spec,
                     run_json=RunSpec.from_file_spec(spec, corpus=tuple(corpus)))
    for i, row in enumerate(rows):  # each sample's source, as the job records it: "file:line"
        row["source"] = f"{corpus[i % len(corpus)]}:{i + 1}"
    failed = [{"sample_id": sid, "path": "", "num_tokens": 0, "num_prompt_tokens": 0, "status": "failed",
               "error": error, "bytes": 0, "source": f"{corpus[0]}:9"} for sid, error in failures.items()]
    write_manifest(out, [*rows, *failed])
    return out, corpus


@pytest.fixture(scope="module")
def dollar_run(tmp_path_factory) -> tuple[str, list[str]]:
    """Corpus files `price$_$list.jsonl` and `_hidden.jsonl`; a failed record whose role is `x$_$`."""
    return _run(tmp_path_factory.mktemp("dollar-report"), (DOLLAR_FILE, UNDERSCORE_FILE), {"bad-role": _role_error()})


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory) -> tuple[str, list[str]]:
    """Corpus files `chat.jsonl` and `code.jsonl`; a failed sample whose reason holds `<!--<script>`."""
    return _run(tmp_path_factory.mktemp("plain-report"), ("chat.jsonl", "code.jsonl"), {"bad-html": SCRIPT_REASON})


def _page(path) -> tuple[str, dict]:
    with open(path, encoding="utf-8") as f:
        page = f.read()
    return page, read_report_data(page)


def test_a_dollar_in_corpus_file_names_and_roles_and_an_underscore_file_are_drawn_as_text(dollar_run, tmp_path,
                                                                                           capsys):
    """Hostile input: corpus files `price$_$list.jsonl` and `_hidden.jsonl`, a record whose role is `x$_$`."""
    out, _ = dollar_run
    page_path = tmp_path / "r.html"
    assert main(["report", out, "--out", str(page_path)]) == 0
    capsys.readouterr()
    from jobs.report_figures import FIGURES

    page, data = _page(page_path)
    assert data["figures_not_drawn"] == {} and page.count('src="data:image/png;base64,') == len(FIGURES)
    assert data["lengths"]["files"] == sorted([DOLLAR_FILE, UNDERSCORE_FILE])
    assert any("x$_$" in reason for reason in data["failures"])
    # the legend keeps both files, `_hidden.jsonl` included, spelled as they are (a zero-width space may lead)
    fig = FIGURES["lengths"](data)
    legend = [t.get_text().lstrip("\u200b") for t in fig.axes[0].get_legend().get_texts()]
    assert legend == data["lengths"]["files"]


def test_a_figure_that_cannot_be_drawn_is_a_note_and_the_page_is_still_written(plain_run, tmp_path, capsys,
                                                                                monkeypatch):
    """Hostile input: matplotlib failing inside one figure (barh, which only the failures-by-reason chart uses)."""
    import matplotlib.axes

    def broken(*args, **kwargs):
        raise RuntimeError("injected: barh broke")

    monkeypatch.setattr(matplotlib.axes.Axes, "barh", broken)
    out, _ = plain_run
    page_path = tmp_path / "r.html"
    assert main(["report", out, "--out", str(page_path)]) == 0
    printed = capsys.readouterr().out
    assert "warning: figure failures_throughput not drawn (RuntimeError: injected: barh broke)" in printed
    page, data = _page(page_path)
    assert list(data["figures_not_drawn"]) == ["failures_throughput"]
    assert page.count('src="data:image/png;base64,') == 3 and "figure not drawn (RuntimeError" in page
    assert data["failures"] == {SCRIPT_REASON: 1}  # the numbers of the figure that failed are still in the page


def test_a_failure_reason_holding_script_markup_stays_inside_the_embedded_json(plain_run, tmp_path):
    """Hostile input: a failure reason `bad record <!--<script> x </script> y`. The HTML spec forbids `<!--`,
    `<script` and `</script` in a script element's text (a browser's parser would run past the element's end)."""
    out, _ = plain_run
    page_path = tmp_path / "r.html"
    assert main(["report", out, "--out", str(page_path)]) == 0
    page, data = _page(page_path)
    payload = page.split('id="hsx-report-data">', 1)[1].rsplit("</script>", 1)[0]
    for forbidden in ("<!--", "<script", "</script", "<", ">", "&"):
        assert forbidden not in payload.lower(), forbidden
    assert SCRIPT_REASON in data["failures"]  # read back as it was
    assert page.count("</script>") == 1


def test_report_out_never_replaces_a_corpus_file_that_run_json_lists(plain_run, tmp_path, capsys):
    """Hostile input: --out = a corpus file run.json lists (as written, and through a symlink)."""
    from cli.args import EXIT_USAGE

    out, corpus = plain_run
    link = tmp_path / "link.html"
    link.symlink_to(corpus[0])
    before = open(corpus[0], "rb").read()
    for given in (corpus[0], str(link)):
        with pytest.raises(SystemExit) as e:
            main(["report", out, "--out", given])
        err = capsys.readouterr().err
        assert e.value.code == EXIT_USAGE and "is the corpus file" in err and "Traceback" not in err, err
    assert open(corpus[0], "rb").read() == before


def test_report_out_replaces_an_earlier_page_and_no_other_file(plain_run, tmp_path, capsys):
    """Hostile input: --out = an existing notes.html that hsx did not write."""
    from cli.args import EXIT_USAGE

    out, _ = plain_run
    notes = tmp_path / "notes.html"
    notes.write_text("<html>my notes</html>")
    with pytest.raises(SystemExit) as e:
        main(["report", out, "--out", str(notes)])
    err = capsys.readouterr().err
    assert e.value.code == EXIT_USAGE and "is not a file hsx report wrote" in err, err
    assert notes.read_text() == "<html>my notes</html>"
    from jobs.report import PAGE_START

    page = tmp_path / "page.html"
    assert main(["report", out, "--out", str(page), "--sample", "1"]) == 0
    assert page.read_text().startswith(PAGE_START)
    assert main(["report", out, "--out", str(page), "--sample", "2"]) == 0  # its own earlier page: replaced
    assert _page(page)[1]["states"]["sampled"] == 2


def test_report_of_a_run_with_a_live_writer_is_refused_unless_snapshot(plain_run, tmp_path, capsys):
    """Hostile input: a live writer lease on the run (as `hsx run` holds while it writes)."""
    from cli.args import EXIT_USAGE
    from connectors.lease import WriterLease
    from connectors.run import RunDir

    out, _ = plain_run
    page_path = tmp_path / "r.html"
    lease = WriterLease.acquire(RunDir(out), "live-attempt")
    try:
        with pytest.raises(SystemExit) as e:
            main(["report", out, "--out", str(page_path)])
        err = capsys.readouterr().err
        assert e.value.code == EXIT_USAGE and "live-attempt" in err and f"pid {os.getpid()}" in err, err
        assert "--snapshot" in err and not page_path.exists()
        assert main(["report", out, "--out", str(page_path), "--snapshot"]) == 0
        assert "snapshot: the run is being written by attempt live-attempt" in capsys.readouterr().out
        page, data = _page(page_path)
        assert "live-attempt" in data["snapshot"]["writer"] and data["snapshot"]["taken_at"]
        assert '<p id="snapshot" class="warning"><b>snapshot</b>' in page
    finally:
        lease.release()
    assert main(["report", out, "--out", str(page_path)]) == 0  # nobody writes: no snapshot, no banner
    page, data = _page(page_path)
    assert data["snapshot"] is None and 'id="snapshot"' not in page
