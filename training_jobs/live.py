"""`hsx train-drafter --online`: a drafter trained from a live extraction, no files written.

    train_online(config) -> report     one training session (training.trainer.Trainer) fed by LiveStream
    LiveStream(config, plan)           the session's data: checks against the stream's run spec, the corpus's tokens
                                       for Drafter.prepare, LiveBatches, the stream's counts for report.json
    LiveBatches                        one pass over the corpus through `hsx run`'s stages, as packed batches
    StreamHub                          one live extraction feeding several trainers (--fanout: training_jobs/fanout.py)
    CorpusTokens                       the corpus's tokens, tokenized here (EAGLE-3's draft vocabulary pass)
    extraction_config / plan_stream / stream_identity   the `hsx run` settings, plan and identity of the stream
    stream_layers(config, trainers)    the layers it captures by default: what the trainers' families read
    run_online(trainer) -> report      trainer.run(), a Ray error of the stream said as the extraction's failure

The corpus goes through the same stages as `hsx run` (jobs/pipeline.py: readers, the sample registry, tokenization
with chat loss masks, extraction workers with the job's layers (--extract's, else those the family declares it
reads: drafters.features), dtype and `max_tokens` / `include_output_tokens`
regeneration) with the workers' "online" layout: each sample's file is made in the worker's memory and its bytes
travel in the row through Ray's object store to the trainer, which reads it back with every check a stored run gets
(header against the run spec, the row's sample id, token count and checksum) and packs consecutive samples into
batches of --batch-tokens. Nothing is stored anywhere but --out.

Backpressure: Ray Data holds at most --inflight-mb of object-store memory for the stream's blocks
(ExecutionOptions.resource_limits); when the trainer is slower than the extraction, the workers wait.
Resume: a checkpoint records the ids of the samples the epoch has trained on (8-byte keys, corpus.sample_registry.id_keys);
a resumed training's stream skips them (the registry's done set), so it trains on the rest of the pass. Samples
extracted but not trained on when the training stopped are extracted again. Each further epoch is a new pass
(the target runs again). EAGLE-3's draft vocabulary comes from a tokens-only pass over the corpus before training
(the prompts' loss-masked tokens; with --include-output-tokens every prompt token, the generated ones being unknown
until the target writes them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import random
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import fsspec
import numpy as np
import torch

from cluster.session import first_line, ray_cluster
from connectors.format import HIDDEN_STATES, LOSS_MASK, TARGET_TOPK_IDS, TARGET_TOPK_LOGPROBS, TOKEN_IDS
from connectors.manifest import OK, new_attempt_id, ok_rows, row_file_problem, sample_range
from connectors.reader import read_rows
from connectors.run import RunDir
from corpus.readers import expand_corpus, read_records
from corpus.records import records_table
from corpus.sample_registry import DoneSet, id_keys, start_registry
from corpus.tokenization import TokenizeStage
from drafters.base import TargetHead
from drafters.registry import default_layer_ids, family_features
from extractor.facts import text_config
from jobs.config import JobConfig
from jobs.model import ModelFacts
from jobs.pipeline import (
    build_dataset,
    data_context,
    execute_job,
    registry_stats,
    resolve_resources,
    tokenize_settings,
    tokens_per_unit,
)
from jobs.plan import JobPlan, load_chat_template, prepare_job
from jobs.runinfo import build_run_spec
from training.checks import check_layers, open_dataset, target_config
from training.collate import PackCollator
from training.feed import CheckedFeed, RunBatches
from training.replicas import OneProcess
from training.trainer import Checked, Trainer
from training_jobs.config import TrainJobConfig

logger = logging.getLogger(__name__)

MAX_FAILURES_KEPT = 100


def stream_layers(config: TrainJobConfig, trainers: list[TrainJobConfig]) -> tuple[int, ...]:
    """The layers --online's extraction captures when --extract names none: what the trainers' families declare
    they read (drafters.features: each one's aux layers, then N), so that no layer is captured for nothing; with
    --cache, `hsx run`'s default (every registered family's layers), so that the kept run trains any family later."""
    n = int(text_config(target_config(config.model)).num_hidden_layers)
    if config.cache:
        return default_layer_ids(n)
    wanted = (family_features(c.kind).extraction_layer_ids(n, c.drafter_options().get("aux_layer_ids"))
              for c in trainers)
    return tuple(sorted({i for ids in wanted for i in ids}))


def extraction_config(config: TrainJobConfig, trainers: list[TrainJobConfig] | None = None) -> JobConfig:
    """The `hsx run` settings of --online's extraction: --model, --corpus and --extract's keys; the layers the
    `trainers` (default: this one) read unless --extract names them (stream_layers)."""
    reserved = {"model", "corpus", "output", "progress", "address", "layout"} & set(config.extract)
    if reserved:
        raise ValueError(f"--extract sets {sorted(reserved)}, which --online decides (--model, --corpus, --address "
                         "are train-drafter's own flags; the states are not stored)")
    layers = {} if "layers" in config.extract else {"layers": stream_layers(config, trainers or [config])}
    try:
        output = config.cache or f"memory://hsx-online/{uuid.uuid4().hex}"
        options = {"storage_options": config.storage_options} if config.cache else {}
        return JobConfig(model=config.model, corpus=config.corpus, output=output, progress=False,
                         **options, **layers, **config.extract)
    except TypeError as e:
        raise ValueError(f"--extract: {e} (use `hsx run` config keys, e.g. layers, max_tokens, workers)") from e


def plan_stream(job: JobConfig) -> JobPlan:
    """prepare_job's plan without an output: the model's facts, the corpus files, the chat template and the run
    spec every streamed sample's file follows."""
    job.check_required()
    job.check_engine_installed()
    facts = ModelFacts.resolve(job)
    files = expand_corpus(job.corpus, job.corpus_storage_options)
    override, template, template_source = load_chat_template(job, facts)
    spec = build_run_spec(job, facts, files, template, template_source)
    return JobPlan(job, facts, RunDir(job.output), files, override, spec, new_run=True, done=DoneSet(),
                   attempt=new_attempt_id())


def stream_identity(plan: JobPlan, config: TrainJobConfig) -> dict[str, Any]:
    """What a resumed --online training must find unchanged: the run spec the stream's samples follow (model,
    layers, dtype, generation) and the corpus files' names and sizes."""
    doc = {k: v for k, v in plan.spec.to_json().items() if k != "created_at"}
    spec = json.dumps(doc, sort_keys=True, default=str).encode()
    corpus = json.dumps([f.url for f in plan.files] + sorted(config.corpus)).encode()
    return {"run_sha256": hashlib.sha256(spec).hexdigest(), "committed_sha256": hashlib.sha256(corpus).hexdigest(),
            "committed_samples": None}


class CorpusTokens:
    """The corpus's token ids and loss masks, tokenized here as the job's tokenizer stage would (EAGLE-3's draft
    vocabulary pass: Drafter.prepare reads token_items())."""

    def __init__(self, plan: JobPlan) -> None:
        self.plan = plan

    def token_items(self) -> Iterator[dict[str, Any]]:
        c = self.plan.config
        stage = TokenizeStage(tokenize_settings(self.plan))
        every_token = c.include_output_tokens  # the loss goes to generated tokens: count the prompts' instead
        for file in self.plan.files:
            for records in read_records(file, c.id_field, c.corpus_storage_options):
                table = records_table(records)
                for row in stage(table).to_pylist():
                    if row["error"] is None:
                        ids = torch.tensor(row["prompt_token_ids"], dtype=torch.long)
                        mask = torch.ones_like(ids) if every_token or row["loss_mask"] is None else \
                            torch.tensor(row["loss_mask"], dtype=torch.long)
                        yield {"input_ids": ids, "loss_mask": mask}


class LiveBatches:
    """Packed batches of a live extraction, one pass over the corpus per epoch (a training.feed.BatchSource)."""

    per_epoch = None  # a live corpus has no known length

    def __init__(self, config: TrainJobConfig, plan: JobPlan, feed: CheckedFeed, collate, local: bool,
                 resumed: dict[str, Any] | None) -> None:
        self.config, self.plan, self.feed, self.collate, self.local = config, plan, feed, collate, local
        self.consumed = list(np.asarray((resumed or {}).get("consumed", np.zeros(0, np.uint64)), np.uint64))
        """Keys of the samples this epoch has trained on (a resumed stream skips them)."""
        self.epoch_of_consumed = (resumed or {}).get("epoch", 0)
        self._last: list[int] = []
        self.failures: dict[str, str] = {}
        self.failed = self.extracted = self.passes = 0
        self.target_forwards = 0
        """Samples the extraction delivered ("ok" rows: the target ran once for each; with --cache, the ones it
        committed to the run)."""
        self.peak_inflight_bytes = 0
        self._memory = fsspec.filesystem("memory")
        self._scratch = f"/hsx-online-trainer-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def state(self) -> dict[str, Any]:
        return {"consumed": np.asarray(self.consumed, dtype=np.uint64), "epoch": self.epoch_of_consumed}

    def epoch(self, epoch: int, done: int) -> Iterator[tuple[Any, list]]:
        """(packed batch, bad samples) of one pass; samples consumed before a resume are not extracted again. With
        --cache the first pass also stores the run and later epochs read it (`done` batches in)."""
        if epoch != self.epoch_of_consumed:
            self.consumed, self.epoch_of_consumed = [], epoch
        if self.config.cache and epoch >= 1:
            yield from self._stored(epoch, done)
            return
        pending: list[dict[str, Any]] = []
        bad: list[tuple[str, str]] = []
        used = 0
        items = self.pass_items(epoch, DoneSet(np.asarray(self.consumed, dtype=np.uint64)))
        for item in shuffled(items, int(self.config.shuffle_mb * 2**20), random.Random(self.config.seed * 7919 + epoch)):
            if "bad" in item:
                bad.append(item["bad"])
                continue
            n = min(int(item["input_ids"].shape[0]), self.config.batch_tokens)
            if pending and used + n > self.config.batch_tokens:
                yield self._batch(pending, bad)
                pending, bad, used = [], [], 0
            pending.append(item)
            used += n
        if pending or bad:
            yield self._batch(pending, bad)
        self.passes += 1

    def pass_items(self, epoch: int, consumed: DoneSet) -> Iterator[dict[str, Any]]:
        """The training items of pass `epoch`, minus `consumed`."""
        return self._cached_items(consumed) if self.config.cache else self.items(consumed)

    def _batch(self, items: list[dict[str, Any]], bad: list[tuple[str, str]]):
        self._last = id_keys([it["sample_id"] for it in items] + [sid for sid, _ in bad]).tolist()
        return (self.collate(items) if items else None), bad

    def taken(self) -> None:
        """The batch last yielded is being trained on (or skipped for good): a resume does not extract it again.
        (A batch the loop pulled but never took, at its last step, is extracted again.)"""
        self.consumed.extend(self._last)
        self._last = []

    def _stored(self, epoch: int, done: int) -> Iterator[tuple[Any, list]]:
        """An epoch after the first of a --cache training: the stored run, as a training on --run reads it."""
        self._last = []
        feed = CheckedFeed(open_dataset(self.config, self.config.cache), skip=self.config.skip_bad_samples)
        yield from RunBatches(self.config, feed, OneProcess(), feed.collate(self.collate)).epoch(epoch, done)

    def _cached_items(self, consumed: DoneSet) -> Iterator[dict[str, Any]]:
        """The first pass of a --cache training: `hsx run` into --cache (its manifest, checksums and resume), each
        committed sample read back from the run for training. A resumed pass first trains on what the run already
        holds and this epoch did not consume, then extracts the rest."""
        plan = prepare_job(self.plan.config)  # run.json written or checked, the cache's lease taken
        rows = queue.Queue(maxsize=4)  # batches of rows between the job and the trainer: the job waits when full
        stop = threading.Event()

        def hand(batch) -> None:
            self.target_forwards += batch["status"].to_pylist().count(OK)
            while not stop.is_set():
                try:
                    rows.put(batch, timeout=0.5)
                    return
                except queue.Full:
                    continue
            raise _Stopped("the training stopped reading the stream")

        def job() -> None:
            try:
                outcome = ("done", execute_job(plan, on_batch=hand))
            except BaseException as e:  # noqa: BLE001 - handed to the trainer's thread
                outcome = ("error", e)
            while not stop.is_set():  # unless the trainer stopped reading
                try:
                    rows.put(outcome, timeout=0.5)
                    return
                except queue.Full:
                    continue

        stored = ok_rows(plan.output) if not plan.new_run and len(plan.done) else None
        thread = threading.Thread(target=job, name="hsx-online-cache", daemon=True)
        thread.start()
        try:
            if stored is not None:
                for row in stored.to_pylist():
                    if not consumed.contains(id_keys([row["sample_id"]]))[0]:
                        yield self._stored_item(plan, {**row, "status": OK})
            while True:
                got = rows.get()
                if isinstance(got, tuple):
                    if got[0] == "error" and not isinstance(got[1], _Stopped):
                        raise got[1]
                    if got[0] == "done" and got[1].failed:
                        logger.warning("%d samples of the corpus failed to extract into --cache %s (`hsx status` "
                                       "lists why)", got[1].failed, plan.output.url)
                    break
                for row in got.to_pylist():
                    if row["status"] != OK:
                        self._item(row)  # counted as failed
                    elif not consumed.contains(id_keys([row["sample_id"]]))[0]:
                        yield self._stored_item(plan, row)
        finally:
            stop.set()
            thread.join()

    def _stored_item(self, plan: JobPlan, row: dict[str, Any]) -> dict[str, Any]:
        self.extracted += 1
        try:
            item = _read_item(plan.output.fs, plan.output.path(row["path"]), self.plan.spec, row,
                              self.config.batch_tokens, sample_range(row.get("offset"), row.get("bytes")))
        except (OSError, ValueError) as e:
            return {"bad": (row["sample_id"], " ".join(str(e).split()))}
        return self.feed.check(item)

    def items(self, done: DoneSet) -> Iterator[dict[str, Any]]:
        """The pass's samples as checked training items, in the order the workers finish them."""
        import ray
        import ray.data

        job = self.plan.config
        gpus, cpus = resolve_resources(job, self.local)
        registry = start_registry(done, job.registry_shards)
        ctx = ray.data.DataContext.get_current()
        saved = ctx.execution_options.resource_limits, ctx.execution_options.preserve_order
        ctx.execution_options.resource_limits = ray.data.ExecutionResources(
            object_store_memory=int(self.config.inflight_mb * 2**20))
        ctx.execution_options.preserve_order = True  # the corpus's order: a training that can be repeated
        try:
            with data_context(tokens_per_unit(job, self.plan.spec)):
                ds = build_dataset(self.plan, registry, gpus, cpus, self.plan.attempt, layout="online")
                for table in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                    self.peak_inflight_bytes = max(self.peak_inflight_bytes, _store_bytes())
                    for row in table.to_pylist():
                        item = self._item(row)
                        if item is not None:
                            yield item
            stats = registry_stats(registry)
            if stats["duplicates"]:
                logger.warning("%d records of the corpus repeat an id: each was extracted once", stats["duplicates"])
        finally:
            ctx.execution_options.resource_limits, ctx.execution_options.preserve_order = saved
            for shard in registry:
                try:
                    ray.kill(shard)
                except Exception:  # noqa: BLE001 - gone already
                    pass

    def _item(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """The row's sample as a training item (raw layout), {"bad": ...} when its file fails a check, None for a
        sample the extraction failed (counted, with its reason)."""
        sid = row["sample_id"]
        if row["status"] != OK:
            self.failed += 1
            if len(self.failures) < MAX_FAILURES_KEPT:
                self.failures[sid] = row["error"]
            return None
        self.extracted += 1
        self.target_forwards += 1
        path = f"{self._scratch}/{uuid.uuid4().hex}.safetensors"
        self._memory.pipe_file(path, row["payload"])
        try:
            item = _read_item(self._memory, path, self.plan.spec, row, self.config.batch_tokens)
        except (OSError, ValueError) as e:
            return {"bad": (sid, " ".join(str(e).split()))}
        finally:
            self._memory.rm_file(path)
        return self.feed.check(item)


class StreamHub:
    """One live extraction feeding several trainers (--fanout): each pass streams once and every item goes to each
    trainer that asked for the pass, through a bounded queue per trainer (a slow trainer makes the stream wait,
    within --inflight-mb; none is skipped or repeated). A pass skips only what every trainer in it consumed before
    a resume."""

    END = object()

    def __init__(self, stream: LiveBatches, trainers: int, queue_items: int = 64) -> None:
        self.stream = stream
        self.queues = [queue.Queue(maxsize=queue_items) for _ in range(trainers)]
        self.resumed: list[tuple[int, np.ndarray]] = [(0, np.zeros(0, np.uint64))] * trainers
        self.asking = [-1] * trainers
        """The pass each trainer waits for (-1: not yet asked)."""
        self.active = [True] * trainers
        self.error: BaseException | None = None
        self._changed = threading.Condition()

    def resume(self, i: int, epoch: int, consumed: np.ndarray) -> None:
        self.resumed[i] = (epoch, consumed)

    def finished(self, i: int) -> None:
        with self._changed:
            self.active[i] = False
            self._changed.notify_all()

    def run(self) -> None:
        """Stream the passes the trainers ask for, in this thread, until every trainer is done."""
        p = 0
        try:
            while True:
                with self._changed:  # every trainer asked for this pass or a later one (or is done)
                    self._changed.wait_for(lambda p=p: all(not a or k >= p for a, k in zip(self.active, self.asking)))
                    live = [i for i, a in enumerate(self.active) if a]
                    if not live:
                        return
                    needing = [i for i in live if self.asking[i] == p]
                if not needing:  # every trainer resumed in a later pass
                    p += 1
                    continue
                skip = None  # a trainer resumed in this pass consumed part of it; others need all of it
                for i in needing:
                    epoch, consumed = self.resumed[i]
                    keys = set(consumed.tolist()) if epoch == p else set()
                    skip = keys if skip is None else skip & keys
                for item in self.stream.items(DoneSet(np.asarray(sorted(skip), dtype=np.uint64))):
                    for i in needing:
                        self._put(i, (p, item))
                for i in needing:
                    self._put(i, (p, self.END))
                self.stream.passes += 1
                p += 1
        except BaseException as e:
            self.error = e
            raise

    def _put(self, i: int, what) -> None:

        while self.active[i]:
            try:
                self.queues[i].put(what, timeout=0.5)
                return
            except queue.Full:
                continue

    def items(self, i: int, epoch: int) -> Iterator[dict[str, Any]]:
        """Trainer i's items of pass `epoch`."""

        with self._changed:
            self.asking[i] = epoch
            self._changed.notify_all()
        while True:
            try:
                p, item = self.queues[i].get(timeout=0.5)
            except queue.Empty:
                if self.error is not None:
                    raise RuntimeError(f"the online extraction failed: {first_line(self.error)}") from self.error
                continue
            if item is self.END:
                return
            yield item



class _Stopped(Exception):
    """The trainer stopped reading the first pass of a --cache training (its steps are done)."""


def shuffled(items: Iterator[dict[str, Any]], capacity: int, rng) -> Iterator[dict[str, Any]]:
    """`items` in a random order drawn from a buffer of up to `capacity` bytes of states (a streaming shuffle: the
    stream's order is the workers', samples of one corpus file together; a trainer wants them mixed)."""
    buffer: list[dict[str, Any]] = []
    held = 0
    for item in items:
        buffer.append(item)
        held += _item_bytes(item)
        while buffer and held > capacity:
            j = rng.randrange(len(buffer))
            buffer[j], buffer[-1] = buffer[-1], buffer[j]
            out = buffer.pop()
            held -= _item_bytes(out)
            yield out
    rng.shuffle(buffer)
    yield from buffer


def _item_bytes(item: dict[str, Any]) -> int:
    states = item.get("hidden_states")
    return 0 if states is None else states.numel() * states.element_size()


def _read_item(fs, path: str, spec, row: dict[str, Any], max_length: int,
               byte_range: tuple[int, int] | None = None) -> dict[str, Any]:
    """A streamed sample's file read as the training feed reads a stored one (training.dataset's raw layout)."""
    names = (TOKEN_IDS, HIDDEN_STATES, LOSS_MASK) + (
        (TARGET_TOPK_IDS, TARGET_TOPK_LOGPROBS) if spec.target_top_k is not None else ())
    info, tensors = read_rows(fs, path, max_length, verify=True, names=names, byte_range=byte_range)
    problem = spec.file_spec().file_problem(info)
    if problem is None:
        mismatch = row_file_problem(info, row["sample_id"], row["num_tokens"], row["checksum"])
        problem = mismatch[1] if mismatch is not None else None
    if problem is not None:
        raise ValueError(f"the streamed states of sample {row['sample_id']!r} are not what the extraction "
                         f"recorded: {problem}")
    ids = tensors[TOKEN_IDS]
    item = {"input_ids": ids, "hidden_states": tensors[HIDDEN_STATES], "sample_id": row["sample_id"],
            "loss_mask": tensors[LOSS_MASK].long() if LOSS_MASK in tensors else ids.new_ones(ids.shape)}
    if spec.target_top_k is not None:
        item[TARGET_TOPK_IDS], item[TARGET_TOPK_LOGPROBS] = tensors[TARGET_TOPK_IDS], tensors[TARGET_TOPK_LOGPROBS]
    return item


def _store_bytes() -> int:
    """Bytes Ray's object store holds now (the stream's blocks among them)."""
    import ray

    total, free = ray.cluster_resources().get("object_store_memory", 0), \
        ray.available_resources().get("object_store_memory", 0)
    return int(max(0, total - free))



class LiveStream:
    """--online's data (a training.trainer.TrainingData): the stream's run spec checked against --kind and the
    target before any stream starts, the corpus's tokens for Drafter.prepare, the batches (`make_batches`, given
    once the Ray cluster is up), the stream's counts for report.json."""

    def __init__(self, config: TrainJobConfig, plan: JobPlan) -> None:
        self.config, self.plan = config, plan
        self.make_batches: Callable[[CheckedFeed, Any, dict[str, Any] | None], LiveBatches] | None = None
        """(feed, collate, resumed source state) -> the batches: LiveBatches, or a --fanout trainer's share."""
        self.live: LiveBatches | None = None

    def check(self) -> Checked:
        c = self.config
        target_config(c.model)
        check_layers(c, self.plan.spec, "--online's extraction", "add \"layers\": \"{ids}\" to --extract")
        identity = stream_identity(self.plan, c)
        return Checked(self.plan.spec, TargetHead.from_model_dir(c.model), identity)

    def vocabulary(self) -> CorpusTokens:
        return CorpusTokens(self.plan)

    def batches(self, replica, resumed: dict[str, Any] | None) -> LiveBatches:
        assert self.make_batches is not None, "make_batches is set once the Ray cluster is up"
        feed = CheckedFeed(None, skip=self.config.skip_bad_samples, spec=self.plan.spec)
        collate = PackCollator(self.config.batch_tokens, pad_to_max=False, overlong="truncate")
        self.live = self.make_batches(feed, collate, resumed)
        return self.live

    def report(self) -> tuple[int, dict[str, Any]]:
        live, c = self.live, self.config
        online = {"extracted": live.extracted, "failed": live.failed, "passes": live.passes,
                  "target_forwards": live.target_forwards, "inflight_mb": c.inflight_mb,
                  "peak_object_store_bytes": live.peak_inflight_bytes,
                  "failures": dict(list(live.failures.items())[:20])}
        return live.extracted, {"online": online}


def run_online(trainer: Trainer) -> dict[str, Any]:
    """trainer.run(); a Ray error (of the stream) is said as the online extraction's failure."""
    import ray

    try:
        return trainer.run()
    except ray.exceptions.RayError as e:
        raise RuntimeError(f"the online extraction failed: {first_line(e)}") from e


def train_online(config: TrainJobConfig) -> dict[str, Any]:
    """Train `config.kind` from a live extraction of `config.corpus`; the report (the trainer's, plus "online":
    samples extracted and failed, passes, the target's forward count, the peak of the object store)."""
    if config.fanout:
        raise ValueError(f"--fanout {config.fanout} trains several drafters: call training_jobs.train.train_drafter (or "
                         "training_jobs.fanout.train_fanout), not train_online, which trains one")
    plan = plan_stream(extraction_config(config))
    stream = LiveStream(config, plan)
    trainer = Trainer(config, stream)  # every check before the stream starts
    with ray_cluster(config.address) as local:
        stream.make_batches = lambda feed, collate, resumed: LiveBatches(config, plan, feed, collate, local, resumed)
        return run_online(trainer)
