"""The `hsx` command line.

    hsx run      --model M --corpus FILES... --output URL [options]    run a job (local Ray unless --address)
    hsx submit   --address http://HEAD:8265 [same options]             the same job through Ray's job API
    hsx status   OUTPUT                                                progress and counts from the manifest
    hsx estimate --model M --corpus FILES... [options]                 tokens, bytes, files before running
    hsx demo     DIR                                                   tiny model + corpus + a real run, no downloads
    hsx verify   OUTPUT [--sample N | --all] [--recompute K]            check files, recompute some, mark bad ones
    hsx export   OUTPUT DEST --format ...                              rewrite a run for another trainer
    hsx serve    --model M --output URL [--api-key K] [--replicas N]   the OpenAI-compatible service (serve/)
    hsx train-drafter --kind K --run OUTPUT --model M --out DIR        train an EAGLE-3 / Medusa / MLPSpeculator head
    hsx eval-drafter  --model M --drafter [METHOD:]DIR ...             speculative decoding: AL, tokens/s vs none

Job options map one to one onto `jobs.config.JobConfig` (field `max_model_len` = flag `--max-model-len` = job-file key
`max_model_len`); `--config job.yaml|json` loads the same settings and flags given on the command line win. `hsx
export`'s arguments map onto `training.export.ExportConfig` by the same rule (OUTPUT and DEST positional).

Exit codes: 0 success; 1 the job failed, or samples failed with --fail-on-error; 2 usage errors (bad flags, bad
settings, a refused resume); 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import sys
import time
import types
import typing
from typing import Any

from jobs.config import OVERLENGTH_POLICIES, JobConfig, field_docs, flag, load_config_file

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_CHOICES = {"overlength": OVERLENGTH_POLICIES}  # dtype: validated by JobConfig, which takes aliases (bf16)
_METAVARS = {"corpus": "FILE_OR_GLOB", "layers": "IDS", "model": "MODEL", "output": "URL",
             "storage_options": "JSON", "corpus_storage_options": "JSON", "chat_template": "FILE"}


class UsageError(ValueError):
    """Bad command-line input; exit status 2."""


# -- config dataclasses <-> flags ----------------------------------------------------------------------------------
def _base_type(hint: Any) -> Any:
    """int for `int | None`, tuple for `tuple[int, ...] | None`, ..."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0]
    return typing.get_origin(hint) or hint


def add_config_arguments(parser: argparse.ArgumentParser, cls: type = JobConfig, *, exclude: tuple[str, ...] = (),
                         positional: tuple[str, ...] = (), choices: dict[str, tuple[str, ...]] | None = None,
                         config_file: bool = True) -> None:
    """One flag per field of the config dataclass `cls` (help = the field's docstring): field `max_model_len` is flag
    `--max-model-len`; fields in `positional` are positional arguments (metavar = the name upper-cased), in that
    order. `choices` (field -> allowed values) adds to _CHOICES. A field without a default is a required flag.
    Defaults stay unset (SUPPRESS), so a job file's values are only overridden by flags actually given; with
    `config_file`, --config loads such a file (JobConfig's keys)."""
    if config_file:
        parser.add_argument("--config", metavar="JOB.yaml", default=argparse.SUPPRESS,
                            help="load settings from a YAML or JSON job file (keys = field names); flags override it")
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    allowed = {**_CHOICES, **(choices or {})}
    for name in positional:
        parser.add_argument(name, metavar=name.upper(), help=docs.get(name, "").replace("%", "%%"))
    for f in dataclasses.fields(cls):
        if f.name in exclude or f.name in positional:
            continue
        base = _base_type(hints[f.name])
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "dest": f.name}
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = docs.get(f.name, "")
        if default not in (None, "", ()) and base is not dict:
            help_text += f" [default: {default}]"
        if required:
            kwargs["required"] = True
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.name == "corpus":
            kwargs.update(nargs="+", metavar=_METAVARS["corpus"])
        elif base in (int, float):
            kwargs.update(type=base, metavar=f.name.upper().split("_")[-1] if base is int else "X")
        else:
            kwargs.update(type=str, metavar=_METAVARS.get(f.name, f.name.split("_")[-1].upper()))
        if f.name in allowed:
            kwargs["choices"] = allowed[f.name]
            kwargs.pop("metavar", None)
        parser.add_argument(flag(f.name), help=help_text.replace("%", "%%"), **kwargs)


def config_from_args(args: argparse.Namespace, cls: type = JobConfig,
                     required: tuple[str, ...] = ("model", "corpus", "output")) -> Any:
    """`cls` built from the job file (if any) overlaid with the flags given; raises UsageError naming the setting to
    fix. `required`: settings `cls.check_required` must find set (JobConfig's); pass () for configs without one."""
    try:
        values = load_config_file(args.config) if getattr(args, "config", None) else {}
        for f in dataclasses.fields(cls):
            if hasattr(args, f.name):
                values[f.name] = getattr(args, f.name)
        config = cls(**values)
        if required:
            config.check_required(required)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from e
    return config


def config_to_argv(config: JobConfig, exclude: tuple[str, ...] = ()) -> list[str]:
    """Flags that rebuild `config` (only settings that differ from the defaults)."""
    argv: list[str] = []
    defaults = JobConfig()
    for f in dataclasses.fields(JobConfig):
        value = getattr(config, f.name)
        if f.name in exclude or value == getattr(defaults, f.name):
            continue
        name = flag(f.name)
        if isinstance(value, bool):
            argv.append(name if value else "--no-" + name[2:])
        elif f.name == "corpus":
            argv += [name, *value]
        elif f.name == "layers":
            argv += [name, ",".join(str(i) for i in value)]
        elif isinstance(value, dict):
            argv += [name, json.dumps(value)]
        else:
            argv += [name, str(value)]
    return argv


# -- commands ------------------------------------------------------------------------------------------------------
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


def _cmd_export(args: argparse.Namespace) -> int:
    from connectors.lease import LeaseLost
    from training.export import ExportConfig, export_run

    config: ExportConfig = config_from_args(args, ExportConfig, required=())
    last = [time.monotonic()]  # report every 5 s, not at the first sample

    def progress(s) -> None:
        now = time.monotonic()
        if now - last[0] >= 5:
            last[0] = now
            print(f"  {s.written + s.skipped}/{s.samples} samples", file=sys.stderr, flush=True)

    try:
        s = export_run(config.output, config.dest, config.format, model_dir=config.model_dir,
                       storage_options=config.storage_options, num_workers=config.num_workers, progress=progress,
                       break_lease=config.break_lease)
    except LeaseLost as e:
        print(f"hsx export: {e}", file=sys.stderr)
        return EXIT_FAILED
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from e
    print(f"exported {s.samples} samples ({s.tokens} tokens) to {s.dest} as {s.format}: {s.written} written, "
          f"{s.skipped} already done, {s.seconds:.1f}s")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hsx", description="Extract hidden states of a causal LM over a corpus "
                                     "for EAGLE drafter training, on Ray.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Start with `hsx demo ./hsx-demo` (no downloads). Exit codes: 0 ok, 1 job "
                                            "failed (or samples failed with --fail-on-error), 2 usage error.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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

    from training.export.config import FORMATS, ExportConfig

    export = sub.add_parser("export", help="write a run in the layout of speculators, SpecForge or ModelOpt",
                            description="Rewrite an extraction run (OUTPUT, with run.json and manifest/) into DEST in "
                                        "the on-disk layout another drafter trainer reads. Streaming (one sample at a "
                                        "time) and resumable (re-run the same command after an interruption: "
                                        "finished samples are skipped).")
    add_config_arguments(export, ExportConfig, positional=("output", "dest"), choices={"format": FORMATS},
                         config_file=False)
    export.set_defaults(func=_cmd_export)

    # hsx train-drafter --kind eagle3|medusa|mlp_speculator --run OUTPUT --model TARGET --out DIR: flags map one to
    # one onto training.drafters.train.TrainDrafterConfig (cheap to import: torch loads when the command runs)
    from training.drafters.train import DRAFTERS, TrainDrafterConfig

    def _cmd_train_drafter(args: argparse.Namespace) -> int:
        from connectors.lease import LeaseLost
        from training.drafters.train import TrainingStopped, train_drafter

        config: TrainDrafterConfig = config_from_args(args, TrainDrafterConfig, required=())
        try:
            r = train_drafter(config)
        except (TrainingStopped, LeaseLost) as e:  # bad data or a diverged training: it failed, nothing bad saved
            print(f"hsx train-drafter: {e}", file=sys.stderr)
            return EXIT_FAILED
        except (ValueError, FileNotFoundError) as e:
            raise UsageError(str(e)) from e
        acc = "/".join(f"{a:.3f}" for a in r["accuracy_per_position"])
        print(f"trained {r['kind']} for {r['steps']} steps ({r['tokens']} tokens, {r['wall_seconds']:.1f}s): loss "
              f"{r['final_loss']:.4f}, accuracy per position {acc}, simulated acceptance length "
              f"{r['simulated_acceptance_length']:.3f}; drafter in {r['out']}, report {r['out']}/report.json")
        return EXIT_OK

    train = sub.add_parser("train-drafter", help="train an EAGLE-3, Medusa or MLPSpeculator drafter on a run",
                           description="Train a drafter on an extraction run (OUTPUT) against its target model; "
                                       "writes the checkpoint serving engines load (speculative_config method = "
                                       "--kind) and report.json to --out. Re-running the same command resumes from "
                                       "--out/checkpoint.")
    add_config_arguments(train, TrainDrafterConfig, choices={"kind": tuple(DRAFTERS),
                                                             "dtype": ("float32", "bfloat16", "float16")},
                         config_file=False)
    train.set_defaults(func=_cmd_train_drafter)

    from training.drafters.evaluate import add_eval_parser  # hsx eval-drafter: AL and tokens/s per method

    add_eval_parser(sub, usage_error=UsageError)

    from serve.cli import add_serve_parser  # hsx serve: the OpenAI-compatible service (serve/)

    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        parser.exit(EXIT_USAGE, f"hsx {args.command}: error: {e}\n")
    except KeyboardInterrupt:
        print("hsx: interrupted; committed samples are kept, re-run the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK


if __name__ == "__main__":
    # `python -m jobs.cli` runs this file as __main__: go through the importable jobs.cli so the UsageError that
    # serve/ and training/ import from jobs.cli is the one main() catches (else a usage error is a traceback, exit 1)
    from jobs.cli import main as _main

    sys.exit(_main())
