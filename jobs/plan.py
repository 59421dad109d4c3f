"""Planning an extraction job: everything decided before Ray starts, shared by `hsx run` and what builds on it.

    prepare_job(config) -> JobPlan      model facts, corpus files, run.json written or checked, resume set, and
                                        whether anything is left to do. Raises ValueError for anything the user
                                        must fix (the CLI exits 2).
    JobPlan                             what execute_job (jobs/pipeline.py) runs
    load_chat_template(config, facts)   the chat template in effect and where it came from
    plan_key(config, files)             what planned a job, hashed (run.json's plan_key)
    finished_result(plan) -> JobResult  the result of a plan with nothing left (Ray never started)

A finished run re-run with the same command is answered from run.json's plan key and the manifest alone: no model
config, tokenizer, torch or Ray is loaded (`benchmarks/bench_cli_startup.py` times it). Any difference in the
settings, the model folder's files or the corpus files makes the full planning run, which checks run.json as always.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from cluster.progress import JobResult
from connectors.lease import WriterLease
from connectors.manifest import new_attempt_id
from connectors.outputs import check_run_output, corpus_inputs
from connectors.run import RunDir, RunSpec, read_run_spec
from corpus.readers import CorpusFile, expand_corpus, read_records
from corpus.sample_registry import DoneSet, id_keys
from extractor.plugins import declared
from jobs.config import JobConfig

if TYPE_CHECKING:
    from jobs.model import ModelFacts

PLAN_KEY_VERSION = "1"
"""Bumped when what a plan is made of changes in a way the key's inputs do not show."""


@dataclass
class JobPlan:
    config: JobConfig
    facts: ModelFacts | None
    """The target's facts; None only for a finished run recognised by its plan key (nothing left: no model read)."""
    output: RunDir
    files: list[CorpusFile]
    chat_template: str | None
    """Template text replacing the tokenizer's, or None."""
    spec: RunSpec
    """run.json as written (new run) or checked (resume)."""
    new_run: bool
    done: DoneSet
    """Keys of the sample ids already settled — committed ("ok"), skipped for good ("skipped", --on-nonfinite skip),
    or failing the same way every time (unless --retry-failed): 8 bytes an id, never the id strings."""
    attempt: str = ""
    """This attempt's id (manifest parts, the lease)."""
    lease: WriterLease | None = None
    """The output's writer lease, held from planning to the end of execute_job."""
    nothing_left: bool = False
    """Every record of the corpus is settled: the job finishes without starting Ray."""
    regeneration: object = None
    """--regenerate-with: the regeneration (regeneration.regenerate.RegenerationPlan) whose corpus this job follows."""


def load_chat_template(config: JobConfig, facts: ModelFacts) -> tuple[str | None, str | None, str]:
    """(override text or None, the template in effect, where it came from)."""
    import fsspec

    if config.chat_template:
        try:
            with fsspec.open(config.chat_template, "rt", encoding="utf-8", **config.corpus_storage_options) as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {config.chat_template!r} cannot be read: {e}") from e
        if not text.strip():
            raise ValueError(f"--chat-template {config.chat_template!r} is empty")
        return text, text, config.chat_template
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(facts.model, revision=config.revision,
                                              trust_remote_code=config.trust_remote_code)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return None, template, "tokenizer" if template else "none"


def prepare_job(config: JobConfig) -> JobPlan:
    """Everything that can be checked before Ray starts; writes run.json (or checks it on a resume)."""
    config.check_required()
    config.check_engine_installed()
    output = RunDir(config.output, config.storage_options)
    corpus = [] if config.regenerate_with else expand_corpus(config.corpus, config.corpus_storage_options)
    # never the model, a corpus file, inside either or another run, a file, or a folder of other things
    check_run_output(config.output, inputs={"--model": config.model,
                                            **corpus_inputs(config.corpus, [f.url for f in corpus])})
    output.check_reachable()
    key = "" if config.regenerate_with else plan_key(config, corpus)  # before the model is read
    started = _started(config, output, corpus, key) if key else None
    if started is not None and started.nothing_left:
        return started
    from jobs.model import ModelFacts  # transformers and torch: not for a finished run's re-run

    try:
        facts = ModelFacts.resolve(config)
    except BaseException:
        if started is not None:
            started.lease.release()
        raise
    regeneration = None
    if config.regenerate_with:  # the servers' answers, followed as they are committed
        from regeneration.regenerate import prepare_regeneration

        regeneration = prepare_regeneration(config.regenerate_config(), within=config.output)
        files = [CorpusFile(regeneration.output.url, "regenerated-follow")]
    else:
        files = corpus
    try:
        return _plan(config, output, facts, files, regeneration, key, started)
    except BaseException:
        if regeneration is not None:
            regeneration.lease.release()
        raise


PLAN_FREE_SETTINGS = ("workers", "max_workers", "gpus_per_worker", "cpus_per_worker", "tokenizer_workers",
                      "tokens_per_task", "address", "registry_shards", "fail_on_error", "storage_retry_seconds",
                      "manifest_flush_rows", "manifest_flush_seconds", "compact", "progress", "verbose",
                      "break_lease", "storage_options", "corpus_storage_options")
"""JobConfig fields that never change what a job plans (where it runs, how it reports, credentials): left out of
the plan key, so changing them keeps a finished run's re-run cheap. Every other field, a new one too, is in it."""
KEYED_PACKAGES = ("jobs", "corpus", "connectors", "extractor", "drafters")
"""hsx's packages whose code derives a run's spec: their .py files' sizes and times are in the plan key (an
editable install's version never changes)."""


def plan_key(config: JobConfig, files: list[CorpusFile]) -> str:
    """What plans this job, hashed: its settings (but PLAN_FREE_SETTINGS), the model folder's and the corpus files'
    names, sizes and modification times, the code that derives a run's spec (KEYED_PACKAGES' files, the drafter and
    engine plug-ins declared, the run and fingerprint formats) and the versions of the packages that read the model.
    Equal keys make the same plan (run.json's `plan_key`); "" when the model or a corpus file is not on local disk
    or cannot be listed (nothing cheap to key it by: the full planning runs)."""
    from connectors.fingerprint import FINGERPRINT_SCHEME
    from connectors.run import RUN_FORMAT_VERSION
    from extractor import engines, methods

    paths = [f.url for f in files] + ([config.chat_template] if config.chat_template else [])
    if not os.path.isdir(config.model) or any("://" in p or not os.path.isfile(p) for p in paths):
        return ""
    settings = {k: v for k, v in config.to_dict().items() if k not in PLAN_FREE_SETTINGS}
    versions = {}
    for package in ("hsx", "transformers", "tokenizers", "torch"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = ""
    plugins = sorted(f"{ep.group} {ep.name} {ep.value} {ep.dist.name if ep.dist else ''} "
                     f"{ep.dist.version if ep.dist else ''}"
                     for group in (methods.ENTRY_POINT_GROUP, engines.ENTRY_POINT_GROUP) for ep in declared(group))
    digest = hashlib.sha256(json.dumps({"key": PLAN_KEY_VERSION, "settings": settings, "versions": versions,
                                        "plugins": plugins, "formats": [RUN_FORMAT_VERSION, FINGERPRINT_SCHEME]},
                                       sort_keys=True, default=str).encode())
    model = os.path.abspath(config.model)
    code = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        listed = [os.path.join(model, name) for name in sorted(os.listdir(model))]
        listed += [os.path.abspath(p) for p in paths]
        listed += sorted(os.path.join(code, package, name) for package in KEYED_PACKAGES
                         for name in os.listdir(os.path.join(code, package)) if name.endswith(".py"))
        for path in listed:
            st = os.stat(path)  # a dangling link, a file gone meanwhile: no key
            digest.update(f"{path}\t{st.st_size}\t{st.st_mtime_ns}\t{st.st_mode}\n".encode())
    except OSError:
        return ""
    return digest.hexdigest()


def _started(config: JobConfig, output: RunDir, files: list[CorpusFile], key: str) -> JobPlan | None:
    """When run.json's plan key is this job's: the plan so far, holding the lease and the settled ids, with
    `nothing_left` set when every corpus record is settled (no model read, no torch). None otherwise."""
    present = read_run_spec(output)
    if present is None or present.plan_key != key:
        return None
    attempt = new_attempt_id()
    lease = WriterLease.acquire(output, attempt, break_lease=config.break_lease)
    try:
        plan = JobPlan(config, None, output, files, None, present, False,
                       DoneSet.load(output, retry_failed=config.retry_failed), attempt, lease)
        plan.nothing_left = _nothing_left(plan)
    except BaseException:
        lease.release()
        raise
    return plan


def _plan(config: JobConfig, output: RunDir, facts: ModelFacts, files: list[CorpusFile], regeneration,
          key: str = "", started: JobPlan | None = None) -> JobPlan:
    """The full plan. `started`: what _started found for a matching key with work left (its lease, run.json and
    settled ids are taken over, not acquired and read again)."""
    from jobs.runinfo import build_run_spec, ensure_run_spec  # jobs.model: transformers

    if started is None:
        attempt = new_attempt_id()
        lease = WriterLease.acquire(output, attempt, break_lease=config.break_lease)  # before run.json: one writer
    else:
        attempt, lease = started.attempt, started.lease
    try:
        override, template, template_source = load_chat_template(config, facts)
        present = started.spec if started is not None else read_run_spec(output)  # written once, under the lease
        spec = build_run_spec(config, facts, files, template, template_source, present=present)
        if present is None and key:
            spec = dataclasses.replace(spec, plan_key=key)
        new_run = ensure_run_spec(output, spec, present)
        if new_run:
            done = DoneSet()
        else:
            done = started.done if started is not None else DoneSet.load(output, retry_failed=config.retry_failed)
        plan = JobPlan(config, facts, output, files, override, spec, new_run, done, attempt, lease,
                       regeneration=regeneration)
        plan.nothing_left = regeneration is None and started is None and _nothing_left(plan)
    except BaseException:
        lease.release()
        raise
    return plan


def _nothing_left(plan: JobPlan) -> bool:
    """True when every record of the corpus is already settled (reads the corpus's ids, not its samples).

    Stops at the first record still to do. Remote JSONL is not read here (the job would read it again): such a
    resume starts Ray and lets the read stage skip what is done.
    """
    if plan.new_run or not len(plan.done) or any(f.format == "jsonl" and "://" in f.url for f in plan.files):
        return False
    c = plan.config
    for file in plan.files:
        for block in read_records(file, c.id_field, c.corpus_storage_options):
            if not plan.done.contains(id_keys(r.sample_id for r in block)).all():  # a broken record: its derived id
                return False
    return True


def finished_result(plan: JobPlan) -> JobResult:
    """What a job with nothing left did (every record settled: skipped, Ray never started); gives the lease back."""
    result = JobResult(output=plan.output.url, attempt=plan.attempt or new_attempt_id(), new_run=plan.new_run)
    result.skipped = len(plan.done)
    if plan.lease is not None:
        plan.lease.release()
    return result
