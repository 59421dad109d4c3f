"""The extraction worker: one engine for the actor's lifetime (built by the engine kind --engine names,
extractor.engines: hsx's `extractor.LLM`, vLLM's `VllmEngine`), a batch of samples in, manifest rows out.

    WorkerSettings          the typed configs the driver built and checked (engine, sampling, connector) and the
                            file spec it recorded in run.json
    ExtractionWorker        Ray Data callable class: __call__(samples: pa.Table) -> results (RESULT_SCHEMA)

The model starts loading on a background thread as the worker starts, so it loads while the read tasks and the
tokenizer actors start up (each imports its libraries in a fresh process: seconds on a small machine); the first
batch with work waits for it. A load that failed fails that batch with the load's error, and the next batch loads
again, as a load on first use would.
Per batch: samples that already failed (bad record, tokenizer) pass through as failed rows; an image sample whose
images cannot be loaded is a failed row that a re-run skips (a missing file, not an image, over a limit), except one
whose image URL could not be fetched now (extractor.media.ImageUnavailable: connection failed, 408, 429, 5xx, the
fetch deadline), which a re-run tries again; the rest go to one `llm.generate` call, each with its own file
`OUTPUT/data/<shard>/<id>.safetensors`. A sample whose states the connector refused (NaN/Inf, a layer of zeros:
nothing written) is a failed row, or a "skipped" one under `on_nonfinite="skip"`. `generate` returns once every
file is durable; the worker then reads each file's header back (size, token count, sample id) before reporting it
"ok", so an "ok" row is never written for a file that is missing, short or someone else's.

With `layout="sharded"` the connector writes each sample's file to the worker's local staging folder instead; once
the batch is done, its good files (headers read back as above) are written to the output as one shard
(connectors.shards: one atomic, streamed put) and each "ok" row records the shard, the sample's offset and length.
A shard that cannot be written fails its samples (retried by a re-run); the local files go either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from connectors import read_hidden_states_info
from connectors.extra_config import HiddenStatesConnectorConfig
from connectors.manifest import FAILED, OK, RESULT_SCHEMA, SKIPPED
from connectors.run import RunDir, RunSpec
from connectors.shards import new_shard_path, write_shard
from connectors.storage import retrying
from connectors.writer import named_thread_pool
from corpus.readers import storable_text
from corpus.tokenization import SAMPLE_SCHEMA
from extractor import EngineConfig, SamplingParams
from extractor.engines import DEFAULT, engine_kind
from extractor.media import ImageUnavailable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSettings:
    engine: EngineConfig
    """What the engine loads and captures (layer ids, dtype and length limit as the driver resolved them)."""
    sampling: SamplingParams
    """Every sample's sampling; each gets its own kv_transfer_params (its file) on top."""
    connector: HiddenStatesConnectorConfig
    """Where files go: the run's root, with custom paths allowed (one per sample id)."""
    run: RunSpec
    """run.json: the file spec the loaded engine must produce exactly, the data layout, include_output_tokens."""
    cpu_threads: int | None = None
    """torch threads of a CPU worker: the CPUs Ray reserved for it, at most the cores this process may run on."""
    on_nonfinite: str = "fail"
    """A sample whose states the connector refused (NaN/Inf, a layer of zeros): a "failed" row, or with "skip" a
    "skipped" one (final: no resume extracts it again)."""
    layout: str = "files"
    """"files": a file per sample under the output; "sharded": one shard object per batch (connectors.shards);
    "online": nothing stored, each sample's file bytes returned in the row's `payload` (ONLINE_SCHEMA) for a trainer
    that reads the stream (training_jobs/live.py)."""
    attempt: str = ""
    """The job attempt's id: the folder of its shards (an orphan is removed only by the attempt or a later one)."""
    engine_kind: str = DEFAULT
    """The engine's name in extractor.engines' registry (--engine): hsx's engine (extractor.LLM), real vLLM with
    hsx's plug-in (vllm_engine.engine.VllmEngine), or another installed engine."""
    engine_settings: Any = None
    """The engine kind's settings (JobConfig.engine_settings: vLLM's parallel sizes and further arguments; None for
    hsx's engine)."""
    max_prompt_tokens: int | None = None
    """The limit an image sample is held to once the processor has expanded it (text samples were limited when
    tokenized): max_model_len minus max_tokens."""
    overlength: str = "truncate"
    """An image sample over that limit: "truncate" (kept when no image is cut, else failed) or "skip" (failed)."""


class ExtractionWorker:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.kind = engine_kind(settings.engine_kind)
        self.output = RunDir(settings.connector.shared_storage_path, settings.connector.storage_options)
        # where the connector writes: the output, (sharded) a local folder the batch's shard is made from, or
        # (online) this process's memory, from which each file's bytes go into its row
        # (an engine writing from processes of its own, as vLLM: its online files go through a local folder instead)
        online = _memory_folder if self.kind.files_in_process else _staging_folder
        self._staging = {"sharded": _staging_folder, "online": online}.get(settings.layout, lambda: None)()
        self.files = self.output if self._staging is None else RunDir(self._staging)
        self.llm = None
        self._loader = named_thread_pool(1, "hsx-load")
        self._loading = self._loader.submit(self._load)

    def _load(self):
        """The engine, checked against the run's file spec (on the loader thread)."""
        s = self.settings
        connector = s.connector if self._staging is None else dataclasses.replace(
            s.connector, shared_storage_path=self._staging, allowed_roots=None, storage_options={})
        if self.kind.lock_files:  # files on the output's disk keep <file>.lock: vLLM's load_hidden_states reads them
            connector = dataclasses.replace(connector, keep_lock_file=self._staging is None)
        llm = self.kind.build(s.engine, connector, s.engine_settings)  # --engine vllm: the only import of vLLM
        diff = s.run.file_spec().differences(llm.spec)
        if diff:
            llm.shutdown()
            raise RuntimeError(f"the engine loaded {diff} (run.json's value, the engine's), not what the job planned "
                               "from the model's config; the model changed under the job?")
        return llm

    def _engine(self):
        """The engine, once its background load is done. Raises what the load raised; the next call loads again
        (a storage that failed once may answer now)."""
        if self.llm is None:
            if self._loading is None:  # the last load failed: this batch loads again
                self._loading = self._loader.submit(self._load)
            try:
                llm = self._loading.result()
            except BaseException:
                self._loading = None  # not at once: the failed load's memory is freed first, and without work no
                raise  # load is wasted
            self._loader.shutdown(wait=False)
            if self.settings.cpu_threads:
                import torch

                # here, on the thread that runs the forwards (OpenMP's thread count is per thread): Ray sets
                # OMP_NUM_THREADS from the reservation, and on a node with fewer cores than logical CPUs (a local Ray
                # is started with at least 4) more threads than cores would only contend
                torch.set_num_threads(max(1, min(self.settings.cpu_threads, len(os.sched_getaffinity(0)))))
            self.llm = llm
        return self.llm

    def _sampling_params(self, rel_path: str) -> SamplingParams:
        # overwrite: the manifest decides what is committed, so a re-extraction replaces its own orphan (and the
        # connector remembers no file of a long job)
        kv = {"hidden_states_path": self.files.url_of(rel_path),
              "include_output_tokens": self.settings.run.include_output_tokens, "overwrite": True}
        return dataclasses.replace(self.settings.sampling, extra_args={"kv_transfer_params": kv})

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.select(SAMPLE_SCHEMA.names).to_pylist()
        results: list[dict[str, Any] | None] = [None] * len(rows)
        todo = []
        for i, row in enumerate(rows):
            if row["error"] is not None:  # the record itself (read, tokenization): it fails the same way every time
                results[i] = _failed(row, row["error"], retry=False)
            else:
                todo.append(i)
        if todo:
            for i, result in zip(todo, self._extract([rows[i] for i in todo])):
                results[i] = result
        return pa.Table.from_pylist(results, schema=ONLINE_SCHEMA if self.settings.layout == "online" else
                                    RESULT_SCHEMA)

    def _extract(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        llm = self._engine()
        prompts, failed = [], {}
        for i, r in enumerate(rows):
            if r.get("images"):
                try:
                    prompts.append(self._image_prompt(llm, r))
                except ValueError as e:  # the record's images or length: the same every time, except an image
                    # URL that could not be fetched now (ImageUnavailable), which a re-run tries again
                    failed[i] = _failed(r, f"{r['source']}: {e}", retry=isinstance(e, ImageUnavailable))
                continue
            prompts.append({"prompt_token_ids": r["prompt_token_ids"], "loss_mask": r["loss_mask"],
                            "sample_id": r["sample_id"]})
        if failed:
            kept = [r for i, r in enumerate(rows) if i not in failed]
            results = iter(self._extract_prompts(kept, prompts) if kept else [])
            return [failed[i] if i in failed else next(results) for i in range(len(rows))]
        return self._extract_prompts(rows, prompts)

    def _image_prompt(self, llm, row: dict[str, Any]) -> dict[str, Any]:
        """An image sample as the engine takes it: its images loaded and processed (extractor.multimodal), the
        length limit applied after expansion (never cutting an image), its loss mask carried over (0 on images).
        Updates the row's num_prompt_tokens and truncated to the expanded prompt's."""
        vision = getattr(getattr(llm, "runner", None), "vision", None) if self.kind.images else None
        if vision is None:
            raise ValueError("image samples need hsx's engine (--engine hsx) on a vision-language target")
        media = llm.prepare_media(row["prompt_text"], {"image": list(row["images"])}, max_tokens=None)
        mask = media.expand(row["prompt_token_ids"], row["loss_mask"], vision.image_token_id)
        limit = self.settings.max_prompt_tokens
        if limit is not None and len(media.input_ids) > limit:
            if self.settings.overlength == "skip":
                raise ValueError(f"over-length: {len(media.input_ids)} tokens with its images > limit {limit} (max "
                                 "model length minus --max-tokens); pass --overlength truncate or raise "
                                 "--max-model-len")
            media = media.truncated(limit)
            mask = mask[:limit]
            row["truncated"] = True
        row["num_prompt_tokens"] = len(media.input_ids)
        return {"prompt_token_ids": list(media.input_ids), "prompt": row["prompt_text"],
                "multi_modal_inputs": media, "loss_mask": mask, "sample_id": row["sample_id"]}

    def _extract_prompts(self, rows: list[dict[str, Any]], prompts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        paths = [self.settings.run.data_path(r["sample_id"]) for r in rows]
        params = [self._sampling_params(p) for p in paths]
        llm = self._engine()
        try:
            try:
                outputs = llm.generate(prompts, params, request_ids=[r["sample_id"] for r in rows])
            except Exception:  # noqa: BLE001 - the engine isolates requests; if a call still fails, isolate them
                logger.exception("generate() failed for a batch of %d; retrying its samples one by one", len(rows))
                results = [self._extract_one(r, prompt, path, param) for r, prompt, path, param in
                           zip(rows, prompts, paths, params)]
            else:
                results = [self._result(r, out, path) for r, out, path in zip(rows, outputs, paths)]
            if self.settings.layout == "online":
                return self._with_payloads(results)
            return results if self._staging is None else self._write_shard(results)
        finally:
            if self._staging is not None and "://" in self._staging:  # online: the batch's files, in their rows now
                if self.files.fs.exists(self.files.root):
                    self.files.fs.rm(self.files.root, recursive=True)
            elif self._staging is not None:  # the batch's local files: in its shard (rows) now, or failed
                shutil.rmtree(self._staging, ignore_errors=True)
                os.makedirs(self._staging, exist_ok=True)

    def _with_payloads(self, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each good sample's file bytes in its row (`payload`), read back from memory."""
        for r in results:
            r["payload"] = None
            if r["status"] == OK:
                try:
                    r["payload"] = self.files.fs.cat_file(self.files.path(r["path"]))
                except OSError as e:
                    r.update(_failed(r, f"the sample's states cannot be read back from memory: {e}"), payload=None)
        return results

    def _write_shard(self, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The batch's good files as one shard of the output; their rows then point into it (failed if it cannot
        be written: nothing of it is committed)."""
        good = [r for r in results if r["status"] == OK]
        if not good:
            return results
        rel, cfg = new_shard_path(self.settings.attempt), self.settings.connector
        try:
            spans = write_shard(self.output.fs, self.output.path(rel), [self.files.path(r["path"]) for r in good],
                                attempts=cfg.max_write_attempts, backoff_s=cfg.write_retry_backoff_s,
                                for_s=cfg.write_retry_s)
        except (OSError, ValueError, TimeoutError) as e:
            error = f"shard write to {self.output.url_of(rel)} failed: {type(e).__name__}: {e}"
            return [_failed(r, error) if r["status"] == OK else r for r in results]
        changed = [r["sample_id"] for r, (_, length) in zip(good, spans) if length != r["bytes"]]
        if changed:  # a local file changed after it was read back: the shard is someone's, but not these rows'
            error = f"the staged files of {changed[:3]} changed after they were read back; extract them again"
            return [_failed(r, error) if r["status"] == OK else r for r in results]
        for r, (offset, _) in zip(good, spans):
            r.update(path=rel, offset=offset)
        return results

    def _extract_one(self, row, prompt, path, param) -> dict[str, Any]:
        try:
            out = self.llm.generate([prompt], [param], request_ids=[row["sample_id"]])[0]
        except Exception as e:  # noqa: BLE001
            return _failed(row, f"engine error: {type(e).__name__}: {e}")
        return self._result(row, out, path)

    def _result(self, row: dict[str, Any], out, rel_path: str) -> dict[str, Any]:
        if out.error is not None:
            if out.error_kind == "bad_states" and self.settings.on_nonfinite == "skip":
                return _failed(row, f"{row['source']}: {out.error}", status=SKIPPED)
            return _failed(row, f"{row['source']}: {out.error}")
        generated = len(out.outputs[0].token_ids) if out.outputs else 0
        expected = row["num_prompt_tokens"] + (max(generated - 1, 0) if self.settings.run.include_output_tokens else 0)
        url, cfg = self.files.url_of(rel_path), self.settings.connector
        try:  # the store may fail between the write and this read, as during the write: retried as long
            info = retrying("read back", url, cfg.max_write_attempts, cfg.write_retry_backoff_s, cfg.write_retry_s)(
                read_hidden_states_info, url, storage_options=self.files.storage_options)
        except (OSError, ValueError, TimeoutError) as e:
            return _failed(row, f"written file cannot be read back: {type(e).__name__}: {e}")
        if info.num_tokens != expected or info.metadata.get("sample_id") != row["sample_id"]:
            return _failed(row, f"written file holds {info.num_tokens} tokens of sample "
                                f"{info.metadata.get('sample_id')!r}, expected {expected} of {row['sample_id']!r}")
        return {"sample_id": row["sample_id"], "status": OK, "path": rel_path, "num_tokens": info.num_tokens,
                "num_prompt_tokens": row["num_prompt_tokens"], "bytes": info.size, "error": None,
                "source": row["source"], "truncated": row["truncated"], "checksum": info.metadata.get("checksum")}

    def __del__(self) -> None:
        llm = getattr(self, "llm", None)
        loading = getattr(self, "_loading", None)
        if llm is None and loading is not None and loading.done() and not loading.exception():
            llm = loading.result()  # loaded, never used (the worker saw no work)
        if llm is not None:
            try:
                llm.shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown; every reported file is already durable
                pass
        staging = getattr(self, "_staging", None)
        if staging is not None and "://" not in staging:
            shutil.rmtree(staging, ignore_errors=True)


STAGING_PREFIX = "hsx-shard-"
ONLINE_SCHEMA = RESULT_SCHEMA.append(pa.field("payload", pa.large_binary()))
"""An online worker's rows: the manifest row plus the sample's file bytes (null unless ok)."""


def _memory_folder() -> str:
    """This process's folder on fsspec's in-memory filesystem (an online worker's files live there per batch)."""
    import uuid

    return f"memory://hsx-online-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _staging_folder() -> str:
    """A fresh local folder for a sharded worker's files (named by its pid), after removing those of workers on this
    machine whose process is gone (killed: no teardown ran)."""
    return own_temp_folder(STAGING_PREFIX)


def own_temp_folder(prefix: str) -> str:
    """A new temporary folder `<prefix><host>-<pid>-XXXX` of this process, after removing the ones this host's
    processes left when they died (killed, OOM: their cleanup never ran). Only names of that exact shape, with this
    host's name, are ever removed: a folder of a user's, or of a process on another host (a container sharing /tmp,
    its pids its own), is never touched."""
    import re
    import socket

    tmp = tempfile.gettempdir()
    mine = f"{prefix}{re.sub(r'[^A-Za-z0-9.-]', '_', socket.gethostname())[:40]}-"
    shape = re.compile(re.escape(mine) + r"(\d+)-[A-Za-z0-9_]{8}$")  # mkdtemp's 8 random characters
    with contextlib.suppress(OSError):
        for name in os.listdir(tmp):
            m = shape.match(name)
            if m and not _alive(int(m.group(1))):
                logger.info("removing %s, left by a process of this host that is gone", os.path.join(tmp, name))
                shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{mine}{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's
    return True
    return True


def _failed(row: dict[str, Any], error: str, status: str = FAILED, retry: bool = True) -> dict[str, Any]:
    return {"sample_id": row["sample_id"], "status": status, "path": None, "num_tokens": 0,
            "num_prompt_tokens": row["num_prompt_tokens"], "bytes": 0, "error": storable_text(error),
            "source": row["source"], "truncated": row["truncated"], "checksum": None, "retry": retry}
