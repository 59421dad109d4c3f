"""`hsx export`: rewrite an extraction run into the on-disk layout another drafter trainer reads.

    register(subparsers)                      adds `export` to the `hsx` CLI (args.func(args) -> exit code)
    export_run(output, dest, fmt, ...)        the same from Python -> ExportSummary

Formats, and the last-layer convention each trainer expects (the run stores id N pre-norm, as vLLM does):

    speculators   DEST/hidden_states/hs_{i}.safetensors   token_ids [T], hidden_states [T, L, H] (all stored layers,
                                                          last one PRE-norm: speculators' vLLM-based generator stores
                                                          it so, and its trainer applies the verifier's norm itself),
                                                          plus loss_mask [T] (an extra key its loader ignores)
                  DEST/ (a `datasets.save_to_disk` folder) input_ids, loss_mask, seq_len; row i <-> hs_{i}
    specforge     DEST/rows_{a}-{b}/data_{i}.ckpt         torch.save of input_ids [T], loss_mask [T],
                                                          hidden_state [1, T, H] POST-norm (SpecForge's generator
                                                          saves the input of SGLang's logits processor, i.e. after the
                                                          final norm, and its trainer feeds it to the LM head as is),
                                                          aux_hidden_state [1, T, (L-1)*H]; folders of 2000 rows
    modelopt      DEST/{conversation_id}.pt               torch.save of input_ids [T], hidden_states [T, H] POST-norm
                                                          (ModelOpt's generator saves HF's `last_hidden_state`),
                                                          aux_hidden_states [T, (L-1)*H], loss_mask [T],
                                                          conversation_id (the sample id)

For the post-norm formats a pre-norm run needs the target model's final norm: from --model-dir, else the run's
model when it is a local folder; otherwise the export is refused (never a silent pre-norm "hidden_state"). A run
that stored the last layer post-norm cannot be exported for speculators (the norm cannot be undone). Every format
needs the last stored id to be N.

Streaming: one sample in memory at a time (`--num-workers` reads ahead in DataLoader workers, bounded). Resumable:
every file is written to a temp name in its folder and renamed, so a file that exists is complete; a re-run skips
samples whose file exists with the right token count and rewrites only the rest. DEST/hsx_export.json records what
was exported; resuming a DEST from another run, format or sample set is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import pyarrow as pa
import torch

from connectors.dataset import FinalNorm, HiddenStatesDataset, RunInfo
from connectors.paths import safe_file_stem

logger = logging.getLogger(__name__)

FORMATS = ("speculators", "specforge", "modelopt")
STATE_FILE = "hsx_export.json"
SPECFORGE_ROWS_PER_FOLDER = 2000
ARROW_BATCH_ROWS = 1024


@dataclass(frozen=True)
class ExportConfig:
    """One `hsx export` invocation."""

    output: str
    """The run: an extraction OUTPUT folder or URL (holds run.json and manifest/)."""
    dest: str
    """Local folder to write the trainer's layout into; created if missing, resumed if it holds a partial export."""
    fmt: str
    """Target layout: one of FORMATS."""
    model_dir: str | None = None
    """Local folder of the target model, for its final norm (specforge/modelopt from a pre-norm run)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for reading the run (endpoint_url, credentials, ...)."""
    num_workers: int = 0
    """DataLoader worker processes reading samples ahead of the writer (0: read in the writing process)."""

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown export format {self.fmt!r}; choose one of {list(FORMATS)} (--format)")
        if "://" in str(self.dest):
            raise ValueError(f"DEST {self.dest!r} must be a local folder (trainers read these layouts from disk)")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")


@dataclass
class ExportSummary:
    fmt: str
    dest: str
    samples: int = 0
    """Samples in the export (all "ok" samples of the run)."""
    written: int = 0
    """Files written by this invocation."""
    skipped: int = 0
    """Files already complete from an earlier invocation."""
    tokens: int = 0
    seconds: float = 0.0


# -- atomic local writes ----------------------------------------------------------------------------------------


def write_atomic(path: str, write: Callable[[str], None]) -> None:
    """`write(tmp)` into a temp file beside `path`, then rename: `path` is whole or absent, never partial."""
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


# -- the formats ------------------------------------------------------------------------------------------------


class Layout(Protocol):
    """One trainer's on-disk layout. Called in this order:

        relpath(index, sample_id)   where sample `index` goes, relative to DEST
        is_complete(path, n)        whether an existing file there already holds that sample (n tokens)
        write(path, item)           write one sample (an EAGLE-3 item of HiddenStatesDataset; hidden_states for
                                    speculators) — through write_atomic
        on_export_complete(ds)      after every sample file exists: write the index files, if the layout has any
    """

    dataset_layout: str
    needs_post_norm: bool

    def relpath(self, index: int, sample_id: str) -> str: ...
    def is_complete(self, path: str, num_tokens: int) -> bool: ...
    def write(self, path: str, item: dict[str, Any]) -> None: ...
    def on_export_complete(self, ds: HiddenStatesDataset) -> None: ...


def _torch_file_tokens(path: str, key: str) -> int | None:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(obj[key].shape[-1])
    except Exception:  # noqa: BLE001 - any unreadable file is rewritten
        return None


@dataclass
class SpeculatorsLayout:
    dest: str
    run: RunInfo
    dataset_layout: str = "raw"
    needs_post_norm: bool = False

    def relpath(self, index: int, sample_id: str) -> str:
        return f"hidden_states/hs_{index}.safetensors"

    def is_complete(self, path: str, num_tokens: int) -> bool:
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as f:
                return f.get_slice("token_ids").get_shape() == [num_tokens]
        except Exception:  # noqa: BLE001 - any unreadable file is rewritten
            return False

    def write(self, path: str, item: dict[str, Any]) -> None:
        import safetensors.torch

        tensors = {"token_ids": item["input_ids"].contiguous(),  # [T] int64
                   "hidden_states": item["hidden_states"].contiguous(),  # [T, L, H], last layer pre-norm
                   "loss_mask": item["loss_mask"].contiguous()}  # [T]
        meta = {"format": "speculators", "layer_ids": json.dumps(list(self.run.layer_ids)),
                "layer_id_convention": self.run.layer_id_convention, "last_layer_normalized": "false",
                "model": self.run.model, "sample_id": str(item["sample_id"])}
        write_atomic(path, lambda tmp: safetensors.torch.save_file(tensors, tmp, metadata=meta))

    def on_export_complete(self, ds: HiddenStatesDataset) -> None:
        """The `datasets.save_to_disk` folder: one Arrow stream file plus its JSON sidecars, rows in hs_{i} order."""
        from safetensors import safe_open

        features = {"input_ids": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "Sequence"},
                    "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "Sequence"},
                    "seq_len": {"dtype": "int64", "_type": "Value"}}
        schema = pa.schema([("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())),
                            ("seq_len", pa.int64())],
                           metadata={"huggingface": json.dumps({"info": {"features": features}})})
        data_file = "data-00000-of-00001.arrow"
        digest = hashlib.sha256()

        def rows() -> Iterator[pa.RecordBatch]:
            ids, masks, lens = [], [], []
            for i in range(len(ds)):
                with safe_open(os.path.join(self.dest, self.relpath(i, "")), framework="pt") as f:
                    tok, mask = f.get_tensor("token_ids"), f.get_tensor("loss_mask")
                ids.append(tok.tolist())
                masks.append(mask.tolist())
                lens.append(len(tok))
                digest.update(tok.numpy().tobytes())
                if len(ids) == ARROW_BATCH_ROWS or i == len(ds) - 1:
                    yield pa.record_batch([pa.array(ids, pa.list_(pa.int64())), pa.array(masks, pa.list_(pa.int64())),
                                           pa.array(lens, pa.int64())], schema=schema)
                    ids, masks, lens = [], [], []

        def write_stream(tmp: str) -> None:
            with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
                for batch in rows():
                    writer.write_batch(batch)

        write_atomic(os.path.join(self.dest, data_file), write_stream)
        info = {"citation": "", "description": f"hsx export of {self.run.model or 'a run'} for speculators",
                "features": features, "homepage": "", "license": ""}
        state = {"_data_files": [{"filename": data_file}], "_fingerprint": digest.hexdigest()[:16],
                 "_format_columns": None, "_format_kwargs": {}, "_format_type": "torch",
                 "_output_all_columns": False, "_split": None}
        for name, doc in (("dataset_info.json", info), ("state.json", state)):
            text = json.dumps(doc, indent=2)
            write_atomic(os.path.join(self.dest, name), lambda tmp, text=text: _write_text(tmp, text))


@dataclass
class SpecForgeLayout:
    dest: str
    run: RunInfo
    dataset_layout: str = "eagle3"
    needs_post_norm: bool = True

    def relpath(self, index: int, sample_id: str) -> str:
        a = index // SPECFORGE_ROWS_PER_FOLDER * SPECFORGE_ROWS_PER_FOLDER
        return f"rows_{a}-{a + SPECFORGE_ROWS_PER_FOLDER}/data_{index}.ckpt"

    def is_complete(self, path: str, num_tokens: int) -> bool:
        return _torch_file_tokens(path, "input_ids") == num_tokens

    def write(self, path: str, item: dict[str, Any]) -> None:
        obj = {"input_ids": item["input_ids"],  # [T] int64
               "loss_mask": item["loss_mask"],  # [T] int64
               "hidden_state": item["target_hidden_states"][None].contiguous(),  # [1, T, H] post-norm
               "aux_hidden_state": item["aux_hidden_states"][None].contiguous()}  # [1, T, (L-1)*H]
        write_atomic(path, lambda tmp: torch.save(obj, tmp))

    def on_export_complete(self, ds: HiddenStatesDataset) -> None:
        pass


@dataclass
class ModelOptLayout:
    dest: str
    run: RunInfo
    dataset_layout: str = "eagle3"
    needs_post_norm: bool = True

    def relpath(self, index: int, sample_id: str) -> str:
        return f"{safe_file_stem(sample_id)}.pt"

    def is_complete(self, path: str, num_tokens: int) -> bool:
        return _torch_file_tokens(path, "input_ids") == num_tokens

    def write(self, path: str, item: dict[str, Any]) -> None:
        obj = {"input_ids": item["input_ids"],  # [T] int64
               "hidden_states": item["target_hidden_states"].contiguous(),  # [T, H] post-norm
               "aux_hidden_states": item["aux_hidden_states"].contiguous(),  # [T, (L-1)*H]
               "loss_mask": item["loss_mask"],  # [T] int64
               "conversation_id": str(item["sample_id"])}
        write_atomic(path, lambda tmp: torch.save(obj, tmp))

    def on_export_complete(self, ds: HiddenStatesDataset) -> None:
        pass


_LAYOUTS = {"speculators": SpeculatorsLayout, "specforge": SpecForgeLayout, "modelopt": ModelOptLayout}


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


# -- the export -------------------------------------------------------------------------------------------------


def _check_run(config: ExportConfig, run: RunInfo, layout: Layout) -> str | None:
    """Refuse runs the format cannot represent; return the model dir for the final norm, if one is needed."""
    n, last = run.num_hidden_layers, run.layer_ids[-1]
    if len(run.layer_ids) < 2:
        raise ValueError(f"the run stores only layer {list(run.layer_ids)}; {config.fmt} needs aux layers and the "
                         "last layer (extract e.g. --layers 2,N/2,N-3,N)")
    if last != n:
        raise ValueError(f"{config.fmt} trains against the last layer (id {n}), but the run's last stored id is "
                         f"{last} (layers {list(run.layer_ids)}); extract with id {n} last")
    if not layout.needs_post_norm:
        if run.last_layer_normalized:
            raise ValueError(f"{config.fmt} expects the last layer pre-norm, but this run stored it after the final "
                             "norm, which cannot be undone; re-extract without normalising the last layer")
        return None
    if run.last_layer_normalized:
        return None
    if config.model_dir is not None:
        return config.model_dir
    if run.model and os.path.isfile(os.path.join(run.model, "config.json")):
        return run.model
    raise ValueError(f"{config.fmt} stores the last layer after the model's final norm, and this run stored it "
                     f"pre-norm; pass --model-dir with the target model's local folder (the run records model "
                     f"{run.model!r}, which is not a local folder) so hsx can apply the norm")


def _check_state(config: ExportConfig, ds: HiddenStatesDataset) -> dict[str, Any]:
    ids_digest = hashlib.sha256()
    for i in range(0, len(ds), 65536):
        chunk = ds.sample_ids.slice(i, 65536)
        ids_digest.update("\n".join(chunk.to_pylist()).encode())
    ids_digest.update(ds.num_tokens.tobytes())
    state = {"format": config.fmt, "source": config.output, "samples": len(ds),
             "sample_set_sha256": ids_digest.hexdigest(), "run": {**asdict(ds.run_info),
                                                                  "layer_ids": list(ds.run_info.layer_ids)}}
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
               progress: Callable[[ExportSummary], None] | None = None) -> ExportSummary:
    """Write the run at `output` into `dest` in `fmt`'s layout; resumes a partial export. See the module docstring."""
    config = ExportConfig(output=output, dest=dest, fmt=fmt, model_dir=model_dir,
                          storage_options=dict(storage_options or {}), num_workers=num_workers)
    start = time.perf_counter()
    probe = HiddenStatesDataset(output, storage_options=config.storage_options, include_sample_id=False)
    layout: Layout = _LAYOUTS[fmt](dest, probe.run_info)
    norm_dir = _check_run(config, probe.run_info, layout)
    if norm_dir is not None:
        FinalNorm.from_model_dir(norm_dir)  # fail before writing anything
    ds = HiddenStatesDataset(output, storage_options=config.storage_options, layout=layout.dataset_layout,
                             normalize_last_layer=layout.needs_post_norm, model_dir=norm_dir)
    if fmt == "modelopt":
        stems = {}
        for i in range(len(ds)):
            stem = safe_file_stem(ds.sample_id(i))
            if stem in stems:
                raise ValueError(f"sample ids {ds.sample_id(stems[stem])!r} and {ds.sample_id(i)!r} map to the same "
                                 f"file name {stem}.pt")
            stems[stem] = i

    os.makedirs(dest, exist_ok=True)
    state = _check_state(config, ds)
    write_atomic(os.path.join(dest, STATE_FILE), lambda tmp: _write_text(tmp, json.dumps(state, indent=2)))

    summary = ExportSummary(fmt=fmt, dest=dest, samples=len(ds), tokens=int(ds.num_tokens.sum()))
    todo = []
    for i in range(len(ds)):
        path = os.path.join(dest, layout.relpath(i, ds.sample_id(i)))
        if os.path.exists(path) and layout.is_complete(path, int(ds.num_tokens[i])):
            summary.skipped += 1
        else:
            todo.append(i)
    logger.info("export %s -> %s (%s): %d samples, %d already done", output, dest, fmt, len(ds), summary.skipped)
    for i, item in zip(todo, _read_ahead(ds, todo, config.num_workers)):
        layout.write(os.path.join(dest, layout.relpath(i, ds.sample_id(i))), item)
        summary.written += 1
        if progress is not None:
            progress(summary)
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


# -- CLI --------------------------------------------------------------------------------------------------------


def register(subparsers) -> argparse.ArgumentParser:
    """Add `export` to the `hsx` CLI's subparsers; the parsed args carry `func(args) -> exit code`."""
    p = subparsers.add_parser(
        "export", help="write a run in the layout of speculators, SpecForge or ModelOpt",
        description="Rewrite an extraction run (OUTPUT, with run.json and manifest/) into DEST in the on-disk layout "
                    "another drafter trainer reads. Streaming (one sample at a time) and resumable (re-run the same "
                    "command after an interruption: finished samples are skipped).")
    p.add_argument("output", metavar="OUTPUT", help="the run's output folder or URL (holds manifest/)")
    p.add_argument("dest", metavar="DEST", help="local folder to write the exported layout into")
    p.add_argument("--format", dest="fmt", required=True, choices=FORMATS, help="target trainer's layout")
    p.add_argument("--model-dir", default=None,
                   help="target model's local folder, for its final norm (specforge/modelopt need the last layer "
                        "post-norm; default: the run's model when it is a local folder)")
    p.add_argument("--storage-options", type=json.loads, default={}, metavar="JSON",
                   help='fsspec options for OUTPUT, e.g. \'{"client_kwargs": {"endpoint_url": "http://..."}}\'')
    p.add_argument("--num-workers", type=int, default=0, help="processes reading samples ahead of the writer")
    p.set_defaults(func=_run_cli)
    return p


def _run_cli(args: argparse.Namespace) -> int:
    last = [time.monotonic()]  # report every 5 s, not at the first sample

    def progress(s: ExportSummary) -> None:
        now = time.monotonic()
        if now - last[0] >= 5:
            last[0] = now
            print(f"  {s.written + s.skipped}/{s.samples} samples", file=sys.stderr, flush=True)

    try:
        s = export_run(args.output, args.dest, args.fmt, model_dir=args.model_dir,
                       storage_options=args.storage_options, num_workers=args.num_workers, progress=progress)
    except (ValueError, FileNotFoundError) as e:
        print(f"hsx export: error: {e}", file=sys.stderr)
        return 2
    print(f"exported {s.samples} samples ({s.tokens} tokens) to {s.dest} as {s.fmt}: {s.written} written, "
          f"{s.skipped} already done, {s.seconds:.1f}s")
    return 0
