"""The figures of `hsx report`'s page (jobs/report.py), each drawn from the numbers collect() gathered.

    FIGURES                     section name -> draw(data) -> matplotlib Figure, in page order:
        lengths                 prompt and generated-token histograms, stacked per corpus file
        states                  RMS of the stored states by token position per layer; the share of bad rows
        mask_bytes              loss-mask coverage per sampled sample; bytes per token
    RUN_FIGURES                 drawn only for runs that have what they show:
        images                  image-token share per sampled sample (a vision-language target's run)
        failures_throughput     failed samples by reason; tokens committed per second
    plots(data) -> (images, not drawn)   every figure as base64 PNG; one that fails is a reason, never a lost page

Figures sit on Agg's canvas without pyplot (training/plot_text.py), and text from the data (corpus file names,
failure reasons) is drawn as it is: no math, no TeX, a label starting with "_" still shows.
"""

from __future__ import annotations

import base64
import logging
from typing import Any

import numpy as np

from training.plot_text import figure, legend_label, literal_text, png

logger = logging.getLogger(__name__)


def _png(fig) -> str:
    return base64.b64encode(png(fig, dpi=90, bbox_inches="tight")).decode()


def _figure(width: float, height: float):
    """A figure of two axes side by side (training.plot_text.figure: Agg's canvas, no pyplot)."""
    fig = figure(width, height)
    return fig, fig.subplots(1, 2)


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


def _bars(ax, hist: dict[str, Any], label: str | None = None, bottom=None):
    edges = hist["edges"]
    if len(edges) < 2:
        _note(ax, "no data")
        return None
    counts = np.asarray(hist["counts"], dtype=float)
    ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", bottom=bottom, label=label, edgecolor="white")
    return counts


def _draw_lengths(data: dict[str, Any]):
    lengths = data["lengths"]
    fig, axes = _figure(11, 3.4)
    for ax, name, title in ((axes[0], "prompt", "prompt tokens"), (axes[1], "output", "generated tokens")):
        ax.set_title(f"{title} per sample")
        if name == "output" and not data["run"]["max_tokens"]:
            _note(ax, "prompt-only run: no generated tokens")
            continue
        bottom = None
        for f in lengths["files"]:  # corpus file names: data, drawn as they are
            c = _bars(ax, {"edges": lengths[name]["edges"], "counts": lengths[name]["by_file"][f]}, legend_label(f),
                      bottom)
            bottom = c if bottom is None else bottom + c
        ax.set_xlabel("tokens"), ax.set_ylabel("samples")
        if lengths["files"]:
            ax.legend(fontsize=7)
    return fig


def _draw_states(data: dict[str, Any]):
    s = data["states"]
    fig, axes = _figure(11, 3.6)
    for j, label in enumerate(s["labels"]):
        if s["positions"]:
            axes[0].plot(s["positions"], s["rms_by_position"][j], label=legend_label(label),
                         linewidth=2.2 if s["layer_ids"][j] == data["run"]["num_hidden_layers"] else 1.2)
    axes[0].set_yscale("symlog", linthresh=1e-3)
    axes[0].set_title("RMS of the stored states by token position"), axes[0].set_xlabel("token position")
    axes[0].set_ylabel("RMS over the hidden size (mean of samples)"), axes[0].legend(fontsize=7)
    x = np.arange(len(s["layer_ids"]))
    zero = [v or 0 for v in s["zero_row_fraction"]]
    bad = [v or 0 for v in s["nonfinite_row_fraction"]]
    axes[1].bar(x - 0.2, zero, 0.4, label="all-zero rows"), axes[1].bar(x + 0.2, bad, 0.4, label="NaN/Inf rows")
    axes[1].set_xticks(x, [str(i) for i in s["layer_ids"]]), axes[1].set_ylim(0, 1)
    axes[1].set_title("share of bad rows per layer"), axes[1].set_xlabel("layer id"), axes[1].legend(fontsize=7)
    return fig


def _draw_mask_bytes(data: dict[str, Any]):
    s = data["states"]
    fig, axes = _figure(11, 3.2)
    cov = [c for c in s["loss_mask_coverage"] if c is not None]
    if cov:
        axes[0].hist(cov, bins=np.linspace(0, 1, 21), edgecolor="white")
    else:
        _note(axes[0], "no loss masks stored")
    axes[0].set_title("loss-mask coverage per sampled sample"), axes[0].set_xlabel("share of tokens learned")
    _bars(axes[1], data["bytes_per_token"])
    axes[1].set_title("bytes per token per sample"), axes[1].set_xlabel("bytes / token")
    return fig


def _draw_images(data: dict[str, Any]):
    shares = [v for v in data["states"].get("image_token_share", []) if v is not None]
    fig, axes = _figure(11, 3.2)
    if shares:
        axes[0].hist(shares, bins=np.linspace(0, 1, 21), edgecolor="white")
        axes[1].bar(range(len(shares)), sorted(shares, reverse=True))
    else:
        _note(axes[0], "no image tokens")
    axes[0].set_title("image-token share per sampled sample"), axes[0].set_xlabel("share of tokens that are image")
    axes[1].set_title("image-token share, samples by share"), axes[1].set_xlabel("sampled samples")
    return fig


def _draw_failures_throughput(data: dict[str, Any]):
    fig, axes = _figure(11, 3.2)
    failures = data["failures"]
    if failures:  # failure reasons: data (a record's role, a file name), drawn as they are
        names = list(failures)[:12]
        axes[0].barh(range(len(names)), [failures[k] for k in names])
        axes[0].set_yticks(range(len(names)), [k[:40] for k in names], fontsize=7), axes[0].invert_yaxis()
    else:
        _note(axes[0], "no failures")
    axes[0].set_title("failed samples by reason")
    tp = data["throughput"]
    if len(tp["t"]) > 1:
        axes[1].plot(tp["t"], tp["tokens_per_s"])
    else:
        _note(axes[1], "one commit: no rate to draw")
    axes[1].set_title("tokens committed per second"), axes[1].set_xlabel("seconds since the first commit")
    return fig


FIGURES = {"lengths": _draw_lengths, "states": _draw_states, "mask_bytes": _draw_mask_bytes,
           "failures_throughput": _draw_failures_throughput}
"""The page's figures by section name, in page order: every run's."""
RUN_FIGURES = {"images": (_draw_images,
                          lambda data: any(v is not None for v in data["states"].get("image_token_share", [])))}
"""Figures of the runs that have what they show: section name -> (draw, whether a run's data has it)."""


def plots(data: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """(every figure drawn, as base64 PNG by section name; why each figure that could not be drawn was not). One
    figure failing is a warning: the page is still written, that figure replaced by a note."""
    images, failed = {}, {}
    drawn = {**FIGURES, **{name: draw for name, (draw, applies) in RUN_FIGURES.items() if applies(data)}}
    for name, draw in drawn.items():
        try:
            with literal_text():  # text from data (file names, failure reasons) is never math or TeX
                images[name] = _png(draw(data))
        except Exception as e:  # noqa: BLE001 - a figure is a view of numbers the page keeps as JSON
            failed[name] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            logger.warning("report figure %s not drawn: %s", name, failed[name])
            logger.debug("figure %s", name, exc_info=True)
    return images, failed
