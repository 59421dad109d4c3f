"""Export: rewrite an extraction run into the on-disk layout another drafter trainer reads (`hsx export`).

    ExportConfig (config.py)                  one export: OUTPUT, DEST, format, model dir, storage options, workers
                                              (no torch import: the CLI builds its flags from it)
    ExportSummary                             what an export did: samples, written, skipped, tokens, seconds
    export_run(output, dest, fmt, ...)        the export -> ExportSummary; resumes a partial one
    FORMATS                                   the layouts, one module each:
        speculators.py   SpeculatorsLayout    hidden_states/hs_{i}.safetensors (last layer PRE-norm; an fp8 run's
                                              states and scales as stored) + Arrow dataset
        specforge.py     SpecForgeLayout      rows_{a}-{b}/data_{i}.ckpt (hidden_state POST-norm)
        modelopt.py      ModelOptLayout       {sample_id}.pt (hidden_states POST-norm)
    files.py                                  put (the one atomic durable write, on the local disk), read-back checks

The run stores id N pre-norm, as vLLM does. For the post-norm formats a pre-norm run needs the target model's final
norm: from --model-dir, else the run's model when it is a local folder; otherwise the export is refused (never a
silent pre-norm "hidden_state"). A run that stored the last layer post-norm cannot be exported for speculators (the
norm cannot be undone). Every format needs the last stored id to be N. States stored in fp8 (or another storage
dtype) pass through as stored to speculators, which reads fp8 with its scales, and are dequantized to the model
dtype for the others.

Streaming: one sample in memory at a time (`num_workers` reads ahead in DataLoader workers, bounded). Resumable:
every file is written through `files.put` (temp name in its folder, fsync, rename), so a file under its final name
is complete; a re-run skips samples whose file exists with the right token count and rewrites only the rest.
DEST/hsx_export.json records what was exported; resuming a DEST from another run, format or sample set is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from connectors.outputs import OutputFolder
from connectors.paths import safe_file_stem
from connectors.run import RunSpec
from extractor.norm import FinalNorm
from training.dataset import RUN_COMPARED, HiddenStatesDataset
from training.export import files
from training.export.config import FORMATS, ExportConfig
from training.export.modelopt import ModelOptLayout
from training.export.specforge import SpecForgeLayout
from training.export.speculators import SpeculatorsLayout

__all__ = ["FORMATS", "ExportConfig", "ExportSummary", "export_run"]

logger = logging.getLogger(__name__)

STATE_FILE = "hsx_export.json"


@dataclass
class ExportSummary:
    """What one export_run call did."""

    format: str
    """The layout written."""
    dest: str
    """Where it was written."""
    samples: int = 0
    """Samples in the export (all "ok" samples of the run)."""
    written: int = 0
    """Files written by this invocation."""
    skipped: int = 0
    """Files already complete from an earlier invocation."""
    tokens: int = 0
    """Tokens over all samples."""
    seconds: float = 0.0
    """Wall time of the call."""


class Layout(Protocol):
    """One trainer's on-disk layout. Called in this order:

        relpath(index, sample_id)   where sample `index` goes, relative to DEST
        is_complete(path, n)        whether an existing file there already holds that sample (n tokens)
        write(path, item)           write one sample (an EAGLE-3 item of HiddenStatesDataset; hidden_states for
                                    speculators, as stored when `stored_states`) — through files.put, so a file
                                    under its final name is complete
        on_export_complete(ds)      after every sample file exists: write the index files, if the layout has any
    """

    dataset_layout: str
    needs_post_norm: bool
    stored_states: bool
    """Take states as the run stores them (fp8 beside its scales), not dequantized to the model dtype."""

    def relpath(self, index: int, sample_id: str) -> str: ...
    def is_complete(self, path: str, num_tokens: int) -> bool: ...
    def write(self, path: str, item: dict[str, Any]) -> None: ...
    def on_export_complete(self, ds: HiddenStatesDataset) -> None: ...


_LAYOUTS: dict[str, Callable[[str, RunSpec], Layout]] = {
    "speculators": SpeculatorsLayout, "specforge": SpecForgeLayout, "modelopt": ModelOptLayout}


# -- the export -------------------------------------------------------------------------------------------------


def _check_run(config: ExportConfig, run: RunSpec, layout: Layout) -> str | None:
    """Refuse runs the format cannot represent; return the model dir for the final norm, if one is needed."""
    n, last = run.num_hidden_layers, run.layer_ids[-1]
    if run.target_top_k is not None:
        raise ValueError(f"{config.format}'s layout stores the last layer's hidden state (id {n}), which this run "
                         f"kept only as a {run.target} target (its top-{run.target_top_k} next-token "
                         "log-probabilities); train on the run with `hsx train-drafter --kind eagle3`, or re-extract "
                         f"with --target states and id {n} in --layers to export it")
    if len(run.layer_ids) < 2:
        raise ValueError(f"the run stores only layer {list(run.layer_ids)}; {config.format} needs aux layers and the "
                         "last layer (extract e.g. --layers 2,N/2,N-3,N)")
    if last != n:
        raise ValueError(f"{config.format} trains against the last layer (id {n}), but the run's last stored id is "
                         f"{last} (layers {list(run.layer_ids)}); extract with id {n} last")
    if not layout.needs_post_norm:
        if run.last_layer_normalized:
            raise ValueError(f"{config.format} expects the last layer pre-norm, but this run stored it after the "
                             "final norm, which cannot be undone; re-extract without normalising the last layer")
        return None
    if run.last_layer_normalized:
        return None
    if config.model_dir is not None:
        return config.model_dir
    if run.model and os.path.isfile(os.path.join(run.model, "config.json")):
        return run.model
    raise ValueError(f"{config.format} stores the last layer after the model's final norm, and this run stored it "
                     f"pre-norm; pass --model-dir with the target model's local folder (the run records model "
                     f"{run.model!r}, which is not a local folder) so hsx can apply the norm")


def _check_state(config: ExportConfig, ds: HiddenStatesDataset) -> dict[str, Any]:
    """DEST's record of this export; refuses a DEST holding an export of another run, format or sample set."""
    ids_digest = hashlib.sha256()
    for i in range(0, len(ds), 65536):
        chunk = ds.sample_ids.slice(i, 65536)
        ids_digest.update("\n".join(chunk.to_pylist()).encode())
    ids_digest.update(ds.num_tokens.tobytes())
    run = {name: getattr(ds.run_info, name) for name in RUN_COMPARED}
    state = {"format": config.format, "source": config.output, "samples": len(ds),
             "sample_set_sha256": ids_digest.hexdigest(), "run": {**run, "layer_ids": list(run["layer_ids"])}}
    path = os.path.join(config.dest, STATE_FILE)
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        clash = {k: (old.get(k), v) for k, v in state.items() if k != "source" and old.get(k) != v}
        if clash:
            raise ValueError(f"{config.dest} holds an export that differs from this one in {sorted(clash)} "
                             f"({ {k: v[0] for k, v in clash.items() if k != 'run'} } before); the run or format "
                             "changed since it began — export into an empty DEST, or remove this one")
    return state


def export_run(output: str, dest: str, fmt: str, *, model_dir: str | None = None,
               storage_options: dict | None = None, num_workers: int = 0,
               progress: Callable[[ExportSummary], None] | None = None, break_lease: bool = False) -> ExportSummary:
    """Write the run at `output` into `dest` in `fmt`'s layout; resumes a partial export. See the module docstring.

    `progress(summary)` is called after every file written."""
    config = ExportConfig(output=output, dest=dest, format=fmt, model_dir=model_dir,
                          storage_options=dict(storage_options or {}), num_workers=num_workers,
                          break_lease=break_lease)
    start = time.perf_counter()
    out = OutputFolder(dest, command="export", flag="DEST", inputs={"OUTPUT": output, "--model-dir": model_dir},
                       legacy_markers=(STATE_FILE,), break_lease=break_lease)
    out.check()  # before reading the run: DEST is never the run, the model, inside either, or another's folder
    probe = HiddenStatesDataset(output, storage_options=config.storage_options, include_sample_id=False)
    layout = _LAYOUTS[fmt](dest, probe.run_info)
    norm_dir = _check_run(config, probe.run_info, layout)
    if norm_dir is not None:
        FinalNorm.from_model_dir(norm_dir)  # fail before writing anything
        out.inputs["model"] = norm_dir  # the run's own model when --model-dir is not given: checked by open()
    ds = HiddenStatesDataset(output, storage_options=config.storage_options, layout=layout.dataset_layout,
                             normalize_last_layer=layout.needs_post_norm, model_dir=norm_dir,
                             dequantize=not layout.stored_states)
    if fmt == "modelopt":
        stems: dict[str, int] = {}
        for i in range(len(ds)):
            stem = safe_file_stem(ds.sample_id(i))
            if stem in stems:
                raise ValueError(f"sample ids {ds.sample_id(stems[stem])!r} and {ds.sample_id(i)!r} map to the same "
                                 f"file name {stem}.pt")
            stems[stem] = i

    with out.open():  # one writer per DEST; a refused export leaves no DEST behind
        return _export(config, ds, layout, out, start, progress)


def _export(config: ExportConfig, ds: HiddenStatesDataset, layout: Layout, out: OutputFolder, start: float,
            progress: Callable[[ExportSummary], None] | None) -> ExportSummary:
    output, dest, fmt = config.output, config.dest, config.format
    state = _check_state(config, ds)
    files.put(os.path.join(dest, STATE_FILE), json.dumps(state, indent=2).encode())

    summary = ExportSummary(format=fmt, dest=dest, samples=len(ds), tokens=int(ds.num_tokens.sum()))
    todo = []
    for i in range(len(ds)):
        path = os.path.join(dest, layout.relpath(i, ds.sample_id(i)))
        if os.path.exists(path) and layout.is_complete(path, int(ds.num_tokens[i])):
            summary.skipped += 1
        else:
            todo.append(i)
    logger.info("export %s -> %s (%s): %d samples, %d already done", output, dest, fmt, len(ds), summary.skipped)
    for i, item in zip(todo, _read_ahead(ds, todo, config.num_workers)):
        if summary.written % 256 == 0:
            out.check_lease()
        layout.write(os.path.join(dest, layout.relpath(i, ds.sample_id(i))), item)
        summary.written += 1
        if progress is not None:
            progress(summary)
    out.check_lease()
    layout.on_export_complete(ds)
    summary.seconds = time.perf_counter() - start
    return summary


def _read_ahead(ds: HiddenStatesDataset, indices: list[int], num_workers: int) -> Iterator[dict[str, Any]]:
    """Items in `indices` order, read by `num_workers` DataLoader workers (bounded prefetch) or inline."""
    if num_workers == 0:
        for i in indices:
            yield ds[i]
        return
    from torch.utils.data import DataLoader, Subset

    loader = DataLoader(Subset(ds, indices), batch_size=None, num_workers=num_workers, prefetch_factor=2)
    yield from loader
