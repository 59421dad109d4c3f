"""Building extraction runs for the training-feed tests, through the real connector (no mocks).

    Sample                          one sample's tensors
    random_samples(n, spec, ...)    random states of varied lengths (a loss mask on some, none on others)
    oracle_samples(model_dir, ...)  states from a plain transformers forward of a tiny model (the oracle)
    write_run(output, samples, spec, ...)   files via KVTransferConfig(...).create_connector(spec), the manifest
                                            (each row with the file's size and header checksum, as the job
                                            records them) and run.json via connectors.run: an `hsx run` OUTPUT
    spec_run_json(spec) -> RunSpec          the run.json of a run whose files carry `spec`
    write_manifest(output, rows, parts=)    rows as manifest parts (connectors.manifest.write_manifest_part)
    prompt_only_worker(model, run, **settings) -> ExtractionWorker   a job's worker on a tiny model (layers 1, 4,
                                            float32, CPU, prompt-only) writing into `run`, whose run.json it writes
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from connectors import HiddenStatesSpec, KVTransferConfig, RequestInfo
from connectors.folders import MANIFEST_DIR
from connectors.header import read_header
from connectors.manifest import manifest_parts, write_manifest_part
from connectors.run import RunDir, RunSpec, write_run_spec
from connectors.storage import open_url


@dataclass
class Sample:
    sample_id: str
    token_ids: torch.Tensor  # [T] int64
    hidden_states: torch.Tensor  # [T, L, H]
    loss_mask: torch.Tensor | None = None  # [T] 0/1
    extra: dict[str, torch.Tensor] | None = None  # further per-token tensors (a top-k target's [T, K])

# the oracle run's layers in the 4-layer tiny model: ids 1, 2 (aux) and 4 = N, the last decoder layer, stored pre-norm
ORACLE_LAYERS = (1, 2, 4)


def random_samples(n: int, spec: HiddenStatesSpec, *, seed: int = 0, min_len: int = 3, max_len: int = 40,
                   with_mask_every: int = 2) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    out = []
    for i in range(n):
        t = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(0, 500, (t,), generator=g, dtype=torch.int64)
        states = torch.randn(t, len(spec.layer_ids), spec.hidden_size, generator=g).to(dtype)
        mask = (torch.rand(t, generator=g) > 0.3).to(torch.uint8) if i % with_mask_every == 0 else None
        out.append(Sample(f"s{i:05d}", ids, states, mask))
    return out


def pre_norm_hidden_states(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """All N+1 hidden states of one sequence [T, H] in vLLM's ids: 0 = embeddings, k = output of decoder layer k-1,
    N = the last decoder layer's output *before* the final norm (HF's own hidden_states[N] is post-norm)."""
    captured = {}

    def hook(module, args, output):
        captured["last"] = output[0] if isinstance(output, tuple) else output

    handle = model.model.layers[-1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model(input_ids[None], output_hidden_states=True)
    finally:
        handle.remove()
    states = [h[0] for h in out.hidden_states[:-1]]
    return [*states, captured["last"][0]]


def oracle_samples(model, texts: Sequence[str], tokenizer, layer_ids: Sequence[int]) -> list[Sample]:
    """Samples whose states come from a plain transformers forward of `model` (float32)."""
    out = []
    for i, text in enumerate(texts):
        ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64)
        all_states = pre_norm_hidden_states(model, ids)
        states = torch.stack([all_states[k] for k in layer_ids], dim=1)  # [T, L, H]
        mask = torch.zeros(len(ids), dtype=torch.uint8)
        mask[len(ids) // 2:] = 1
        out.append(Sample(f"text-{i:03d}", ids, states.contiguous(), mask))
    return out


def write_run(output: str, samples: Sequence[Sample], spec: HiddenStatesSpec, *,
              storage_options: dict | None = None, run_json: bool | RunSpec = True,
              extra_rows: Sequence[dict] = (), files_per_folder: int = 4, manifest_parts: int = 1,
              check_states: bool = True) -> list[dict]:
    """Write `samples` as an hsx run at `output`; return the manifest rows written.

    run_json: True writes spec_run_json(spec); a RunSpec is written as is; False writes none.
    extra_rows: further manifest rows (e.g. failed samples, duplicates) appended after the ok rows.
    check_states: False writes NaN/Inf states as they are (as an older hsx, or a writer with the check off, did).
    """
    options = dict(storage_options or {})
    config = KVTransferConfig(kv_connector_extra_config={
        "shared_storage_path": output, "allow_custom_save_path": True, "storage_options": options,
        "check_states": check_states})
    connector = config.create_connector(spec)
    fs, root = open_url(output, options)
    rows = []
    for i, s in enumerate(samples):
        rel = f"data/{i // files_per_folder:04d}/{s.sample_id}.safetensors"
        rid = f"req-{s.sample_id}"
        t = s.token_ids.shape[0]
        connector.start_request(RequestInfo(request_id=rid, num_prompt_tokens=t, sample_id=s.sample_id,
                                            kv_transfer_params={"hidden_states_path": rel}, loss_mask=s.loss_mask))
        cut = t // 2  # two chunks, as a chunked prefill delivers them
        extra = s.extra or {}
        connector.save_hidden_states(rid, s.token_ids[:cut], s.hidden_states[:cut],
                                     {k: v[:cut] for k, v in extra.items()} or None)
        connector.save_hidden_states(rid, s.token_ids[cut:], s.hidden_states[cut:],
                                     {k: v[cut:] for k, v in extra.items()} or None)
        connector.request_finished(rid)
        rows.append({"sample_id": s.sample_id, "path": rel, "num_tokens": t, "num_prompt_tokens": t,
                     "status": "ok", "error": None, "bytes": 0})
    failures = connector.wait_for_save()
    connector.shutdown()
    assert not failures, failures
    for row in rows:  # as the job records them: each file's size and the data checksum its header carries
        data = fs.cat_file(posixpath.join(root, row["path"]))
        row["bytes"] = len(data)
        row["checksum"] = read_header(row["path"], len(data), lambda a, b, d=data: d[a:b])[0].checksum
    rows += list(extra_rows)
    write_manifest(output, rows, storage_options=options, parts=manifest_parts)
    if run_json is not False:
        write_run_spec(RunDir(output, options), run_json if isinstance(run_json, RunSpec) else spec_run_json(spec))
    return rows


def spec_run_json(spec: HiddenStatesSpec) -> RunSpec:
    """The run.json of a run whose files carry `spec` (what the offline API alone knows: no job fields)."""
    return RunSpec.from_file_spec(spec)


def write_manifest(output: str, rows: Sequence[dict], *, storage_options: dict | None = None, parts: int = 1,
                   attempt: str = "test") -> None:
    """The manifest as `parts` part files under OUTPUT/manifest/ (rows split in order), through the job's own part
    writer; a second call with the same `attempt` replaces the parts of the first."""
    run = RunDir(output, storage_options)
    for name in manifest_parts(run):
        if name.startswith(f"part-{attempt}-"):  # a part's name carries its bytes' checksum: remove, then write
            run.fs.rm(run.path(f"{MANIFEST_DIR}/{name}"))
    per = -(-len(rows) // parts) if rows else 0
    for p in range(parts):
        write_manifest_part(run, list(rows[p * per:(p + 1) * per]), attempt, p)


def tree_digest(folder: str, *, dirs: bool = False) -> dict[str, str]:
    """relative path -> sha256 of every file under `folder`, a symlink as "-> its target" (not followed), and with
    `dirs` every folder as "dir": what a test compares before and after a command that must change nothing."""
    out = {}
    for d, subdirs, names in os.walk(folder):
        for name in names + subdirs:
            path = os.path.join(d, name)
            rel = os.path.relpath(path, folder)
            if os.path.islink(path):
                out[rel] = "-> " + os.readlink(path)
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
            elif dirs:
                out[rel] = "dir"
    return out


def small_train_config(run, model, out, **kw):
    """A TrainDrafterConfig of a few CPU steps on a small run (EAGLE-3 by default), `kw` over it."""
    from training.train_config import TrainDrafterConfig

    defaults = dict(run=str(run), model=str(model), out=str(out), kind="eagle3", steps=2, lr=3e-3, batch_tokens=64,
                    draft_vocab_size=48, checkpoint_every=2, device="cpu", progress=False)
    return TrainDrafterConfig(**{**defaults, **kw})


def prompt_only_worker(model: str, run: RunDir, **settings):
    """An `hsx run` worker (jobs.worker.ExtractionWorker) of the tiny 4-layer, 64-wide `model`: layers 1 and 4 in
    float32 on the CPU, prompt-only, writing into `run` (its run.json written here); `settings`: further
    WorkerSettings (engine_kind=, engine_settings=, ...)."""
    from connectors.extra_config import HiddenStatesConnectorConfig
    from extractor import EngineConfig, SamplingParams
    from jobs.worker import ExtractionWorker, WorkerSettings

    spec = RunSpec(HiddenStatesSpec(layer_ids=(1, 4), num_hidden_layers=4, hidden_size=64, dtype="float32",
                                    model=model))
    write_run_spec(run, spec)
    return ExtractionWorker(WorkerSettings(
        engine=EngineConfig(model=model, layer_ids=(1, 4), dtype="float32", device="cpu"),
        sampling=SamplingParams(max_tokens=0),
        connector=HiddenStatesConnectorConfig(shared_storage_path=run.url, allow_custom_save_path=True),
        run=spec, **settings))
