"""`hsx export`: rewrite an extraction run into the on-disk layout another trainer reads.

    register(subparsers)                         adds the `export` subcommand to the `hsx` CLI
    export_run(output, dest, fmt, ...)           the same from Python

(Work in progress: the exporters land in the next commit; the CLI surface below is final.)
"""

from __future__ import annotations

import argparse

FORMATS = ("speculators", "specforge", "modelopt")


def register(subparsers) -> argparse.ArgumentParser:
    """Add `export` to the `hsx` CLI's subparsers; the parsed args carry `func(args) -> exit code`."""
    p = subparsers.add_parser(
        "export", help="write a run in the layout of speculators, SpecForge or ModelOpt",
        description="Rewrite an extraction run (OUTPUT, with run.json and manifest/) into DEST in the on-disk layout "
                    "another drafter trainer reads. Streaming (one sample at a time) and resumable (samples already "
                    "exported are skipped).")
    p.add_argument("output", metavar="OUTPUT", help="the run's output folder or URL (holds manifest/)")
    p.add_argument("dest", metavar="DEST", help="local folder to write the exported layout into")
    p.add_argument("--format", dest="fmt", required=True, choices=FORMATS, help="target trainer's layout")
    p.set_defaults(func=_run_cli)
    return p


def _run_cli(args: argparse.Namespace) -> int:
    raise NotImplementedError("hsx export is being written; see jobs/export.py")
