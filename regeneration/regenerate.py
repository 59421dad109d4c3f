"""`hsx regenerate`: the target's own answers, from the OpenAI-compatible servers users already run (vLLM, SGLang,
`hsx serve`), written as a new corpus that `hsx run` extracts prefill-only.

    RegenerateConfig(...)                 the command's settings (flags map one to one): regeneration/config.py
    prepare_regeneration(config) -> RegenerationPlan
                                          servers probed (each answers /v1/models and serves the model), OUTPUT's
                                          regenerate.json written or checked, the writer lease taken, settled ids
                                          loaded; ValueError for anything the user must fix (exit 2)
    execute_regeneration(plan) -> RegenerateResult
    regenerate(config)                    both

What a record becomes (the corpus kinds `hsx run` reads; the shape is decided as `hsx run` decides it):
    {"messages" | "conversations": [...]}  every assistant turn regenerated in order from the conversation so far
                                           (system, user and tool turns kept; a conversation ending in another role
                                           gets one answer appended) -> {"messages": regenerated, "input_ids": the
                                           last request's prompt ids + its generated ids, "loss_mask": 1 on each
                                           regenerated turn's generated ids}
    {"prompt": text}                       one completion -> {"prompt", "completion", "input_ids": prompt + output}
    {"input_ids": [...], "loss_mask"?}     one completion of those ids -> input_ids + output, mask + ones
The token ids are the server's own (`return_token_ids`, which vLLM and `hsx serve` honour): the extraction sees
exactly the tokens the target produced. Where a server returns no ids, or a later turn's prompt renders an earlier
turn's ids differently, the record keeps its text only (chats: `messages`; prompts: prompt + completion as one
prompt) and `hsx run` tokenizes it; the job says so once. `--reasoning keep` stores a reasoning model's
`reasoning_content` (or vLLM's newer `reasoning`) beside each turn's content, `strip` drops it (the record then keeps
text only: the ids hold the reasoning).

OUTPUT (local or any fsspec URL) is a run of its own kind, exactly once like `hsx run`'s: regenerate.json (what
produced it; a re-run checks it), data parts of JSONL lines and the manifest rows that commit them, one row per input
record, "ok" or "failed" (corpus/regenerated.py owns the layout, its writer and its reader). A re-run skips
committed records and retries failed ones (not those failing for good, unless --retry-failed); after any kill every
input ends with exactly one settled row. `hsx run --corpus OUTPUT` reads the committed records only, `hsx status
OUTPUT` counts them.

The job, in this module: a reader feeds the corpus's unsettled records to --concurrency workers per server, each
regenerating one record at a time (regeneration/regenerator.py: turn replay, answers parsed and checked by regeneration/answers.py);
their outcomes go to one committer, which commits them every --flush-rows records or --flush-seconds. Ctrl-C, a lost
writer lease or a storage outage stops it early, keeping what was answered.

Servers (regeneration/server_pool.py): each gets --concurrency requests at once; a request goes to the live server with the
most free slots. A server that stops answering (connection refused or reset, 503, 429) is set aside with a growing back-off and its
requests move to the others, or wait for it; a request fails (retried by the next run) only when no server answers
for --server-wait-s. 500s and timeouts are retried --retries times with backoff (tenacity). 400, 413 and 422 (prompt
too long, bad request) fail the record with the server's own message; other 4xx (Ray Serve's 404 while an app
redeploys) set the server aside like one that does not answer. A server that answers what is not an OpenAI API
is refused before work, or set aside for good mid-run. No answer is trusted further than it can be checked
(regeneration/answers.py): one is read up to --max-answer-bytes and no further, no redirect is followed (a prompt never goes
to a server /v1/models did not vouch for), and generated ids beyond --max-tokens, or (with --tokenizer) ids that do
not decode to the answer's text, fail that record alone, naming the server; the others go on.

OUTPUT follows the rules of every hsx output folder (connectors.outputs): never a model's or a run's folder or inside
one, never over, in or around the corpus; a resume asks for the same settings and the same corpus files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from cluster.progress import progress_bar, set_total
from connectors.lease import WriterLease
from connectors.manifest import new_attempt_id
from connectors.outputs import OutputFolder, corpus_inputs, within_output
from connectors.run import RUN_JSON, RunDir, RunFormatError
from corpus.readers import count_records, expand_corpus, read_records
from corpus.records import Record
from corpus.regenerated import (
    REGEN_JSON,
    PartWriter,
    forget_finished,
    read_spec,
    remove_orphans,
    write_finished,
    write_spec,
)
from corpus.sample_registry import DoneSet, id_keys
from regeneration.answers import load_tokenizer
from regeneration.config import RegenerateConfig
from regeneration.regenerator import Outcome, Regenerator
from regeneration.server_pool import Pool, base_url

logger = logging.getLogger(__name__)


@dataclass
class RegenerationPlan:
    config: RegenerateConfig
    output: RunDir
    model: str
    servers: list[str]
    files: list
    done: Any
    attempt: str
    lease: Any
    new: bool
    tokenizer: Any = None
    """--tokenizer, loaded (None: the answers' ids are not checked against their text)."""


@dataclass
class RegenerateResult:
    output: str
    attempt: str
    new: bool = True
    records: int = 0
    """Records read this run."""
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    """Records an earlier run settled."""
    duplicates: int = 0
    exact: int = 0
    """Ok records that carry the servers' own token ids."""
    text_only: Counter = field(default_factory=Counter)
    """Why records keep text only: count."""
    tokens: int = 0
    requests: int = 0
    seconds: float = 0.0
    failures: list[tuple[str, str]] = field(default_factory=list)
    per_server: dict[str, tuple[int, float]] = field(default_factory=dict)
    """url -> (answers, seconds spent waiting on them)."""
    stopped: str | None = None
    """Why the run stopped early (the lease was lost, a storage outage), or None."""
    text_checked: bool = False
    """Whether the answers' token ids were decoded and compared with their text (--tokenizer)."""

    def lines(self) -> list[str]:
        secs = max(self.seconds, 1e-9)
        out = [f"hsx regenerate {'finished' if self.new else 'resumed and finished'} in {self.seconds:.1f}s: "
               f"{self.ok} ok, {self.failed} failed, {self.skipped} skipped (already done) of {self.records} records"
               + (f" ({self.duplicates} duplicate ids)" if self.duplicates else ""),
               f"  {self.requests} requests ({self.requests / secs:.1f}/s), {self.tokens} tokens stored "
               f"({self.tokens / secs:.0f}/s); {self.exact} of {self.ok} with the servers' own token ids"]
        if self.exact and not self.text_checked:
            out.append("  the servers' token ids were not checked against their text: pass --tokenizer (the served "
                       "model's) to check them")
        for why, n in self.text_only.items():
            out.append(f"  text only ({n}): {why}; hsx run tokenizes their text (tokens may differ from those the "
                       "target produced)")
        for url, (n, s) in self.per_server.items():
            out.append(f"  server {url}: {n} answers" + (f", {s / n:.2f} s each" if n else ""))
        out.append(f"  output:   {self.output}  (hsx run --corpus {self.output}; hsx status {self.output})")
        if self.failures:
            out.append(f"  first failures ({len(self.failures)} of {self.failed}):")
            out += [f"    {sid}: {err}" for sid, err in self.failures]
        if self.stopped:
            out.append(f"  STOPPED EARLY: {self.stopped}; re-run the same command to finish")
        return out


def prepare_regeneration(config: RegenerateConfig, within: str | None = None) -> RegenerationPlan:
    """Everything checked before the first request (ValueError for what the user must fix). `within`: the folder
    OUTPUT may lie inside (hsx run --regenerate-with's OUTPUT, which holds its regeneration)."""
    config.check_required()
    servers = [base_url(u) for u in config.server]
    if len(set(servers)) != len(servers):
        raise ValueError(f"--server lists a server twice: {servers}")
    files = expand_corpus(config.corpus, config.corpus_storage_options)
    output = RunDir(config.output, config.storage_options)
    check_output(output, config, files, within)
    output.check_reachable()
    if output.exists(RUN_JSON):
        raise ValueError(f"{output.url} holds an extraction run (run.json); write the regenerated corpus elsewhere")
    tokenizer = load_tokenizer(config.tokenizer, config.tokenizer_revision, config.trust_remote_code)
    model = served_model(config, asyncio.run(_probe(servers, config)))
    spec = check_spec(output, config, model, files)
    attempt = new_attempt_id()
    lease = WriterLease.acquire(output, attempt, break_lease=config.break_lease, command="hsx regenerate",
                                harm="Two writers would regenerate records twice")
    try:
        if spec is None:
            write_spec(output, config.spec(model), [f.url for f in files])
        forget_finished(output)
        removed = remove_orphans(output)
        if removed:
            logger.info("removed %d uncommitted data part(s) of an attempt that died", removed)
        done = DoneSet.load(output, retry_failed=config.retry_failed)
    except BaseException:
        lease.release()
        raise
    return RegenerationPlan(config, output, model, servers, files, done, attempt, lease, spec is None, tokenizer)


def served_model(config: RegenerateConfig, served: dict[str, list[str]]) -> str:
    """--model, or the one model every server serves; ValueError when a server does not serve it."""
    model = config.model
    if model is None:
        names = sorted({m for ids in served.values() for m in ids})
        if len(names) != 1:
            raise ValueError(f"the servers serve {names}; pass --model NAME")
        model = names[0]
    for url, ids in served.items():
        if model not in ids:
            raise ValueError(f"--server {url} does not serve model {model!r} (it serves {ids}); pass --model with "
                             "one of those, or drop the server")
    return model


def check_spec(output: RunDir, config: RegenerateConfig, model: str, files: list) -> dict[str, Any] | None:
    """OUTPUT's regenerate.json (None: a new regeneration), once it asks for these settings and corpus files;
    ValueError naming what differs."""
    try:
        spec = read_spec(output)
    except RunFormatError as e:
        raise ValueError(str(e)) from None
    if spec is not None:
        diff = config.spec_changes(model, spec.get("settings", {}))
        diff += _corpus_difference(spec.get("corpus"), [f.url for f in files])
        if diff:
            raise ValueError(f"{output.url} was regenerated with other settings: " + "; ".join(diff) + ". Re-run "
                             "with the same settings and --corpus to resume it, or write to another --output")
    return spec


def check_output(output: RunDir, config: RegenerateConfig, files: list, within: str | None) -> None:
    """The rules every output folder of hsx follows (connectors.outputs.OutputFolder): never a model's or a run's
    folder or inside one, never over, in or around the corpus; new, empty or an earlier regeneration (its
    regenerate.json). `within`: the run OUTPUT of hsx run --regenerate-with, whose checks cover a regeneration inside
    it. Object-store outputs have no folders to check."""
    if not output.local or within_output(config.output, within):
        return
    OutputFolder(config.output, command="regenerate", flag="--output",
                 inputs=corpus_inputs(config.corpus, [f.url for f in files]), legacy_markers=(REGEN_JSON,)).check()


def _corpus_difference(had: Any, now: list[str]) -> list[str]:
    """What differs between the corpus files regenerate.json names and those given now (resuming with another corpus
    would add its records to this one)."""
    if not isinstance(had, list):
        return []
    added, gone = sorted(set(now) - set(had)), sorted(set(had) - set(now))

    def show(urls: list[str]) -> str:
        return ", ".join(urls[:3]) + (f" and {len(urls) - 3} more" if len(urls) > 3 else "")

    return ([f"corpus: {len(added)} file(s) not in it now given ({show(added)})"] if added else []) + \
        ([f"corpus: {len(gone)} of its file(s) not given now ({show(gone)})"] if gone else [])


async def _probe(servers: list[str], config: RegenerateConfig) -> dict[str, list[str]]:
    async with Pool(servers, config.pool_settings()) as pool:
        return await pool.probe()


def execute_regeneration(plan: RegenerationPlan, stop: threading.Event | None = None) -> RegenerateResult:
    """Regenerate every record not settled; commits as it goes; releases the lease; writes FINISHED. Setting `stop`
    ends it early (what was answered is committed; RuntimeError)."""
    result = RegenerateResult(plan.output.url, plan.attempt, new=plan.new, text_checked=plan.tokenizer is not None)
    start = time.monotonic()
    try:
        with plan.lease.keep_alive() as lost:
            asyncio.run(_Run(plan, result, lost, stop or threading.Event()).run())
    finally:
        result.seconds = time.monotonic() - start
        with contextlib.suppress(Exception):
            write_finished(plan.output, plan.attempt, result.ok, result.failed, result.stopped)
        plan.lease.release()
    return result


def regenerate(config: RegenerateConfig) -> RegenerateResult:
    return execute_regeneration(prepare_regeneration(config))


class _Run:
    """One execution of a plan: the reader feeds unsettled records to the workers (--concurrency per server), their
    outcomes go to the committer. Built before asyncio.run starts the loop: its queues bind to the loop that
    first uses them (Python >= 3.10)."""

    def __init__(self, plan: RegenerationPlan, result: RegenerateResult, lost: threading.Event,
                 stop: threading.Event) -> None:
        self.plan, self.config, self.result, self.lost, self.stop = plan, plan.config, result, lost, stop
        self.writer = PartWriter(plan.output, plan.attempt)
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=4 * self.config.concurrency * len(plan.servers))
        self.outcomes: asyncio.Queue = asyncio.Queue()
        self.seen: set[int] = set()
        self.warned: set[str] = set()
        self.bar = progress_bar("regenerating", "record", self.config.progress)

    async def run(self) -> None:
        config = self.config
        async with Pool(self.plan.servers, config.pool_settings()) as pool:
            regen = Regenerator(pool, config, self.plan.model, self.plan.tokenizer)
            committer = asyncio.create_task(self.commit())
            total = self._count_total()
            workers = [asyncio.create_task(self.work(regen)) for _ in range(config.concurrency * len(self.plan.servers))]
            reader = asyncio.create_task(self.read())
            try:
                await _first_error(reader, committer)
                for _ in workers:
                    await self.queue.put(None)
                await _first_error(asyncio.gather(*workers), committer)
                await self.outcomes.put(StopAsyncIteration)
                await committer
            except BaseException as e:  # Ctrl-C, the lease lost, storage down, a bug: keep what was answered, stop
                await self._stop_early(e, [reader, *workers, committer])
                raise
            finally:
                self.bar.close()
                total.cancel()
                self.result.requests = sum(s.answered for s in pool.servers)
                self.result.per_server = {s.url: (s.answered, s.seconds) for s in pool.servers}

    def _count_total(self) -> asyncio.Task:
        """The corpus's records counted beside the work: the progress bar's total once known."""
        files, options = self.plan.files, self.config.corpus_storage_options
        total = asyncio.create_task(asyncio.to_thread(lambda: sum(count_records(f, options) for f in files)))
        total.add_done_callback(lambda t: t.cancelled() or t.exception() is not None
                                or set_total(self.bar, t.result()))
        return total

    async def read(self) -> None:
        """Every record of the corpus: settled ones skipped, duplicates and unreadable ones failed, the rest queued."""
        for file in self.plan.files:
            blocks = read_records(file, self.config.id_field, self.config.corpus_storage_options)
            while (block := await asyncio.to_thread(next, blocks, None)) is not None:
                keys = id_keys([r.sample_id for r in block])
                settled = self.plan.done.contains(keys)
                for record, key, done in zip(block, keys.tolist(), settled):
                    await self._admit(record, key, done)

    async def _admit(self, record: Record, key: int, done: bool) -> None:
        result = self.result
        result.records += 1
        if done:
            result.skipped += 1
            self.bar.update(1)
            return
        if key in self.seen:
            result.duplicates += 1
            await self.outcomes.put(Outcome(record.sample_id, record.source, retry=False, error=(
                f"{record.source}: duplicate sample id {record.sample_id!r} (another record has it); "
                "give each record its own id")))
            return
        self.seen.add(key)
        if record.error is not None:
            await self.outcomes.put(Outcome(record.sample_id, record.source, error=record.error, retry=False))
            return
        await self.queue.put(record)

    async def work(self, regen: Regenerator) -> None:
        while (record := await self.queue.get()) is not None:
            await self.outcomes.put(await regen.run(record.sample_id, record.source, record.payload))

    async def commit(self) -> None:
        """Outcomes into the writer, committed every --flush-rows or --flush-seconds; ends at StopAsyncIteration,
        raises when the lease is lost or `stop` is set."""
        while True:
            try:
                o = await asyncio.wait_for(self.outcomes.get(), timeout=1.0)
            except asyncio.TimeoutError:
                o = None
            if o is StopAsyncIteration:
                break
            if o is not None:
                self._settle(o)
                self.bar.update(1)
                self.bar.set_postfix_str(f"ok={self.result.ok} failed={self.result.failed}", refresh=False)
            if self.lost.is_set():
                raise RuntimeError("the writer lease was lost")
            if self.stop.is_set():
                raise RuntimeError("stopped")
            if self.writer.due(self.config.flush_rows, self.config.flush_seconds):
                await asyncio.to_thread(self.writer.flush)
        await asyncio.to_thread(self.writer.flush)

    def _settle(self, o: Outcome) -> None:
        _count(self.result, o, self.warned)
        self.writer.add(o)

    async def _stop_early(self, error: BaseException, tasks: list[asyncio.Task]) -> None:
        """Every task cancelled; what was answered committed (unless the lease is gone: another writer may hold it)."""
        self.result.stopped = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not self.lost.is_set():
            while not self.outcomes.empty():
                o = self.outcomes.get_nowait()
                if isinstance(o, Outcome):
                    self._settle(o)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.writer.flush)


async def _first_error(task, committer: asyncio.Task) -> None:
    """Wait for `task`; the committer failing (storage, lease) stops the wait with its error."""
    task = asyncio.ensure_future(task)
    done, _ = await asyncio.wait({task, committer}, return_when=asyncio.FIRST_COMPLETED)
    if committer in done and task not in done:
        task.cancel()
        committer.result()
        raise RuntimeError("the commit loop ended early")
    task.result()


def _count(result: RegenerateResult, o: Outcome, warned: set[str]) -> None:
    if o.record is None:
        result.failed += 1
        if len(result.failures) < 10:
            result.failures.append((o.sample_id, o.error or ""))
        return
    result.ok += 1
    result.tokens += o.tokens
    if o.exact:
        result.exact += 1
    elif o.text_only_reason:
        result.text_only[o.text_only_reason] += 1
        if o.text_only_reason not in warned:
            warned.add(o.text_only_reason)
            logger.warning("records keep their text only: %s (first: %s); hsx run tokenizes them", o.text_only_reason,
                           o.sample_id)
