"""One export (`hsx export`): a run rewritten into the on-disk layout another drafter trainer reads, checked
before anything is written, resumable.

    ExportSummary                             what an export did: samples, written, skipped, tokens, seconds
    prepare_export(config) -> ExportPlan      every check, before anything is written (a refusal: ValueError)
    execute_export(plan) -> ExportSummary     the work, under DEST's writer lease (a failure: the reader's or the
                                              disk's error, with every file written so far kept for a resume)
    export_run(output, dest, fmt, ...)        both -> ExportSummary; resumes a partial export
    STATE_FILE / JOURNAL_FILE                 DEST's completion marker and the journal of an export under way

The run stores id N pre-norm, as vLLM does. For the post-norm formats a pre-norm run needs the target model's final
norm: from --model-dir, else the run's model when it is a local folder; otherwise the export is refused (never a
silent pre-norm "hidden_state"). A run that stored the last layer post-norm cannot be exported for speculators (the
norm cannot be undone). Every format needs the last stored id to be N. States stored in fp8 (or another storage
dtype) pass through as stored to speculators, which reads fp8 with its scales, and are dequantized to the model
dtype for the others.

A run that an `hsx run` writes now (connectors.lease.snapshot_writer) is refused, naming the writer, unless --snapshot:
then what it has committed so far is exported and DEST/hsx_export.json says so ("snapshot": true, the writer).

Streaming: one sample in memory at a time (`num_workers` reads ahead in DataLoader workers, bounded). Every file is
written through `files.put` (temp name in its folder, fsync, rename), so a file under its final name is complete.
DEST/hsx_export.json is the completion marker, written last (atomically) once every file and index exists; it
lists every file it claims with the sample id and manifest checksum it was written from. While an export is under
way (or after one was interrupted) there is no marker but DEST/hsx_export.partial.jsonl, a journal of the files
written whole so far. A re-run resumes: a file is kept when the marker or the journal records it from the sample's
current id and checksum and it holds the sample's token count; every other file is written again (a re-extracted
sample's too), the files of samples no longer in the run are removed, and the marker is written again last.
A DEST holding an export of another format or run is refused; a DEST written by an older hsx (a marker without the
file list) is redone whole.
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

from connectors.lease import snapshot_writer
from connectors.outputs import OutputFolder
from connectors.paths import safe_file_stem
from connectors.run import RunDir, RunSpec
from extractor.norm import FinalNorm
from training.dataset import RUN_COMPARED, HiddenStatesDataset
from training.export import files
from training.export.config import FORMATS, ExportConfig
from training.export.modelopt import ModelOptLayout
from training.export.specforge import SpecForgeLayout
from training.export.speculators import SpeculatorsLayout

__all__ = ["FORMATS", "ExportConfig", "ExportPlan", "ExportSummary", "execute_export", "export_run",
           "prepare_export"]

logger = logging.getLogger(__name__)

STATE_FILE = "hsx_export.json"
"""The completion marker: the export's settings and every file it claims, written after all of them."""
JOURNAL_FILE = "hsx_export.partial.jsonl"
"""An export under way (or interrupted): the files written whole so far (files.Journal). Removed at completion."""


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
    removed: int = 0
    """Files of samples no longer in the run (an earlier export of a smaller snapshot), removed."""
    tokens: int = 0
    """Tokens over all samples."""
    seconds: float = 0.0
    """Wall time of the call."""
    snapshot: str | None = None
    """The live writer of the run, described, when --snapshot exported what it had committed so far."""


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


@dataclass
class _Record:
    """What DEST holds of an earlier export: its settings, the files known whole, whether it completed."""

    state: dict[str, Any]
    files: dict[str, list] | None
    """relpath -> [sample id, source checksum]; None for a marker of an older hsx (no file list: redo all)."""
    complete: bool


def _read_record(dest: str) -> _Record | None:
    """DEST's journal when an export is under way there, else its completion marker, else None."""
    journal = files.read_journal(os.path.join(dest, JOURNAL_FILE))
    if journal is not None:
        header, entries = journal
        return _Record(header, entries, complete=False)
    path = os.path.join(dest, STATE_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        doc = None
    if not isinstance(doc, dict):
        return _Record({}, None, complete=False)  # unreadable: nothing in DEST is trusted, everything is redone
    listed = doc.pop("files", None)
    return _Record(doc, listed if isinstance(listed, dict) else None, complete=isinstance(listed, dict))


def _export_state(config: ExportConfig, ds: HiddenStatesDataset, snapshot: str | None) -> dict[str, Any]:
    """The export's settings as its marker records them (without the file list)."""
    ids_digest = hashlib.sha256()
    for i in range(0, len(ds), 65536):
        chunk = ds.sample_ids.slice(i, 65536)
        ids_digest.update("\n".join(chunk.to_pylist()).encode())
    ids_digest.update(ds.num_tokens.tobytes())
    run = {name: getattr(ds.run_info, name) for name in RUN_COMPARED}
    state = {"format": config.format, "source": config.output, "samples": len(ds),
             "sample_set_sha256": ids_digest.hexdigest(), "run": {**run, "layer_ids": list(run["layer_ids"])},
             "snapshot": snapshot is not None}
    if snapshot is not None:
        state["snapshot_writer"] = snapshot
    return state


def _check_state(config: ExportConfig, state: dict[str, Any], record: _Record | None) -> None:
    """Refuse a DEST holding an export of another format or run (or, written by an older hsx, another sample set)."""
    if record is None or not record.state:
        return
    old = record.state
    keys = ("format", "run") + (("samples", "sample_set_sha256") if record.files is None else ())
    clash = {k: old.get(k) for k in keys if old.get(k) != state[k]}
    if clash:
        raise ValueError(f"{config.dest} holds an export that differs from this one in {sorted(clash)} "
                         f"({ {k: v for k, v in clash.items() if k != 'run'} } before); the run or format "
                         "changed since it began — export into an empty DEST, or remove this one")


def _relpath_problem(rel: str) -> bool:
    return not rel or os.path.isabs(rel) or os.path.normpath(rel) != rel or rel.startswith("..")


@dataclass
class ExportPlan:
    """One export, checked (prepare_export) and ready to run (execute_export)."""

    config: ExportConfig
    out: OutputFolder
    """DEST, checked; opened (created, leased) by execute_export."""
    ds: HiddenStatesDataset
    layout: Layout
    snapshot: str | None
    """The run's live writer, described, when --snapshot exports what it committed so far."""
    state: dict[str, Any]
    """What the marker will record (besides the file list)."""
    started: float


def prepare_export(config: ExportConfig) -> ExportPlan:
    """Every check of an export, before anything is written: DEST (never the run, the model, inside either, another
    command's folder), a live writer of the run (refused unless --snapshot), the run's format, the norm's model,
    DEST's earlier export. ValueError (or FileNotFoundError) naming the fix."""
    start = time.perf_counter()
    output, dest, fmt = config.output, config.dest, config.format
    out = OutputFolder(dest, command="export", flag="DEST", inputs={"OUTPUT": output, "--model-dir": config.model_dir},
                       legacy_markers=(STATE_FILE, JOURNAL_FILE), break_lease=config.break_lease)
    out.check()  # before reading the run: DEST is never the run, the model, inside either, or another's folder
    snapshot = snapshot_writer(RunDir(output, config.storage_options), snapshot=config.snapshot,
                               what=f"OUTPUT {output}", harm="an export would hold only the samples committed so far",
                               doing=f"export what it has committed now ({STATE_FILE} then says so)")
    # the peers' layouts hold no image embeddings: a run stored without --mm-embeds exports too (placeholder)
    probe = HiddenStatesDataset(output, storage_options=config.storage_options, include_sample_id=False,
                                image_inputs="placeholder")
    layout = _LAYOUTS[fmt](dest, probe.run_info)
    norm_dir = _check_run(config, probe.run_info, layout)
    if norm_dir is not None:
        FinalNorm.from_model_dir(norm_dir)  # fail before writing anything
        out.inputs["model"] = norm_dir  # the run's own model when --model-dir is not given: checked by open()
    # an image run's loss mask goes out 0 at image tokens; the peers' layouts hold no image embeddings
    ds = HiddenStatesDataset(output, storage_options=config.storage_options, layout=layout.dataset_layout,
                             normalize_last_layer=layout.needs_post_norm, model_dir=norm_dir,
                             dequantize=not layout.stored_states, image_inputs="placeholder")
    if fmt == "modelopt":
        stems: dict[str, int] = {}
        for i in range(len(ds)):
            stem = safe_file_stem(ds.sample_id(i))
            if stem in stems:
                raise ValueError(f"sample ids {ds.sample_id(stems[stem])!r} and {ds.sample_id(i)!r} map to the same "
                                 f"file name {stem}.pt")
            stems[stem] = i
    state = _export_state(config, ds, snapshot)
    _check_state(config, state, _read_record(dest))
    return ExportPlan(config, out, ds, layout, snapshot, state, start)


def execute_export(plan: ExportPlan, progress: Callable[[ExportSummary], None] | None = None) -> ExportSummary:
    """Write the export under DEST's writer lease (see the module docstring); `progress(summary)` after every file.
    A failure (a damaged sample, a full disk) raises the reader's or the disk's error; every file written whole so
    far is in the journal, and a re-run resumes from it."""
    with plan.out.open():  # one writer per DEST; a refused export leaves no DEST behind
        return _export(plan, progress)


def export_run(output: str, dest: str, fmt: str, *, model_dir: str | None = None,
               storage_options: dict | None = None, num_workers: int = 0,
               progress: Callable[[ExportSummary], None] | None = None, break_lease: bool = False,
               snapshot: bool = False) -> ExportSummary:
    """Write the run at `output` into `dest` in `fmt`'s layout; resumes a partial export. See the module docstring.

    `progress(summary)` is called after every file written."""
    config = ExportConfig(output=output, dest=dest, format=fmt, model_dir=model_dir,
                          storage_options=dict(storage_options or {}), num_workers=num_workers,
                          break_lease=break_lease, snapshot=snapshot)
    return execute_export(prepare_export(config), progress)


def _checksum(ds: HiddenStatesDataset, index: int) -> str | None:
    """The manifest row's checksum of sample `index` (None for a run without checksums: then the sample id and
    token count alone say whether an exported file is current)."""
    return ds._checksums[index].as_py()  # the dataset's own copy of the rows it reads (no second manifest read)


def _export(plan: ExportPlan, progress: Callable[[ExportSummary], None] | None) -> ExportSummary:
    config, ds, layout, out = plan.config, plan.ds, plan.layout, plan.out
    output, dest, fmt = config.output, config.dest, config.format
    record = _read_record(dest)  # again, under the lease: another export may have finished meanwhile
    _check_state(config, plan.state, record)
    known = (record.files if record is not None else None) or {}

    summary = ExportSummary(format=fmt, dest=dest, samples=len(ds), tokens=int(ds.num_tokens.sum()),
                            snapshot=plan.snapshot)
    claims: dict[str, list] = {}  # relpath -> [sample id, checksum], in sample order: what the marker will list
    todo, kept = [], []
    for i in range(len(ds)):
        sid = ds.sample_id(i)
        rel = layout.relpath(i, sid)
        claims[rel] = [sid, _checksum(ds, i)]
        path = os.path.join(dest, rel)
        if known.get(rel) == claims[rel] and os.path.exists(path) and layout.is_complete(path,
                                                                                       int(ds.num_tokens[i])):
            summary.skipped += 1
            kept.append([rel, *claims[rel]])
        else:
            todo.append(i)
    stale = sorted(rel for rel in known if rel not in claims and not _relpath_problem(rel))
    marker = {**plan.state, "files": claims}
    if record is not None and record.complete and not todo and not stale and record.state == plan.state:
        summary.seconds = time.perf_counter() - plan.started
        return summary  # complete and current: nothing to write
    logger.info("export %s -> %s (%s): %d samples, %d already done", output, dest, fmt, len(ds), summary.skipped)

    journal = files.Journal(os.path.join(dest, JOURNAL_FILE))
    journal.start(plan.state, kept)  # before any file changes; then DEST reads as partial until the marker is back
    try:
        files.remove(os.path.join(dest, STATE_FILE))
        for rel in stale:  # samples the run no longer holds (an earlier, smaller snapshot)
            files.remove(os.path.join(dest, rel))
            summary.removed += 1
        for i, item in zip(todo, _read_ahead(ds, todo, config.num_workers)):
            if summary.written % 256 == 0:
                out.check_lease()
            rel = layout.relpath(i, ds.sample_id(i))
            layout.write(os.path.join(dest, rel), item)
            journal.add(rel, *claims[rel])
            summary.written += 1
            if progress is not None:
                progress(summary)
        out.check_lease()
        layout.on_export_complete(ds)
        files.put(os.path.join(dest, STATE_FILE), _marker_bytes(marker))  # last: the export is complete
    finally:
        journal.close()
    files.remove(journal.path)
    summary.seconds = time.perf_counter() - plan.started
    return summary


def _marker_bytes(marker: dict[str, Any]) -> bytes:
    """The marker as JSON: its settings indented, then its file list one file a line."""
    head = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in marker.items() if k != "files"]
    listed = [f"    {json.dumps(rel)}: {json.dumps(v)}" for rel, v in marker["files"].items()]
    return ("{\n" + ",\n".join([*head, '  "files": {\n' + ",\n".join(listed) + "\n  }"]) + "\n}\n").encode()


def _read_ahead(ds: HiddenStatesDataset, indices: list[int], num_workers: int) -> Iterator[dict[str, Any]]:
    """Items in `indices` order, read by `num_workers` DataLoader workers (bounded prefetch) or inline."""
    if num_workers == 0:
        for i in indices:
            yield ds[i]
        return
    from torch.utils.data import DataLoader, Subset

    loader = DataLoader(Subset(ds, indices), batch_size=None, num_workers=num_workers, prefetch_factor=2)
    yield from loader
