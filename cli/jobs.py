"""The extraction-job commands: run, submit, status, estimate, demo, verify (jobs/)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys

from cli.args import EXIT_FAILED, EXIT_OK, UsageError, add_config_arguments, config_from_args, config_to_argv


def register(sub) -> None:
    """Add this floor's subcommands to the `hsx` subparsers."""
    run = sub.add_parser("run", help="run an extraction job (local Ray unless --address)",
                         description="Run an extraction job: corpus -> OUTPUT/data/**.safetensors + OUTPUT/manifest. "
                                     "Re-running the same command resumes: committed samples are skipped.")
    add_config_arguments(run)
    run.set_defaults(func=_cmd_run)

    submit = sub.add_parser("submit", help="submit the same job to a Ray cluster's job API",
                            description="Submit `hsx run` with these settings through Ray's job submission API. The "
                                        "cluster needs hsx installed (see infra/) and access to model, corpus and "
                                        "output paths. Prints the job id.")
    add_config_arguments(submit, exclude=("address",))
    submit.add_argument("--address", required=True, metavar="URL",
                        help="the cluster's dashboard, e.g. http://HEAD:8265 (or $RAY_ADDRESS)")
    submit.add_argument("--runtime-env", metavar="JSON", help="Ray runtime_env for the job, as JSON")
    submit.add_argument("--submission-id", metavar="ID", help="job id to use (default: Ray picks one)")
    submit.add_argument("--wait", action="store_true", help="stream the job's logs and exit with its status")
    submit.set_defaults(func=_cmd_submit)

    status = sub.add_parser("status", help="progress and counts of a run, from its manifest",
                            description="Counts by sample (ok, failed), tokens and bytes, failure reasons.")
    status.add_argument("output", metavar="OUTPUT", help="the run's output folder or URL")
    status.add_argument("--storage-options", metavar="JSON", help="fsspec options for OUTPUT, as JSON")
    status.add_argument("--errors", type=int, default=10, metavar="N", help="failures to list [default: 10]")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=_cmd_status)

    est = sub.add_parser("estimate", help="tokens, bytes and files a run would produce",
                         description="Tokenize the corpus as `hsx run` would (no model weights, no Ray) and report "
                                     "the samples, tokens, bytes and files the run will produce.")
    add_config_arguments(est)
    est.add_argument("--limit", type=int, metavar="N", help="tokenize only the first N records and extrapolate")
    est.add_argument("--json", action="store_true", help="machine-readable output")
    est.set_defaults(func=_cmd_estimate)

    demo = sub.add_parser("demo", help="build a tiny model and corpus in DIR and run a real job on them",
                          description="Builds a tiny random model and a small mixed-format corpus in DIR (no "
                                      "downloads), runs `hsx run` on a local Ray into DIR/output, and shows where the "
                                      "files and the manifest are.")
    demo.add_argument("dir", metavar="DIR", help="working folder (created)")
    demo.add_argument("--workers", type=int, default=1, help="extraction workers [default: 1]")
    demo.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show progress")
    demo.set_defaults(func=_cmd_demo)

    from jobs.verify import VerifyConfig

    verify = sub.add_parser("verify", help="check a run's files (checksums, headers, NaN/Inf), recompute a few, mark "
                                           "bad ones for re-extraction",
                            description="Check every (or --sample N) committed file of a run against its manifest "
                                        "row, recompute --recompute K of them with a plain transformers forward, and "
                                        "mark failed samples so that re-running the same `hsx run` re-extracts "
                                        "them. Writes a JSON report to OUTPUT/verify/; exits 1 when anything fails.")
    add_config_arguments(verify, VerifyConfig, positional=("output",), config_file=False)
    verify.set_defaults(func=_cmd_verify)


def _cmd_run(args: argparse.Namespace) -> int:
    from jobs.pipeline import JobFailed, execute_job, prepare_job

    config = config_from_args(args)
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


def _cmd_submit(args: argparse.Namespace) -> int:
    from jobs.submit import follow_job, submit_job

    config = config_from_args(args)
    entrypoint = shlex.join(["hsx", "run", *config_to_argv(config, exclude=("address",))])
    try:
        runtime_env = json.loads(args.runtime_env) if args.runtime_env else None
    except json.JSONDecodeError as e:
        raise UsageError(f"--runtime-env is not valid JSON: {e}") from e
    try:
        job_id = submit_job(args.address, entrypoint, runtime_env=runtime_env, submission_id=args.submission_id)
    except (ValueError, ConnectionError) as e:
        raise UsageError(str(e)) from e
    print(job_id)
    if not args.wait:
        print(f"submitted; follow with: ray job logs --address {args.address} --follow {job_id}", file=sys.stderr)
        return EXIT_OK
    status = follow_job(args.address, job_id)
    return EXIT_OK if status == "SUCCEEDED" else EXIT_FAILED


def _cmd_status(args: argparse.Namespace) -> int:
    from connectors.run import RunDir, RunFormatError, read_run_spec
    from connectors.storage import parse_storage_options
    from jobs.manifest import summarize
    from jobs.progress import human_bytes, human_count
    from jobs.verify import latest_report

    try:
        options = parse_storage_options(args.storage_options or {})
    except ValueError as e:
        raise UsageError(str(e)) from e
    output = RunDir(args.output, options)
    try:
        spec = read_run_spec(output)
        if spec is None:
            raise UsageError(f"{output.url} holds no hsx run (no run.json); check the path")
        s = summarize(output, max_errors=args.errors)
    except RunFormatError as e:
        raise UsageError(str(e)) from e
    if args.json:
        print(json.dumps({"output": output.url, "run": spec.to_json(), **dataclasses.asdict(s),
                          "verify": latest_report(output)}, indent=2, default=str))
        return EXIT_OK
    print(f"run:      {output.url}")
    print(f"model:    {spec.model}  layers {list(spec.layer_ids)}  {spec.dtype}")
    print(f"samples:  {s.ok} ok, {s.failed} failed" + (f", {s.truncated} truncated" if s.truncated else ""))
    print(f"data:     {human_count(s.tokens)} tokens, {human_bytes(s.bytes)} in {s.ok} files")
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
    if s.error_kinds:
        print("failures by kind: " + ", ".join(f"{k} ({n})" for k, n in s.error_kinds.items()))
        for sid, err in s.errors:
            print(f"  {sid}: {err}")
    return EXIT_OK


def _cmd_estimate(args: argparse.Namespace) -> int:
    from jobs.estimate import estimate

    config = config_from_args(args, required=("model", "corpus"))
    try:
        est = estimate(config, limit=args.limit)
    except ValueError as e:
        raise UsageError(str(e)) from e
    print(json.dumps(dataclasses.asdict(est), indent=2) if args.json else "\n".join(est.lines()))
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from jobs.demo import run_demo

    return run_demo(args.dir, workers=args.workers, progress=args.progress)


def _cmd_verify(args: argparse.Namespace) -> int:
    from connectors.lease import LeaseHeld
    from jobs.verify import VerifyConfig, verify_run

    config: VerifyConfig = config_from_args(args, VerifyConfig, required=())
    try:
        report = verify_run(config)
    except (ValueError, LeaseHeld) as e:
        raise UsageError(str(e)) from e
    print("\n".join(report.lines()))
    return EXIT_OK if report.ok else EXIT_FAILED
