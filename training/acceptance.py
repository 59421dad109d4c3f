"""The files `hsx eval-drafter --out DIR` writes: acceptance in the layout drafter benchmarks publish, hsx's own
figures beside it, and a plot.

    write_eval_outputs(folder, results) -> [paths]   the tables, into a checked output folder:
        DIR/<method>/acceptance.csv      one per speculative method that ran (not "none", not a skipped one)
        DIR/summary.csv                  one row per method: hsx's figures (tokens per target step, tokens/s, ...)
        DIR/results.json                 what --json writes
    write_eval_plot(folder, results) -> path | None   then the picture (raises when drawing fails; the caller
                                            warns: the tables above are written first and stay)
        DIR/acceptance_per_position.png  acceptance per position, one line per speculative method
    acceptance_rows(result) -> [[...]]      a method's acceptance.csv rows: one per prompt category, then "all"
    summary_rows(results) -> [[...]]        summary.csv's rows
    results_json(results) -> bytes          results.json (and --json): EvalResult.to_dict() per method
    plot_acceptance(results) -> bytes       the PNG (matplotlib's Agg canvas: no display, no global backend; every
                                            label literal: training/plot_text.py); acceptance_figure: its Figure
    method_labels(results) / method_slugs(results)   a name per result (with max_num_seqs when several widths were
                                            evaluated), and a filesystem-safe, unique folder name from it

acceptance.csv is the layout of vllm-project/speculators' scripts/evaluate (run on RedHatAI/speculator_benchmarks):
columns ACCEPTANCE_COLUMNS then acceptance_at_pos_0 .. acceptance_at_pos_{k-1}, a row per prompt subset, with
acceptance_length = 1 + accepted / drafts and acceptance_at_pos_i = drafts whose i-th token was accepted / drafts
(vLLM's spec_decode counters). hsx adds the row "all" (every prompt; the engine's counters). The layout has no
method column, hence one file per method folder; summary.csv carries the method. Both CSVs are safe to open in a
spreadsheet (connectors/csvfile.py: a category `=HYPERLINK(...)` is written `'=HYPERLINK(...)`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence

from connectors.csvfile import csv_bytes
from connectors.outputs import write_output_file
from training.eval_result import EvalResult, SpecDecodeCounts
from training.plot_text import figure, legend_label, literal_text, png

ACCEPTANCE_COLUMNS = ("subset", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_length")
"""acceptance.csv's leading columns; acceptance_at_pos_0 .. _{k-1} follow."""
ALL_ROW = "all"
"""The subset name of acceptance.csv's row over every prompt."""
SUMMARY_COLUMNS = ("method", "folder", "max_num_seqs", "num_prompts", "num_output_tokens", "timed_calls",
                   "num_drafts", "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length",
                   "tokens_per_target_step", "drafted_fraction", "drafter_ms_per_step", "tokens_per_s", "speedup",
                   "lossless", "error")
ACCEPTANCE_CSV, SUMMARY_CSV, PLOT_PNG, RESULTS_JSON = ("acceptance.csv", "summary.csv", "acceptance_per_position.png",
                                                       "results.json")
_RESERVED = {SUMMARY_CSV, PLOT_PNG, RESULTS_JSON, ".hsx-output.json", "writer.lease"}


def has_acceptance(result: EvalResult) -> bool:
    """Whether a result gets an acceptance.csv: a speculative method that ran."""
    return result.speculative and not result.error


def acceptance_header(k: int) -> list[str]:
    return [*ACCEPTANCE_COLUMNS, *(f"acceptance_at_pos_{i}" for i in range(k))]


def _acceptance_row(subset: str, counts: SpecDecodeCounts, k: int) -> list:
    per_pos = counts.acceptance_per_position + [0.0] * (k - len(counts.accepted_per_pos))
    return [subset, counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens,
            counts.mean_acceptance_length, *per_pos]


def acceptance_rows(result: EvalResult) -> list[list]:
    """One row per prompt category (from each request's own counts), then "all" (the engine's counters)."""
    k = (result.speculative_config or {}).get("num_speculative_tokens") or len(result.counts.accepted_per_pos)
    rows = [_acceptance_row(name, counts, k) for name, counts in result.category_counts.items()]
    return [*rows, _acceptance_row(ALL_ROW, result.counts, k)]


def method_labels(results: Sequence[EvalResult]) -> list[str]:
    """Each result's method name, with its max_num_seqs when the results span several."""
    several = len({r.max_num_seqs for r in results}) > 1
    return [r.method + (f" max_num_seqs={r.max_num_seqs or 'default'}" if several else "") for r in results]


def method_slugs(results: Sequence[EvalResult]) -> list[str]:
    """A folder name per result from its label ("ngram k=3 max_num_seqs=1" -> ngram_k-3_max_num_seqs-1): letters,
    digits, '.', '+', '-' and '_' only, never hidden, at most 80 characters, unique ignoring case (case-insensitive
    filesystems), never one of DIR's own file names."""
    taken: set[str] = {name.lower() for name in _RESERVED}
    slugs = []
    for label in method_labels(results):
        base = re.sub(r"[^A-Za-z0-9.+-]+", "_", label.replace("=", "-")).strip("._-")[:80] or "method"
        slug, n = base, 2
        while slug.lower() in taken:
            slug, n = f"{base}_{n}", n + 1
        taken.add(slug.lower())
        slugs.append(slug)
    return slugs


def _fmt(value) -> object:
    return "" if value is None else value


def summary_rows(results: Sequence[EvalResult]) -> list[list]:
    """summary.csv's rows (SUMMARY_COLUMNS): plain decoding makes one token per target step."""
    rows = []
    for r, label, slug in zip(results, method_labels(results), method_slugs(results)):
        per_step = r.tokens_per_target_step if r.speculative else (None if r.error else 1.0)
        ran = r.error is None
        rows.append([label, slug if has_acceptance(r) else "", r.max_num_seqs or "default", r.num_prompts,
                     r.num_output_tokens if ran else "", r.timed_calls if ran else "",
                     *([r.counts.num_drafts, r.counts.num_draft_tokens, r.counts.num_accepted_tokens]
                       if has_acceptance(r) else ["", "", ""]),
                     _fmt(r.mean_acceptance_length), _fmt(per_step), _fmt(r.drafted_fraction),
                     _fmt(r.drafter_ms_per_step), r.tokens_per_s if ran else "", _fmt(r.speedup), r.lossless if ran else "", _fmt(r.error)])
    return rows


RESULTS_JSON_STARTS = (b'[\n  {\n    "method": ', b"[]")
"""How results_json's bytes begin: `eval-drafter --json` replaces an existing file only when it begins so."""


def results_json(results: Sequence[EvalResult]) -> bytes:
    """What `--json PATH` and DIR/results.json hold: EvalResult.to_dict() per method."""
    return json.dumps([r.to_dict() for r in results], indent=2).encode()


def acceptance_figure(results: Sequence[EvalResult]):
    """The figure of plot_acceptance (a matplotlib Figure on Agg's canvas), or None when no speculative method ran.
    Labels (a drafter's folder name among them) are drawn as they are: `x$_$` is no math, `_hidden` is not left out
    of the legend (training/plot_text.py)."""
    from matplotlib.ticker import MaxNLocator  # matplotlib loads when a plot is drawn

    lines = [(label, r.acceptance_per_position) for r, label in zip(results, method_labels(results))
             if has_acceptance(r)]
    if not lines:
        return None
    with literal_text():
        fig = figure(7, 4.5, layout="constrained")
        ax = fig.add_subplot()
        for label, rates in lines:
            ax.plot(range(len(rates)), rates, marker="o", label=legend_label(label))
        ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.02),
               title="Acceptance per position (greedy; drafts whose token there was accepted / drafts)")
        ax.title.set_fontsize(10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def plot_acceptance(results: Sequence[EvalResult]) -> bytes | None:
    """A PNG of acceptance per position (x: position 0..k-1, y: drafts whose token there was accepted / drafts), one
    line per speculative method that ran; None when there is none."""
    fig = acceptance_figure(results)
    return None if fig is None else png(fig, dpi=120)


def write_eval_outputs(folder: str, results: Sequence[EvalResult]) -> list[str]:
    """Write the tables of the module docstring (acceptance.csv per method, summary.csv, results.json) into `folder`
    (checked and taken by the caller: connectors.outputs); method folders an earlier run of this command left that
    this one does not write are removed. Returns the paths written, acceptance files first. The plot is
    write_eval_plot's, called after: a figure that cannot be drawn never costs the numbers."""
    written = []
    slugs = method_slugs(results)
    for r, slug in zip(results, slugs):
        if has_acceptance(r):
            rows = acceptance_rows(r)
            path = os.path.join(folder, slug, ACCEPTANCE_CSV)
            write_output_file(path, csv_bytes(acceptance_header(len(rows[0]) - len(ACCEPTANCE_COLUMNS)), rows))
            written.append(path)
    keep = {s for r, s in zip(results, slugs) if has_acceptance(r)}
    for name in sorted(os.listdir(folder)):  # stale: a folder holding only an earlier acceptance.csv
        inner = os.path.join(folder, name)
        if name not in keep and os.path.isdir(inner) and os.listdir(inner) == [ACCEPTANCE_CSV]:
            shutil.rmtree(inner)
    path = os.path.join(folder, SUMMARY_CSV)
    write_output_file(path, csv_bytes(SUMMARY_COLUMNS, summary_rows(results)))
    written.append(path)
    path = os.path.join(folder, RESULTS_JSON)
    write_output_file(path, results_json(results))
    written.append(path)
    return written


def write_eval_plot(folder: str, results: Sequence[EvalResult]) -> str | None:
    """DIR/acceptance_per_position.png: its path, or None when no speculative method ran. An earlier run's plot is
    removed first, so a plot that cannot be drawn (this raises then) never leaves another evaluation's picture."""
    path = os.path.join(folder, PLOT_PNG)
    if os.path.isfile(path):
        os.remove(path)
    picture = plot_acceptance(results)
    if picture is None:
        return None
    write_output_file(path, picture)
    return path
