"""The extraction-job commands: run, submit, status, estimate, demo, verify, report (jobs/)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys

from cli.args import (
    EXIT_FAILED,
    EXIT_OK,
    JOB_REQUIRED,
    UsageError,
    add_command,
    config_from_args,
    config_to_argv,
)
from connectors.lease import LeaseHeld, WriterLease
from connectors.run import RUN_JSON, RunDir, RunFormatError, read_run_spec
from jobs.config import CompactConfig, DemoConfig, EstimateConfig, JobConfig, StatusConfig, SubmitConfig
from jobs.demo import run_demo
from jobs.report_config import ReportConfig
from jobs.verify_config import VerifyConfig
from regeneration.config import REASONING, RegenerateConfig


def register(sub) -> None:
    """Add this floor's subcommands to the `hsx` subparsers."""
    add_command(sub, "run", JobConfig, _cmd_run, help="run an extraction job (local Ray unless --address)",
                description="Run an extraction job: corpus -> OUTPUT/data/**.safetensors + OUTPUT/manifest. "
                            "Re-running the same command resumes: committed samples are skipped.")
    add_command(sub, "submit", SubmitConfig, _cmd_submit, help="submit the same job to a Ray cluster's job API",
                description="Submit `hsx run` with these settings through Ray's job submission API. The cluster "
                            "needs hsx installed (see infra/) and access to model, corpus and output paths. Prints "
                            "the job id.")
    add_command(sub, "status", StatusConfig, _cmd_status, help="progress and counts of a run, from its manifest",
                description="Counts by sample (ok, failed, skipped), tokens and bytes, failure and skip reasons; "
                            "of an extraction run or of a corpus of hsx regenerate.")
    add_command(sub, "regenerate", RegenerateConfig, _cmd_regenerate, choices={"reasoning": REASONING},
                help="the target's own answers from OpenAI-compatible servers (vLLM, SGLang, hsx serve), as a corpus",
                description="Regenerate every assistant turn (chats, turn by turn) or the answer (prompts) of a corpus "
                            "through OpenAI-compatible servers, keeping the servers' own token ids; writes a new "
                            "corpus to OUTPUT in committed parts with a manifest. `hsx run --corpus OUTPUT` extracts it "
                            "prefill-only. Re-running the same command resumes: committed records are skipped.")
    add_command(sub, "compact", CompactConfig, _cmd_compact, help="merge a run's manifest parts into a few large ones",
                description="Merge the manifest's part files (one per commit) into a few large parts sorted by "
                            "sample id, atomically: a reader sees the old parts or the new ones, never both or "
                            "neither. Every row is kept. Takes the run's writer lease (not while a job writes).")
    add_command(sub, "estimate", EstimateConfig, _cmd_estimate, help="tokens, bytes and files a run would produce",
                description="Tokenize the corpus as `hsx run` would (no model weights, no Ray) and report the "
                            "samples, tokens, bytes and files the run will produce.")
    add_command(sub, "demo", DemoConfig, _cmd_demo,
                help="build a tiny model and corpus in DIR and run a real job on them",
                description="Builds a tiny random model and a small mixed-format corpus in DIR (no downloads), runs "
                            "`hsx run` on a local Ray into DIR/output, and shows where the files and the manifest "
                            "are.")
    add_command(sub, "verify", VerifyConfig, _cmd_verify, positional=("output",),
                help="check a run's files (checksums, headers, NaN/Inf), recompute a few, mark bad ones for "
                     "re-extraction",
                description="Check every (or --sample N) committed file of a run against its manifest row, "
                            "recompute --recompute K of them with a plain transformers forward, and mark failed "
                            "samples so that re-running the same `hsx run` re-extracts them. Writes a JSON report "
                            "to OUTPUT/verify/; exits 1 when anything fails.")
    add_command(sub, "report", ReportConfig, _cmd_report,
                help="one HTML page with plots of a run: lengths, loss masks, per-layer state magnitudes, failures",
                description="Draw a run from its manifest and a random sample of its files into one self-contained "
                            "HTML page (opens offline): length histograms per corpus file, loss-mask coverage, the "
                            "RMS of each stored layer by token position, zero and NaN/Inf rows, bytes per token, "
                            "failures by reason, verify status, throughput over time; and the checks those numbers "
                            "fail (a dead layer, a normalized last layer labelled pre-norm, masks covering 0%). A run "
                            "a live `hsx run` writes is refused unless --snapshot; an existing --out is replaced "
                            "only when it is an earlier page of hsx report.")


def _cmd_run(args: argparse.Namespace) -> int:
    from jobs.pipeline import JobFailed, execute_job, prepare_job  # pyarrow: the CLI's parser must stay cheap

    config = config_from_args(args, JobConfig, required=JOB_REQUIRED)
    try:
        plan = prepare_job(config)
    except ValueError as e:
        raise UsageError(str(e)) from e
    try:
        result = execute_job(plan)
    except JobFailed as e:
        print(f"hsx: job failed: {e}", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as e:  # resources the cluster cannot provide
        raise UsageError(str(e)) from e
    print("\n".join(result.lines()))
    if result.failed and config.fail_on_error:
        print(f"hsx: {result.failed} samples failed (--fail-on-error)", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _cmd_regenerate(args: argparse.Namespace) -> int:
    from regeneration.regenerate import (  # pyarrow: the CLI's parser must stay cheap
        execute_regeneration,
        prepare_regeneration,
    )

    config: RegenerateConfig = config_from_args(args, RegenerateConfig)
    try:
        plan = prepare_regeneration(config)
    except (ValueError, LeaseHeld) as e:
        raise UsageError(str(e)) from e
    try:
        result = execute_regeneration(plan)
    except Exception as e:  # noqa: BLE001 - storage gone, the lease lost: what was answered is committed
        print(f"hsx regenerate: stopped: {type(e).__name__}: {e}; records committed before are kept — re-run the "
              "same command to finish", file=sys.stderr)
        return EXIT_FAILED
    print("\n".join(result.lines()))
    return EXIT_OK


def _cmd_submit(args: argparse.Namespace) -> int:
    from jobs.submit import follow_job, submit_job  # requests: the CLI's parser must stay cheap

    config: SubmitConfig = config_from_args(args, SubmitConfig, required=(*JOB_REQUIRED, "address"))
    entrypoint = shlex.join(["hsx", "run", *config_to_argv(config, exclude=("address",))])
    try:
        runtime_env = config.runtime_env_dict()
        job_id = submit_job(config.address, entrypoint, runtime_env=runtime_env, submission_id=config.submission_id)
    except (ValueError, ConnectionError) as e:
        raise UsageError(str(e)) from e
    print(job_id)
    if not config.wait:
        print(f"submitted; follow with: ray job logs --address {config.address} --follow {job_id}", file=sys.stderr)
        return EXIT_OK
    status = follow_job(config.address, job_id)
    return EXIT_OK if status == "SUCCEEDED" else EXIT_FAILED


def _cmd_compact(args: argparse.Namespace) -> int:
    from connectors.manifest import compact_manifest, new_attempt_id  # pyarrow: the CLI's parser must stay cheap

    config: CompactConfig = config_from_args(args, CompactConfig)
    output = RunDir(config.output, config.storage_options)
    if not output.exists(RUN_JSON):
        raise UsageError(f"{output.url} holds no hsx run (no {RUN_JSON}); check the path")
    try:  # a job writing the run commits parts meanwhile: compact once it has ended (jobs compact at their end)
        lease = WriterLease.acquire(output, new_attempt_id(), break_lease=config.break_lease, command="hsx run or "
                                    "hsx compact", harm="Compacting while it commits could lose its newest rows")
    except LeaseHeld as e:
        raise UsageError(str(e)) from e
    try:
        done = compact_manifest(output, rows_per_part=config.rows_per_part)
    except RunFormatError as e:
        print(f"hsx compact: {e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        lease.release()
    if done.rows < 0:
        print(f"{output.url}: the manifest has {done.parts_before} part(s); nothing to merge")
    else:
        print(f"{output.url}: {done.rows} manifest rows in {done.parts_before} parts -> {done.parts_after}")
    return EXIT_OK


def _cmd_status(args: argparse.Namespace) -> int:
    from cluster.progress import human_bytes, human_count  # pyarrow: the CLI's parser must stay cheap
    from connectors.manifest_writer import summarize  # pyarrow: the CLI's parser must stay cheap
    from jobs.verify import latest_report  # pyarrow: the CLI's parser must stay cheap

    config: StatusConfig = config_from_args(args, StatusConfig)
    output = RunDir(config.output, config.storage_options)
    from corpus.regenerated import read_spec  # pyarrow: the CLI's parser must stay cheap

    try:
        regenerated = read_spec(output)
    except RunFormatError as e:
        raise UsageError(str(e)) from e
    if regenerated is not None:
        return _regenerated_status(output, regenerated, config)
    try:
        spec = read_run_spec(output)
        if spec is None:
            raise UsageError(f"{output.url} holds no hsx run (no run.json); check the path")
        s = summarize(output, max_errors=config.errors)
    except RunFormatError as e:
        raise UsageError(str(e)) from e
    if config.json:
        print(json.dumps({"output": output.url, "run": spec.to_json(), **dataclasses.asdict(s),
                          "verify": latest_report(output)}, indent=2, default=str))
        return EXIT_OK
    print(f"run:      {output.url}")
    stored = f" stored as {spec.storage_dtype}" if spec.storage_dtype else ""
    target = f"  + {spec.target} target in place of layer {spec.num_hidden_layers}" if spec.target else ""
    print(f"model:    {spec.model}  layers {list(spec.layer_ids)}  {spec.dtype}{stored}{target}")
    print(f"samples:  {s.ok} ok, {s.failed} failed" + (f", {s.skipped} skipped" if s.skipped else "")
          + (f" ({s.failed_for_good} failed the same way every time: re-runs skip them; fix the records, then "
             "--retry-failed)" if s.failed_for_good else "")
          + (f", {s.truncated} truncated" if s.truncated else ""))
    where = f"{s.shards} shards (--layout sharded)" if s.shards else f"{s.ok} files"
    print(f"data:     {human_count(s.tokens)} tokens, {human_bytes(s.bytes)} in {where}")
    print(f"manifest: {s.rows} rows in {s.parts} parts from {s.attempts} attempts")
    if s.invalid:
        print(f"invalid:  {s.invalid} samples whose files hsx verify found bad; re-run the job to re-extract them")
    if s.duplicate_ok_rows:
        print(f"WARNING:  {s.duplicate_ok_rows} duplicate ok rows (exactly-once was broken)")
    report = latest_report(output)
    if report is not None:
        recomputed = f", {len(report.get('recomputed', []))} recomputed" if report.get("recomputed") else ""
        print(f"verify:   {report.get('started_at')}: {report.get('checked')} checked, "
              f"{len(report.get('failures', []))} failed{recomputed}"
              + (f" ({', '.join(f'{k} {n}' for k, n in report['kinds'].items())})" if report.get("kinds") else ""))
    if s.skipped:
        print(f"skipped:  {s.skipped} samples whose states were refused (--on-nonfinite skip); final, no resume "
              "extracts them again")
        for sid, why in s.skips:
            print(f"  {sid}: {why}")
    if s.error_kinds:
        print("failures by kind: " + ", ".join(f"{k} ({n})" for k, n in s.error_kinds.items()))
        for sid, err in s.errors:
            print(f"  {sid}: {err}")
    print(f"see it:   hsx report {output.url} --out report.html  (plots of lengths, loss masks, state magnitudes)")
    return EXIT_OK


def _cmd_report(args: argparse.Namespace) -> int:
    from jobs.report import write_report  # pyarrow: the CLI's parser must stay cheap

    config: ReportConfig = config_from_args(args, ReportConfig)
    try:
        path, data = write_report(config)
    except ValueError as e:
        raise UsageError(str(e)) from e
    s = data["states"]
    print(f"report of {data['run']['url']}: {data['counts']['ok']} samples, {s['sampled']} files sampled -> {path}")
    if data["snapshot"]:
        print(f"  snapshot: the run is being written by {data['snapshot']['writer']}; the page shows the rows "
              f"committed at {data['snapshot']['taken_at']} (--snapshot)")
    for name, why in data["figures_not_drawn"].items():
        print(f"  warning: figure {name} not drawn ({why}); the page has its numbers and a note in its place")
    for f in data["flags"]:
        print(f"  {f['severity']}: [{f['check']}] {f['message']}")
    return EXIT_OK


def _regenerated_status(output, doc: dict, config: StatusConfig) -> int:
    """`hsx status` of a corpus of hsx regenerate: its settings and counts (ok + failed == records tried)."""
    from cluster.progress import human_bytes, human_count  # pyarrow: the CLI's parser must stay cheap
    from connectors.manifest_writer import summarize  # pyarrow: the CLI's parser must stay cheap

    s = summarize(output, max_errors=config.errors)
    if config.json:
        print(json.dumps({"output": output.url, "regenerated": doc, **dataclasses.asdict(s)}, indent=2, default=str))
        return EXIT_OK
    settings = doc.get("settings", {})
    print(f"regenerated corpus: {output.url}")
    print(f"model:    {settings.get('model')}  max_tokens {settings.get('max_tokens')}  temperature "
          f"{settings.get('temperature')}  top_p {settings.get('top_p')}  seed {settings.get('seed')}  reasoning "
          f"{settings.get('reasoning')}")
    print(f"records:  {s.ok} ok, {s.failed} failed ({s.ok + s.failed} tried)"
          + (f"; {s.failed_for_good} failed the same way every time: re-runs skip them (--retry-failed)"
             if s.failed_for_good else ""))
    print(f"data:     {human_count(s.tokens)} tokens, {human_bytes(s.bytes)}; manifest: {s.rows} rows in {s.parts} "
          f"parts from {s.attempts} attempts")
    if s.duplicate_ok_rows:
        print(f"WARNING:  {s.duplicate_ok_rows} duplicate ok rows (exactly-once was broken)")
    if s.error_kinds:
        print("failures by kind: " + ", ".join(f"{k} ({n})" for k, n in s.error_kinds.items()))
        for sid, err in s.errors:
            print(f"  {sid}: {err}")
    print(f"extract:  hsx run --corpus {output.url} --model MODEL --output RUN")
    return EXIT_OK


def _cmd_estimate(args: argparse.Namespace) -> int:
    from jobs.estimate import estimate  # torch, pyarrow: the CLI's parser must stay cheap

    config: EstimateConfig = config_from_args(args, EstimateConfig, required=("model", "corpus"))
    try:
        est = estimate(config, limit=config.limit)
    except ValueError as e:
        raise UsageError(str(e)) from e
    print(json.dumps(dataclasses.asdict(est), indent=2) if config.json else "\n".join(est.lines()))
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    config: DemoConfig = config_from_args(args, DemoConfig)
    return run_demo(config.dir, workers=config.workers, progress=config.progress, verbose=config.verbose)


def _cmd_verify(args: argparse.Namespace) -> int:
    from jobs.verify import verify_run  # pyarrow: the CLI's parser must stay cheap

    config: VerifyConfig = config_from_args(args, VerifyConfig)
    try:
        report = verify_run(config)
    except (ValueError, LeaseHeld) as e:
        raise UsageError(str(e)) from e
    print("\n".join(report.lines()))
    return EXIT_OK if report.ok else EXIT_FAILED
