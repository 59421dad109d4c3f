"""`hsx report OUTPUT`: one self-contained HTML page that shows a run, so that silently wrong states are seen before
hours of training rather than after.

    ReportConfig(output, out="report.html", sample=64, ...)   jobs/report_config.py; the CLI's flags map onto it
    collect(config) -> dict        the numbers behind every plot, and the checks ("flags") they raise
    plots(data) -> (images, not drawn)   every figure as PNG (jobs/report_figures.py); one that fails is a note,
                                         never a lost page
    render(data) -> str            the page: matplotlib plots as embedded PNGs, the numbers as embedded JSON
    check_page_path(path, spec, output)  where a page may go: not the run, its model or a corpus file; an existing
                                         file only an earlier page
    write_report(config) -> (path, data)
    read_report_data(page) -> dict the numbers embedded in a page

What it reads: run.json, the manifest (every row: lengths, bytes, failures, commit times), the newest `hsx verify`
report, and the files of `sample` committed samples drawn at random (seeded) — nothing else, so a report of a 10 TB
run on s3 reads a few MB. Local folders and any fsspec URL (s3://, gs://) alike.

The page (opens offline: no script, font or image is fetched from anywhere):
  checks             what looks wrong, each with what to do (the "flags" below)
  lengths            prompt and generated-token histograms, per corpus file
  loss mask          the share of tokens each sampled sample's mask covers
  states             per layer, the RMS of the stored states by token position (the last layer and the aux layers on
                     one chart: a post-norm last layer labelled pre-norm sits flat at the norm's scale; a dead layer
                     at zero), and per layer the share of rows that are all zero or hold NaN/Inf
  bytes per token    per committed sample (manifest bytes / tokens)
  failures           by reason; verify: the newest `hsx verify` report
  throughput         tokens committed per second over the run's time (commit times of the manifest rows)
The numbers are in the page as JSON (<script type="application/json" id="hsx-report-data">; "<", ">" and "&" are
JSON escapes such as \\u003c, so no text from the data can end the script element): tests and scripts read them
without parsing pictures. Text from the data in a figure (corpus file names, failure reasons) is drawn as it is
(training/plot_text.py: `$` is no math, a label starting with "_" still shows).

What it trusts: the page goes to a local file that is not the run, its model or a corpus file run.json lists; an
existing file is replaced only when it is an earlier page (it begins with PAGE_START). A run that a live `hsx run`
writes (connectors.lease.snapshot_writer) is refused unless --snapshot, which draws the rows committed at that moment
and says so on the page (a banner, data["snapshot"]).

Checks (each a {"check", "severity", "message"} in data["flags"]):
  dead_layer        a stored layer is all zeros (RMS 0) or most of its rows are: the capture hook sits on the wrong
                    module, or a hybrid model's layer has no residual stream there
  nonfinite_rows    rows holding NaN or Inf
  last_layer_norm   the last layer's per-token RMS is flat (coefficient of variation below 0.08 and under a third of
                    the other layers'): it went through the model's final norm, while run.json says pre-norm (hsx and
                    vLLM store layer N before the norm; an EAGLE-3 trainer then applies the norm twice); or the
                    opposite: labelled post-norm, yet it varies like the other layers
  loss_mask         every sampled mask covers 0% of tokens (nothing to learn) or 100% (chat templates not masking)
  lengths_cut       a fifth or more of the generated answers stopped at --max-tokens, or of the samples have the
                    same, longest, length: a cut at one value
  failures / verify / not_verified   failed samples, a verify report with failures, a run never verified
"""

from __future__ import annotations

import html
import json
import logging
import math
import os
import posixpath
import random
import re
import time
from typing import Any

import numpy as np

from cluster.progress import human_bytes, human_count
from connectors import storage
from connectors.format import HIDDEN_STATES, LOSS_MASK, MM_TOKEN_TYPE_IDS
from connectors.lease import snapshot_writer
from connectors.manifest import committed_rows, read_manifest, row_path_problem, sample_range
from connectors.manifest_writer import summarize
from connectors.outputs import check_output_file, write_output_file
from connectors.run import RunDir, RunFormatError, read_run_spec
from jobs.report_config import ReportConfig
from jobs.report_figures import FIGURES, RUN_FIGURES, plots
from jobs.verify import latest_report

logger = logging.getLogger(__name__)

DATA_ELEMENT_ID = "hsx-report-data"
FLAT_CV = 0.08
"""A layer whose per-token RMS varies less than this (coefficient of variation) and under a third of the other
stored layers' is flat: normalized. Measured: RMSNorm with weight 1 (a fresh model) gives 0; the 2.1M reference
target's trained final norm (weights 1.39 +- 0.14) 0.029, its pre-norm last layer 0.145 and an aux layer 0.113."""


# -- the numbers ------------------------------------------------------------------------------------------------------


def collect(config: ReportConfig) -> dict[str, Any]:
    """The numbers behind the page; ValueError when OUTPUT holds no readable run, or a run a live writer holds
    without config.snapshot."""
    run = RunDir(config.output, config.storage_options)
    writer = snapshot_writer(run, snapshot=config.snapshot, what=run.url, harm="a report would show a moment of it",
                             doing="draw the rows committed so far")
    taken_at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    try:
        spec = read_run_spec(run)
        if spec is None:
            raise ValueError(f"{run.url} holds no hsx run (no run.json); check the path")
        table = read_manifest(run)
        summary = summarize(run, table=table)
    except RunFormatError as e:
        raise ValueError(str(e)) from e
    ok = committed_rows(table) if table.num_rows else table
    n = spec.num_hidden_layers
    data: dict[str, Any] = {
        "run": {"url": run.url, "model": spec.model, "layer_ids": list(spec.layer_ids), "num_hidden_layers": n,
                "last_layer_normalized": spec.last_layer_normalized, "dtype": spec.dtype,
                "storage_dtype": spec.storage_dtype, "storage_layout": spec.storage_layout,
                "max_tokens": spec.max_tokens, "max_model_len": spec.max_model_len, "created_at": spec.created_at,
                "target": spec.target},
        "counts": {"ok": summary.ok, "failed": summary.failed, "skipped": summary.skipped,
                   "invalid": summary.invalid, "truncated": summary.truncated, "tokens": summary.tokens,
                   "bytes": summary.bytes, "manifest_rows": summary.rows, "attempts": summary.attempts},
        "snapshot": None if writer is None else {"writer": writer, "taken_at": taken_at},
    }
    rows = ok.select(["sample_id", "path", "num_tokens", "num_prompt_tokens", "bytes", "source", "offset",
                      "committed_at", "checksum"]).to_pylist() if ok.num_rows else []
    data["lengths"] = _lengths(rows)
    data["bytes_per_token"] = _histogram([r["bytes"] / r["num_tokens"] for r in rows
                                          if r["bytes"] and r["num_tokens"]])
    data["failures"] = summary.error_kinds  # failed samples by reason, as `hsx status` counts them
    data["verify"] = _verify_summary(latest_report(run))
    data["throughput"] = _throughput(rows)
    picked = random.Random(config.seed).sample(rows, min(config.sample, len(rows)))
    data["states"] = _states(run, spec, picked, config.max_positions)
    data["flags"] = _flags(data)
    return data


def _corpus_file(source: str | None) -> str:
    """The corpus file a manifest row's `source` names ("url:line" of JSONL, "url#row" of Parquet)."""
    if not source:
        return "(unknown)"
    return posixpath.basename(re.sub(r"(:\d+|#\d+)$", "", source)) or source


def _histogram(values, bins: int = 30) -> dict[str, Any]:
    """{"edges", "counts", "n", "mean", "min", "max"} of `values` (empty lists when there are none)."""
    v = np.asarray(list(values), dtype=np.float64)
    if not v.size:
        return {"edges": [], "counts": [], "n": 0, "mean": None, "min": None, "max": None}
    counts, edges = np.histogram(v, bins=min(bins, max(1, len(np.unique(v)))))
    return {"edges": edges.tolist(), "counts": counts.tolist(), "n": int(v.size), "mean": float(v.mean()),
            "min": float(v.min()), "max": float(v.max())}


def _lengths(rows: list[dict]) -> dict[str, Any]:
    """Prompt / generated token counts per corpus file (histograms on shared bins), and how many share the longest."""
    prompt = [int(r["num_prompt_tokens"] if r["num_prompt_tokens"] is not None else r["num_tokens"]) for r in rows]
    output = [int(r["num_tokens"]) - p for r, p in zip(rows, prompt)]
    files = [_corpus_file(r["source"]) for r in rows]
    out: dict[str, Any] = {"files": sorted(set(files))}
    for name, values in (("prompt", prompt), ("output", output)):
        edges = np.histogram_bin_edges(values or [0], bins=min(30, max(1, len(set(values)))))
        out[name] = {"edges": edges.tolist(), "by_file": {
            f: np.histogram([v for v, g in zip(values, files) if g == f], bins=edges)[0].tolist()
            for f in out["files"]}}
    total = [int(r["num_tokens"]) for r in rows]
    longest = max(total) if total else 0
    out["longest"] = longest
    out["at_longest"] = sum(1 for t in total if t == longest)
    out["samples"] = len(total)
    longest_output = max(output) if output else 0
    out["longest_output"] = longest_output
    out["outputs_at_longest"] = sum(1 for o in output if o == longest_output) if longest_output else 0
    return out


def _verify_summary(report: dict | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return {"started_at": report.get("started_at"), "checked": report.get("checked"),
            "failures": len(report.get("failures", [])), "recomputed": len(report.get("recomputed", []) or []),
            "kinds": report.get("kinds") or {}}


def _throughput(rows: list[dict], bins: int = 40) -> dict[str, Any]:
    """Tokens and samples committed per second over the run's time, from the rows' commit times."""
    times = [(r["committed_at"].timestamp(), int(r["num_tokens"])) for r in rows if r["committed_at"] is not None]
    if not times:
        return {"t": [], "tokens_per_s": [], "samples_per_s": [], "seconds": 0.0}
    t = np.array([a for a, _ in times])
    tok = np.array([b for _, b in times], dtype=np.float64)
    start, span = float(t.min()), float(t.max() - t.min())
    if span <= 0:  # one commit: no rate over time to draw
        return {"t": [0.0], "tokens_per_s": [None], "samples_per_s": [None], "seconds": 0.0}
    width = span / bins
    idx = np.minimum(((t - start) / width).astype(int), bins - 1)
    tokens = np.bincount(idx, weights=tok, minlength=bins) / width
    samples = np.bincount(idx, minlength=bins) / width
    return {"t": [(i + 0.5) * width for i in range(bins)], "tokens_per_s": tokens.tolist(),
            "samples_per_s": samples.tolist(), "seconds": span}


def _layer_label(layer_id: int, n: int, normalized: bool) -> str:
    if layer_id == n:
        return f"{layer_id} = N, last ({'post' if normalized else 'pre'}-norm per run.json)"
    return f"{layer_id} (aux)" if layer_id else "0 (embeddings)"


def _states(run, spec, rows: list[dict], max_positions: int) -> dict[str, Any]:
    """Per stored layer: RMS by token position (mean over the sampled files), the coefficient of variation of the
    per-token RMS, the share of all-zero and of non-finite rows; per sampled file its loss-mask coverage. A file that
    cannot be read is listed with its error (the report goes on)."""
    import torch  # torch and connectors.reader (which imports it) load when a report is drawn, not with the CLI

    from connectors.reader import read_rows  # torch: loads when a report is drawn (the line above)

    ids = list(spec.layer_ids)
    layers = len(ids)
    sums = np.zeros((layers, max_positions))
    counts = np.zeros(max_positions)
    token_rms: list[list[np.ndarray]] = [[] for _ in ids]
    zero = np.zeros(layers)
    nonfinite = np.zeros(layers)
    rows_seen = 0
    coverage, unread, image_share = [], [], []
    fs, _ = storage.open_url(run.url, run.storage_options)
    for r in rows:
        rel = r["path"]
        if (problem := row_path_problem(rel)) is not None:
            unread.append({"sample_id": r["sample_id"], "error": problem})
            continue
        try:
            _, t = read_rows(fs, run.path(rel), None, verify=False, names=(HIDDEN_STATES, LOSS_MASK, MM_TOKEN_TYPE_IDS),
                             dtype=torch.float32, byte_range=sample_range(r["offset"], r["bytes"]))
            hs = t.get(HIDDEN_STATES)
            if hs is None or hs.dim() != 3 or hs.shape[1] != layers:
                raise ValueError(f"its hidden_states are {None if hs is None else list(hs.shape)}, not [T, {layers}, "
                                 "H] as run.json's layer ids say (a file from another run?)")
        except Exception as e:  # noqa: BLE001 - a damaged, missing or foreign file is reported, the rest still drawn
            unread.append({"sample_id": r["sample_id"], "error": f"{type(e).__name__}: {e}"})
            continue
        hs = hs.to(torch.float32)  # [T, L, H]
        finite = torch.isfinite(hs).all(dim=-1)  # [T, L]
        nonfinite += (~finite).sum(dim=0).numpy()
        zero += (hs == 0).all(dim=-1).sum(dim=0).numpy()
        rows_seen += hs.shape[0]
        rms = torch.where(finite, hs.nan_to_num(0.0, 0.0, 0.0).pow(2).mean(dim=-1).sqrt(),
                          torch.tensor(float("nan"))).numpy()  # [T, L]
        for j in range(layers):
            token_rms[j].append(rms[:, j][np.isfinite(rms[:, j])])
        p = min(max_positions, rms.shape[0])
        sums[:, :p] += np.nan_to_num(rms[:p].T)
        counts[:p] += 1
        if LOSS_MASK in t:
            coverage.append(float(t[LOSS_MASK].to(torch.float32).mean()) if t[LOSS_MASK].numel() else 0.0)
        else:
            coverage.append(None)
        types = t.get(MM_TOKEN_TYPE_IDS)  # an image prompt's marks (a vision-language target's run)
        image_share.append(None if types is None else float((types != 0).to(torch.float32).mean()) if types.numel()
                           else 0.0)
    used = int((counts > 0).sum())
    by_position = (sums[:, :used] / np.maximum(counts[:used], 1)).tolist()
    cv, mean_rms = [], []
    for j in range(layers):
        v = np.concatenate(token_rms[j]) if token_rms[j] else np.zeros(0)
        mean = float(v.mean()) if v.size else None
        mean_rms.append(mean)
        cv.append(float(v.std() / v.mean()) if v.size > 1 and v.mean() > 0 else None)
    return {"layer_ids": ids, "labels": [_layer_label(i, spec.num_hidden_layers, spec.last_layer_normalized)
                                         for i in ids],
            "sampled": len(rows) - len(unread), "unread": unread, "rows": rows_seen,
            "positions": list(range(used)), "rms_by_position": by_position, "mean_rms": mean_rms, "token_rms_cv": cv,
            "zero_row_fraction": (zero / rows_seen).tolist() if rows_seen else [None] * layers,
            "nonfinite_row_fraction": (nonfinite / rows_seen).tolist() if rows_seen else [None] * layers,
            "loss_mask_coverage": coverage, "image_token_share": image_share}


def _flags(data: dict[str, Any]) -> list[dict[str, str]]:
    """What looks wrong, from the numbers; each with what to do."""
    flags = []

    def flag(check: str, severity: str, message: str) -> None:
        flags.append({"check": check, "severity": severity, "message": message})

    s, run = data["states"], data["run"]
    n, normalized = run["num_hidden_layers"], run["last_layer_normalized"]
    for i, lid in enumerate(s["layer_ids"]):
        zero, bad, mean = s["zero_row_fraction"][i], s["nonfinite_row_fraction"][i], s["mean_rms"][i]
        if zero is not None and (zero > 0.5 or (mean is not None and mean == 0)):
            flag("dead_layer", "error", f"layer {lid}: {zero:.0%} of the sampled rows are all zeros (RMS "
                 f"{mean or 0:.3g}): nothing is captured there — check the layer ids against the model (a hybrid "
                 "model's attention-free layers, a hook on the wrong module), then re-extract")
        if bad:
            flag("nonfinite_rows", "error", f"layer {lid}: {bad:.2%} of the sampled rows hold NaN or Inf — run "
                 "`hsx verify` to mark those samples and re-run the job (or --on-nonfinite skip)")
    cvs = dict(zip(s["layer_ids"], s["token_rms_cv"]))
    if n in cvs and cvs[n] is not None:
        others = [c for lid, c in cvs.items() if lid != n and c is not None and c > 0]
        ref = float(np.median(others)) if others else None
        flat = cvs[n] < FLAT_CV and (ref is None or cvs[n] < ref / 3)
        if flat and not normalized:
            versus = f" (the other layers' by {ref:.0%})" if ref is not None else ""
            flag("last_layer_norm", "error", f"layer {n} (the last) has a flat magnitude: its per-token RMS varies "
                 f"by {cvs[n]:.2%}{versus} — it looks normalized (after the model's final norm), while run.json "
                 "says pre-norm. hsx and vLLM store layer N before the final norm and trainers apply the norm "
                 "themselves (twice, here): re-extract with the pre-norm state, or record last_layer_normalized")
        elif normalized and ref is not None and cvs[n] >= max(FLAT_CV * 1.5, ref / 2):
            flag("last_layer_norm", "warning", f"layer {n} is labelled post-norm, yet its per-token RMS varies by "
                 f"{cvs[n]:.0%} like the other layers' ({ref:.0%}): it looks pre-norm")
    cov = [c for c in s["loss_mask_coverage"] if c is not None]
    if cov and max(cov) == 0:
        flag("loss_mask", "error", f"every sampled loss mask covers 0% of its tokens ({len(cov)} samples): a "
             "trainer learns nothing from them — check the chat template's assistant markers")
    elif cov and min(cov) == 1 and len(cov) >= 2:
        flag("loss_mask", "warning", f"every sampled loss mask covers 100% of its tokens ({len(cov)} samples): "
             "fine for plain text; for chats, the mask is not separating assistant turns")
    lengths, n = data["lengths"], data["lengths"]["samples"]
    max_tokens = run["max_tokens"]
    # a sample stores its prompt and the generated tokens but the last (whose state the target never computed)
    if n >= 5 and max_tokens and lengths["longest_output"] in (max_tokens, max_tokens - 1) and \
            lengths["outputs_at_longest"] >= max(2, n / 5):
        flag("lengths_cut", "warning", f"{lengths['outputs_at_longest']} of {n} generated answers "
             f"({lengths['outputs_at_longest'] / n:.0%}) stopped at --max-tokens {max_tokens}: cut, not finished "
             "(fine when the run wants fixed-length continuations; otherwise raise --max-tokens)")
    elif n >= 5 and lengths["at_longest"] >= max(2, n / 5):
        flag("lengths_cut", "warning", f"{lengths['at_longest']} of {n} samples ({lengths['at_longest'] / n:.0%}) "
             f"have exactly the longest length, {lengths['longest']} tokens: lengths cut at one value "
             f"({data['counts']['truncated']} truncated by --max-model-len / --overlength truncate)")
    if data["counts"]["failed"]:
        flag("failures", "warning", f"{data['counts']['failed']} samples failed (see failures by reason); re-run "
             "the job to retry them, or fix the records")
    v = data["verify"]
    if v is None:
        flag("not_verified", "info", "never verified: `hsx verify OUTPUT` checks every file's checksum and header "
             "and recomputes a few states with a plain transformers forward")
    elif v["failures"]:
        flag("verify", "error", f"the newest hsx verify ({v['started_at']}) found {v['failures']} bad samples; "
             "re-run the job to re-extract them")
    if s["unread"]:
        flag("unread", "error", f"{len(s['unread'])} sampled files could not be read (first: "
             f"{s['unread'][0]['sample_id']}: {s['unread'][0]['error'][:200]}) — run `hsx verify`")
    return flags


# -- the page -------------------------------------------------------------------------------------------------------


_CSS = """body{font-family:sans-serif;margin:2em;max-width:1100px}h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left;font-size:.9em}
.error{color:#b00020}.warning{color:#9a6700}.info{color:#555}.ok{color:#1a7f37}img{max-width:100%}"""


PAGE_START = ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
              '<meta name="generator" content="hsx report">')
"""How every page hsx report writes begins: --out overwrites an existing file only when it begins so."""
_LEGACY_PAGE_START = '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>hsx report: '
"""How pages began before the generator marker (hsx report wrote them too)."""


def embedded_json(data: dict[str, Any]) -> str:
    """`data` as JSON that a browser's HTML parser cannot end or bend inside <script>: "<", ">" and "&" as \\u escapes
    (a failure reason holding "<!--<script>" or "</script>" stays a string); json.loads reads it back as it was."""
    return (json.dumps(data, default=str, allow_nan=False)
            .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


def render(data: dict[str, Any], images: dict[str, str] | None = None) -> str:
    """The page: the checks, the plots (embedded PNGs; a figure that could not be drawn is a note naming why), the
    run's facts, a banner when it is a snapshot of a run being written, and `data` as embedded JSON."""
    if images is None:
        images, failed = plots(data)
        data = {**data, "figures_not_drawn": failed}
    e = html.escape
    run, c = data["run"], data["counts"]
    checks = "".join(f'<li class="{e(f["severity"])}"><b>{e(f["severity"])}</b> [{e(f["check"])}] {e(f["message"])}'
                     "</li>" for f in data["flags"]) or '<li class="ok">nothing looks wrong in what was sampled</li>'
    facts = [("run", run["url"]), ("model", run["model"]), ("layer ids", run["layer_ids"]),
             ("last layer", f"{run['num_hidden_layers']} ({'post' if run['last_layer_normalized'] else 'pre'}-norm)"),
             ("dtype", run["dtype"] + (f", stored as {run['storage_dtype']}" if run["storage_dtype"] else "")),
             ("samples", f"{c['ok']} ok, {c['failed']} failed, {c['skipped']} skipped, {c['invalid']} invalid, "
                         f"{c['truncated']} truncated"),
             ("data", f"{human_count(c['tokens'])} tokens, {human_bytes(c['bytes'])}"),
             ("sampled files", f"{data['states']['sampled']} ({data['states']['rows']} rows)")]
    v = data["verify"]
    verify = ("never verified (hsx verify OUTPUT)" if v is None else
              f"{v['started_at']}: {v['checked']} checked, {v['failures']} failed, {v['recomputed']} recomputed")
    rows = "".join(f"<tr><th>{e(k)}</th><td>{e(str(val))}</td></tr>" for k, val in facts)
    not_drawn = data.get("figures_not_drawn") or {}
    img = {k: f'<img alt="{e(k)}" src="data:image/png;base64,{images[k]}">' if k in images else
           f'<p class="error figure-not-drawn">figure not drawn ({e(not_drawn.get(k, "no image"))}); its numbers are '
           "in the page's JSON</p>" for k in (*FIGURES, *(k for k in RUN_FIGURES if k in images or k in not_drawn))}
    snapshot = data.get("snapshot")
    banner = ("" if not snapshot else
              f'<p id="snapshot" class="warning"><b>snapshot</b>: this run was being written when this page was made '
              f'(by {e(snapshot["writer"])}); it shows the rows committed at {e(snapshot["taken_at"])}, and more may '
              "have come since</p>")
    shares = [v for v in data["states"].get("image_token_share", []) if v is not None]
    images_section = ("" if not shares else
                      f"<h2>Image tokens</h2><p>Share of each sampled sample's tokens that are image tokens (a "
                      f"vision-language target's run): mean {sum(shares) / len(shares):.1%} over {len(shares)} "
                      f"samples; the loss mask is 0 there.</p>{img.get('images', '')}")
    return f"""{PAGE_START}<title>hsx report: {e(run['url'])}</title><style>{_CSS}</style></head>
<body><h1>hsx report</h1>{banner}<table>{rows}<tr><th>verify</th><td>{e(verify)}</td></tr></table>
<h2>Checks</h2><ul id="checks">{checks}</ul>
<h2>Lengths</h2>{img['lengths']}
<h2>States</h2><p>The last layer and the aux layers on one chart: a post-norm last layer labelled pre-norm sits flat;
a dead layer at zero.</p>{img['states']}
<h2>Loss mask and bytes per token</h2>{img['mask_bytes']}{images_section}
<h2>Failures and throughput</h2>{img['failures_throughput']}
<script type="application/json" id="{DATA_ELEMENT_ID}">{embedded_json(data)}</script>
</body></html>
"""


def _json_safe(obj):
    """NaN / Inf as null (the page's JSON must parse in a browser)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


PAGE_STARTS = (PAGE_START.encode(), _LEGACY_PAGE_START.encode())
"""How a page hsx report wrote begins: an existing --out is replaced only when it begins so."""


def check_page_path(path: str, spec, output: str) -> str:
    """The resolved `path` once it may take a page: connectors.outputs.check_output_file's rules (never the run, its
    model, inside either; an existing file only when it is a page hsx report wrote), a corpus file run.json lists
    named as such (whatever the spelling: symlinks resolved); ValueError otherwise."""
    resolved = os.path.realpath(os.path.expanduser(str(path)))
    for c in spec.corpus if spec is not None else ():
        if "://" not in str(c) and os.path.realpath(os.path.expanduser(str(c))) == resolved:
            raise ValueError(f"--out {resolved} is the corpus file {c} that run.json lists; writing there would "
                             "overwrite it — pick another --out path")
    model = {"the run's model": spec.model} if spec is not None and spec.model else {}
    return check_output_file(path, flag="--out", inputs={"OUTPUT": output, **model}, ours=PAGE_STARTS,
                             command="report")


def write_report(config: ReportConfig) -> tuple[str, dict[str, Any]]:
    """Collect, draw and write the page to config.out, checked before any work: never over the run, its model or a
    corpus file run.json lists, and over an existing file only when it is an earlier page of hsx report. A figure
    that cannot be drawn is a note on the page (data["figures_not_drawn"] says why), never a lost page."""

    try:
        spec = read_run_spec(RunDir(config.output, config.storage_options))
    except RunFormatError as e:
        raise ValueError(str(e)) from e
    path = check_page_path(config.out, spec, config.output)
    data = _json_safe(collect(config))
    images, data["figures_not_drawn"] = plots(data)
    write_output_file(path, render(data, images).encode())
    return path, data


def read_report_data(page: str) -> dict[str, Any]:
    """The numbers embedded in a report page (what tests and scripts read)."""
    m = re.search(rf'<script type="application/json" id="{DATA_ELEMENT_ID}">(.*?)</script>', page, re.S)
    if m is None:
        raise ValueError("not an hsx report page (no embedded data)")
    return json.loads(m.group(1))  # \u003c and (older pages') <\/ are JSON escapes
