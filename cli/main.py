"""The `hsx` command line: one parser, its subcommands registered by the modules in COMMANDS (one per floor).

    hsx run      --model M --corpus FILES... --output URL [options]    run a job (local Ray unless --address)
    hsx submit   --address http://HEAD:8265 [same options]             the same job through Ray's job API
    hsx status   OUTPUT                                                progress and counts from the manifest
    hsx estimate --model M --corpus FILES... [options]                 tokens, bytes, files before running
    hsx demo     DIR                                                   tiny model + corpus + a real run, no downloads
    hsx verify   OUTPUT [--sample N | --all] [--recompute K]            check files, recompute some, mark bad ones
    hsx export   OUTPUT DEST --format ...                              rewrite a run for another trainer
    hsx serve    --model M --output URL [--api-key K] [--replicas N]   the OpenAI-compatible service (serve/)
    hsx train-drafter --kind K --run OUTPUT --model M --out DIR        train a head of a drafter family
    hsx eval-drafter  --model M --drafter [METHOD:]DIR ...             speculative decoding: AL, tokens/s vs none
    hsx merge-mtp --model TARGET --drafter TUNED --out NEW             a target folder with tuned MTP layers

Job options map one to one onto `jobs.config.JobConfig` (field `max_model_len` = flag `--max-model-len` = job-file key
`max_model_len`); `--config job.yaml|json` loads the same settings and flags given on the command line win. `hsx
export`'s arguments map onto `training.export.ExportConfig` by the same rule (OUTPUT and DEST positional).

Exit codes: 0 success; 1 the job failed, or samples failed with --fail-on-error; 2 usage errors (bad flags, bad
settings, a refused resume); 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys

from cli import jobs, serve, training
from cli.args import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError
from cluster.session import RayStartFailed

COMMANDS = (jobs, training, serve)
"""Modules whose `register(subparsers)` adds their subcommands, in `hsx --help` order."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hsx", description="Extract hidden states of a causal LM over a corpus "
                                     "for EAGLE drafter training, on Ray.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Start with `hsx demo ./hsx-demo` (no downloads). Exit codes: 0 ok, 1 job "
                                            "failed (or samples failed with --fail-on-error), 2 usage error.")
    parser.add_argument("-v", "--verbose", action="count", default=0, dest="verbosity",
                        help="more logging (-vv for debug); hsx run and hsx demo also show Ray's own output "
                             "(their --verbose)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return parser


EXIT_STDOUT_CLOSED = 141
"""`hsx status OUT | head`: the reader of stdout left before the command had said everything. Not 0 (the command may
have had more to say, a failure among it): 128 + SIGPIPE, what a shell reports for a process its pipe ended."""


def _stdout_closed() -> bool:
    """Whether stdout's reader is gone; if so, stdout is pointed at /dev/null so that exit's flush stays quiet."""
    import os
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), 0)
        closed = any(event & select.POLLERR for _, event in poll.poll(0))  # a pipe whose read end is gone
    except (OSError, ValueError, AttributeError):
        return False
    if closed:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    return closed


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbosity and not hasattr(args, "verbose"):  # `hsx -v run`: as `hsx run --verbose` (a flag given wins)
        args.verbose = True
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbosity, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        parser.exit(EXIT_USAGE, f"hsx {args.command}: error: {e}\n")
    except RayStartFailed as e:  # the work could not start: one line, exit 1
        print(f"hsx {args.command}: failed: {e}", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # another pipe (a socket, a child's): a bug to see, not the reader of our output leaving
        return EXIT_STDOUT_CLOSED
    except KeyboardInterrupt:
        print("hsx: interrupted; committed samples are kept, re-run the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK
