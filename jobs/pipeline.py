"""The extraction job on Ray: its plan (jobs/plan.py, no Ray), then the corpus streamed through a Ray Data pipeline.

    execute_job(plan) -> JobResult      runs on Ray (not started when nothing is left); raises JobFailed when the
                                        job as a whole fails (exit 1).
    run_job(config) -> JobResult        prepare_job (jobs.plan) and execute_job

The pipeline (Ray Data, streaming; every stage bounded by Ray Data's backpressure, so memory stays flat):

    corpus files ──read tasks──> records ──TokenizeStage actors (CPU)──> samples ──ExtractionWorker actors──> rows
      (from_items)   │ claims against the SampleRegistry actor:                      (one engine each,
                     │ skip committed ids, fail duplicates                            num_gpus per worker)
                                                                                           │
    driver: iter_batches ──> ManifestWriter (atomic Parquet parts) + progress bar <────────┘

Work is balanced by tokens: Ray Data cuts blocks by bytes (`DataContext.target_max_block_size`) and a tokenized
sample is ~9 bytes per token (int64 id + uint8 mask), so the byte target is set to `tokens_per_task` tokens' worth and
each block handed to a worker carries about that many tokens, whatever the sample lengths. Actors pull blocks as they
free up. A worker that dies is restarted by Ray Data (actor restarts and task retries are on by default for map
actors) and its unfinished blocks are re-run; their rows only reach the manifest after the files are durable.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator

import pyarrow as pa

from cluster.progress import JobResult, Progress
from cluster.session import check_fits, first_line, gpus_default, ray_cluster, ray_logs_dir
from connectors.lease import LeaseLost
from connectors.manifest import FAILED, SKIPPED, compact_manifest, new_attempt_id, referenced_paths
from connectors.manifest_writer import ManifestWriter
from connectors.run import RunFormatError, RunSpec
from connectors.shards import SHARD_DIR, remove_orphan_shards
from corpus.readers import CorpusFile, count_records, read_stage
from corpus.sample_registry import start_registry
from corpus.tokenization import TokenizeSettings, TokenizeStage
from jobs.config import JobConfig
from jobs.plan import JobPlan, finished_result, prepare_job
from regeneration.regenerate import execute_regeneration

logger = logging.getLogger(__name__)

BYTES_PER_TOKEN = 9  # a tokenized row: int64 token id + uint8 loss mask
READ_TASK_CPUS = 0.25
TOKENIZER_CPUS = 0.5
MAX_FAILURES_SHOWN = 10
ONLINE_MMAP_THRESHOLD = 128 * 1024
"""Bytes from which an online extraction worker's allocations are mmapped (and returned to the system when freed)."""
# Ray Data's start/finish notices and "progress bars disabled" would scroll our progress bar away
_CHATTY_LOGGERS = ("ray.data._internal.progress", "ray.data._internal.execution.streaming_executor")


class JobFailed(RuntimeError):
    """The job as a whole failed (workers cannot start, the cluster went away, ...)."""


def run_job(config: JobConfig) -> JobResult:
    return execute_job(prepare_job(config))


def resolve_resources(config: JobConfig, local: bool) -> tuple[float, float]:
    """(GPUs, CPUs) each extraction worker reserves. Raises ValueError on a local cluster they cannot fit (another
    cluster may autoscale: a warning)."""
    import ray

    resources = ray.cluster_resources()
    available, cpus = resources.get("GPU", 0), resources.get("CPU", 0)
    gang = config.engine_kind().ranks(config.engine_settings())  # an engine of T x P ranks: that many whole devices
    ranks = gang or 1
    gpus = config.gpus_per_worker if config.gpus_per_worker is not None else gpus_default() * ranks
    others = TOKENIZER_CPUS * config.tokenizer_workers + READ_TASK_CPUS
    per_worker = config.cpus_per_worker
    if per_worker is None:
        per_worker = 1.0
        if gpus == 0:  # the worker's torch threads do the model's work: give them what the other stages leave
            largest_node = max((n.get("Resources", {}).get("CPU", 0) for n in ray.nodes() if n.get("Alive")),
                               default=cpus)
            per_worker = float(max(ranks, min(int((cpus - others) // config.workers), int(largest_node))))
    need_cpus = config.workers * per_worker + others
    if gang is not None and (0 < gpus < ranks or (gpus == 0 and per_worker < ranks)):
        given = f"--gpus-per-worker {gpus:g}" if gpus else f"--cpus-per-worker {per_worker:g}"
        raise ValueError(f"--tensor-parallel-size x --pipeline-parallel-size = {ranks} vLLM ranks need {ranks} "
                         f"{'GPUs' if gpus else 'cores'} per worker, {given}; raise it or lower the parallel sizes")
    if gang is not None and gpus != int(gpus):
        raise ValueError(f"--engine {config.engine} with --gpus-per-worker {gpus:g}: each vLLM rank takes a whole "
                         f"GPU; give a whole number ({ranks} for {ranks} rank{'s' if ranks > 1 else ''})")
    problems = []
    largest_gpus = max((n.get("Resources", {}).get("GPU", 0) for n in ray.nodes() if n.get("Alive")), default=0)
    if gpus > 1 and gpus > largest_gpus:  # one worker's GPUs are reserved on one node (one engine's ranks stay there)
        problems.append(f"a worker of --gpus-per-worker {gpus:g} fits no node (the largest has {largest_gpus:g} "
                        "GPUs); lower --tensor-parallel-size / --gpus-per-worker or add larger nodes")
    if gpus * config.workers > available:
        problems.append(f"--workers {config.workers} x --gpus-per-worker {gpus:g} needs {gpus * config.workers:g} "
                        f"GPUs, the cluster has {available:g}")
    if need_cpus > cpus:
        problems.append(f"--workers {config.workers} x --cpus-per-worker {per_worker:g} plus tokenizers "
                        f"needs {need_cpus:g} CPUs, the cluster has {cpus:g}")
    check_fits(problems, local=local, fix="lower --workers, --gpus-per-worker or --cpus-per-worker",
               waiting="continuing: an autoscaling cluster may add nodes")
    return gpus, per_worker


def tokenize_settings(plan: JobPlan) -> TokenizeSettings:
    """How the job's records become token ids and loss masks (the TokenizeStage actors')."""
    c, f = plan.config, plan.facts
    return TokenizeSettings(tokenizer=f.model, max_prompt_tokens=f.max_model_len - c.max_tokens,
                            overlength=c.overlength, chat_template=plan.chat_template, revision=c.revision,
                            trust_remote_code=c.trust_remote_code, images=f.multimodal)


def build_dataset(plan: JobPlan, registry, gpus_per_worker: float, cpus_per_worker: float, attempt: str,
                  layout: str | None = None):
    """The lazy Ray Data pipeline whose rows are manifest rows (manifest.RESULT_SCHEMA); `attempt` names the
    shards its workers write (--layout sharded). `layout` "online" (training_jobs/live.py): rows carry each sample's file
    bytes instead (worker.ONLINE_SCHEMA), nothing is stored."""
    import ray.data

    from jobs.worker import ExtractionWorker, WorkerSettings  # torch: the workers' code, not the driver's

    c, f = plan.config, plan.facts
    files = [{"url": x.url, "format": x.format} for x in plan.files]
    tokenize = tokenize_settings(plan)
    work = WorkerSettings(
        engine=c.engine_config(model=f.model, layer_ids=f.layer_ids, dtype=f.dtype, max_model_len=f.max_model_len,
                               device=None if gpus_per_worker > 0 else "cpu"),
        sampling=c.sampling_params(),
        connector=dataclasses.replace(c.connector_config(), shared_storage_path=plan.output.url),
        run=plan.spec, cpu_threads=None if gpus_per_worker > 0 else max(1, int(cpus_per_worker)),
        on_nonfinite=c.on_nonfinite, layout=layout or c.layout, attempt=attempt, engine_kind=c.engine,
        engine_settings=c.engine_settings(), max_prompt_tokens=f.max_model_len - c.max_tokens,
        overlength=c.overlength)
    ds = ray.data.from_items(files, override_num_blocks=max(1, min(len(files), 1024)))
    ds = ds.map_batches(read_stage, batch_size=1, batch_format="pyarrow", num_cpus=READ_TASK_CPUS,
                        fn_kwargs={"id_field": c.id_field, "storage_options": c.corpus_storage_options,
                                   "registry": registry})
    ds = ds.map_batches(TokenizeStage, fn_constructor_args=(tokenize,), batch_size=None, batch_format="pyarrow",
                        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=c.tokenizer_workers),
                        num_cpus=TOKENIZER_CPUS)
    extra = {}
    if work.layout == "online":  # each sample's bytes pass through the worker's heap a few times: a fixed mmap
        # threshold hands such buffers back to the system when freed (glibc's moving threshold keeps them: the
        # worker's private memory doubled on the reference target, bench_online.py)
        extra["runtime_env"] = {"env_vars": {"MALLOC_MMAP_THRESHOLD_": str(ONLINE_MMAP_THRESHOLD)}}
    ds = ds.map_batches(ExtractionWorker, fn_constructor_args=(work,), batch_size=None, batch_format="pyarrow",
                        compute=ray.data.ActorPoolStrategy(min_size=c.workers, max_size=c.max_workers or c.workers),
                        num_gpus=gpus_per_worker,
                        num_cpus=cpus_per_worker, **extra)
    return ds


def tokens_per_unit(config: JobConfig, spec: RunSpec) -> int:
    """Tokens per unit of work: --tokens-per-task, or under --layout sharded as many as fill a shard of --shard-mb
    (a shard is one unit's samples), from the bytes a token takes in the run's files."""
    if config.layout != "sharded":
        return config.tokens_per_task
    from connectors.header import data_bytes, file_entries  # torch

    per_token = data_bytes(file_entries(spec.file_spec(), 1, loss_mask=True))
    return max(1, int(config.shard_mb * 2**20 / per_token))


@contextlib.contextmanager
def data_context(tokens_per_task: int) -> Iterator[None]:
    """Ray Data's settings for a job's stages (blocks of `tokens_per_task` tokens, no progress bars or start
    notices of its own), put back on exit; used by `hsx run` and by --online training's stream (training_jobs/live.py)."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    saved = (ctx.target_max_block_size, ctx.enable_progress_bars, ctx.print_on_execution_start)
    ctx.target_max_block_size = tokens_per_task * BYTES_PER_TOKEN
    ctx.enable_progress_bars = False  # ours is the one the user watches
    ctx.print_on_execution_start = False
    quiet = [logging.getLogger(name) for name in _CHATTY_LOGGERS]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        yield
    finally:
        ctx.target_max_block_size, ctx.enable_progress_bars, ctx.print_on_execution_start = saved
        for q, level in zip(quiet, levels):
            q.setLevel(level)


def _count_corpus(files: list[CorpusFile], storage_options: dict) -> int | None:
    """Records in the corpus, for the ETA; None when counting would mean downloading remote JSONL (or fails: an
    unreadable file is the read stage's to report, as failed records)."""
    if any(f.format == "jsonl" and "://" in f.url for f in files):
        return None
    try:
        return sum(count_records(f, storage_options) for f in files)
    except Exception as e:  # noqa: BLE001 - the count only feeds the ETA
        logger.debug("cannot count the corpus for the ETA: %s", e)
        return None


def execute_job(plan: JobPlan, on_batch=None) -> JobResult:
    """Run the pipeline and commit its rows; returns the numbers of this run. Gives the writer lease back.
    `on_batch(rows)` sees every batch of rows once it is handed to the manifest writer (a trainer reading the run as
    it is written: training_jobs/live.py); an exception it raises stops the job, the rows received are committed."""
    if plan.nothing_left:
        return finished_result(plan)
    attempt = plan.attempt or new_attempt_id()
    result = JobResult(output=plan.output.url, attempt=attempt, new_run=plan.new_run)
    started = time.monotonic()
    keep_alive = plan.lease.keep_alive() if plan.lease is not None else contextlib.nullcontext(threading.Event())
    regenerating = _Regenerating(plan.regeneration) if plan.regeneration is not None else None
    try:
        with keep_alive as lease_lost:
            _execute(plan, result, attempt, started, lease_lost, on_batch)
    finally:
        if regenerating is not None:
            result.regeneration = regenerating.stop()
        if plan.lease is not None:
            plan.lease.release()
    if regenerating is not None and regenerating.error is not None:
        raise JobFailed(f"the regeneration stopped ({regenerating.error}); the extraction took every record it "
                        "committed — re-run the same command to finish both")
    return result


class _Regenerating:
    """hsx regenerate in a thread of the driver while the job's read stage follows its committed records."""

    def __init__(self, plan) -> None:
        self.stopping = threading.Event()
        self.error: str | None = None
        self.result = None
        self.thread = threading.Thread(target=self._run, args=(plan,), name="hsx-regenerate", daemon=True)
        self.thread.start()

    def _run(self, plan) -> None:
        try:
            self.result = execute_regeneration(plan, stop=self.stopping)
        except BaseException as e:  # noqa: BLE001 - reported by the job
            logger.debug("regeneration failed", exc_info=True)
            if not self.stopping.is_set():  # stopped because the job ended: the job's own error is the one to see
                self.error = f"{type(e).__name__}: {e}"

    def stop(self) -> list[str]:
        """Its summary lines, once it has ended (at once when the job ended first: it commits what was answered)."""
        if self.thread.is_alive():
            self.stopping.set()
        self.thread.join()
        return self.result.lines() if self.result is not None else []


def _execute(plan: JobPlan, result: JobResult, attempt: str, started: float, lease_lost: threading.Event,
             on_batch=None) -> JobResult:
    import ray

    config = plan.config
    writer = ManifestWriter(plan.output, attempt, config.manifest_flush_rows, config.manifest_flush_seconds,
                            retry_s=config.storage_retry_seconds)
    progress = Progress(config.progress)
    counter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hsx-count")
    count = counter.submit(_count_corpus, plan.files, config.corpus_storage_options)
    try:
        with ray_cluster(config.address, quiet=not config.verbose) as local:
            gpus, cpus = resolve_resources(config, local)
            result.gpus_per_worker, result.cpus_per_worker = gpus, cpus
            registry = start_registry(plan.done, config.registry_shards)
            try:
                with data_context(tokens_per_unit(config, plan.spec)):
                    ds = build_dataset(plan, registry, gpus, cpus, attempt)
                    try:
                        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                            if lease_lost.is_set():
                                raise LeaseLost(f"another writer took over {plan.output.url}; stopped before "
                                                "committing more rows")
                            writer.add(batch)
                            progress.update(batch)
                            _note(result, batch)
                            writer.maybe_flush()
                            if on_batch is not None:
                                on_batch(batch)
                            if count.done() and count.result() is not None:
                                progress.set_total(max(count.result() - len(plan.done), 0))
                                count = concurrent.futures.Future()
                    except LeaseLost as e:
                        raise JobFailed(str(e)) from e
                    except OSError as e:  # the output's storage failed (gone, full, ...) while committing
                        raise JobFailed(f"committing to {plan.output.url} failed: {first_line(e)}; rows "
                                        "committed before are kept — fix the storage and re-run the same command "
                                        "to resume") from e
                    except (ray.exceptions.RayError, RuntimeError, ValueError) as e:
                        logger.debug("pipeline failure", exc_info=True)
                        raise JobFailed(f"the extraction pipeline failed: {_root_cause(e)}"
                                        + ("" if config.verbose else _logs_hint())) from e
                stats = registry_stats(registry)
            finally:
                for shard in registry:
                    with contextlib.suppress(Exception):
                        ray.kill(shard)
    except BaseException:
        if not lease_lost.is_set():  # rows received are for durable files: commit them even when the job fails
            try:
                writer.flush()
            except Exception as e:  # noqa: BLE001 - the job is failing already; say so, keep its own error
                logger.error("could not commit the last manifest rows to %s: %s", plan.output.url, e)
        raise
    else:
        try:
            writer.flush()
        except OSError as e:
            raise JobFailed(f"the last manifest commit to {plan.output.url} failed: {first_line(e)}; their files "
                            "are written but not counted — fix the storage (free space, permissions) and re-run the "
                            "same command: those samples are extracted again") from e
        if config.compact and not lease_lost.is_set():
            _compact(plan.output)
        if not lease_lost.is_set():
            _remove_orphan_shards(plan.output, attempt, lease_lost)
    finally:
        progress.close()
        counter.shutdown(wait=False, cancel_futures=True)
    result.skipped = stats["skipped"]
    result.duplicates = stats["duplicates"]
    result.ok, result.failed, result.skipped_bad = progress.ok, progress.failed, progress.skipped
    result.tokens, result.bytes = progress.tokens, progress.bytes
    result.seconds = time.monotonic() - started
    return result


def _remove_orphan_shards(output, attempt: str, lease_lost: threading.Event) -> None:
    """Remove the shards no manifest row points into (a worker died after writing one, before its rows were
    committed): at the end of a job, under its lease. A failure leaves them; no reader counts them."""
    try:
        if not output.list(SHARD_DIR):
            return
        removed = remove_orphan_shards(output, referenced_paths(output, f"{SHARD_DIR}/"), attempt, lease_lost)
    except (OSError, ValueError) as e:
        logger.warning("could not remove orphan shards of %s (no reader counts them): %s", output.url, e)
        return
    if removed:
        logger.info("removed %d orphan shard(s) of %s (written by workers whose rows never reached the "
                    "manifest)", removed, output.url)


def _compact(output) -> None:
    """Merge the manifest's parts at the end of a job (under its lease); a failure leaves the parts as they are."""
    try:
        done = compact_manifest(output)
    except (OSError, RunFormatError) as e:
        logger.warning("could not compact the manifest of %s (its parts stay as they are; `hsx compact` later): %s",
                       output.url, first_line(e))
        return
    if done.rows >= 0:
        logger.info("compacted the manifest: %d rows in %d parts -> %d", done.rows, done.parts_before,
                    done.parts_after)


def registry_stats(shards: list) -> dict[str, int]:
    """The registry shards' counts summed; zeros with a warning when one died (every row is committed by then: only
    the skip and duplicate counts of the summary are lost, never the job)."""
    import ray

    try:
        each = ray.get([shard.stats.remote() for shard in shards])
    except ray.exceptions.RayError as e:
        logger.warning("the sample registry died (%s); skipped/duplicate counts are unknown", first_line(e))
        return {"skipped": 0, "duplicates": 0}
    return {k: sum(s[k] for s in each) for k in ("skipped", "duplicates", "claimed")}


def _logs_hint() -> str:
    """Where the workers' own output went when the console showed hsx's lines alone."""
    where = ray_logs_dir()
    return (f" (the workers' own output is in Ray's logs, {where}/worker-*.err on the node that ran them; "
            "--verbose shows it here)") if where else " (--verbose shows the workers' own output here)"


def _root_cause(error: BaseException) -> str:
    """First line of a Ray error plus the exception it carries (Ray's str() holds whole remote tracebacks)."""
    import re

    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    causes = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b.*:", line)]
    # Ray's own wrappers ("UserCodeException: UDF failed to process a data block") name no cause: skip them
    causes = [c for c in causes if not c.startswith("ray.exceptions.")] or causes
    head = re.sub(r"\x1b\[[0-9;]*m", "", lines[0])
    return head if not causes or causes[-1] in head else f"{head} ... {causes[-1]}"


def _note(result: JobResult, batch: pa.Table) -> None:
    import pyarrow.compute as pc

    result.truncated += int(pc.sum(pc.cast(batch["truncated"], pa.int64())).as_py() or 0)
    for status, shown in ((FAILED, result.failures), (SKIPPED, result.skips)):
        if len(shown) < MAX_FAILURES_SHOWN:
            rows = batch.filter(pc.equal(batch["status"], status))
            shown += list(zip(rows["sample_id"].to_pylist(), rows["error"].to_pylist()))[:MAX_FAILURES_SHOWN - len(shown)]
