"""`hsx serve` (serve/): flags map one to one onto serve.config.ServeConfig."""

from __future__ import annotations

import argparse
import sys

from cli.args import UsageError, add_command, config_from_args
from serve.config import ServeConfig
from serve.server import check, open_server_warning, run


def register(sub) -> None:
    """Add the `serve` subcommand to the `hsx` subparsers."""
    add_command(sub, "serve", ServeConfig, _cmd_serve,
                help="an OpenAI-compatible extraction service (Ray Serve): /v1/completions, /v1/chat/completions",
                description="Serve the model over HTTP with vLLM's OpenAI routes: every request writes the hidden "
                            "states of its prompt (and, with kv_transfer_params.include_output_tokens, of its output) "
                            "to a file under --output and answers with its path once the file is durable; with "
                            "--speculative-config it decodes speculatively instead (vLLM's methods: mtp, ngram, a "
                            "trained drafter) and writes no files. Runs on a private local Ray unless --address; "
                            "SIGTERM drains requests in flight, then exits.")


def _cmd_serve(args: argparse.Namespace) -> int:
    config: ServeConfig = config_from_args(args, ServeConfig)
    try:
        check(config)
    except ValueError as e:
        raise UsageError(str(e)) from e
    warning = open_server_warning(config)
    if warning:
        print(f"hsx serve: WARNING: {warning}", file=sys.stderr, flush=True)

    spec = config.speculative
    serving = (f"speculative decoding: {spec.method}, k = {spec.num_speculative_tokens}, no files" if spec else
               "generation only, no files" if not config.writes_files else
               f"files under {config.output}" + ("" if config.files else " for requests with kv_transfer_params"))

    def ready(url: str) -> None:
        print(f"hsx serve: {config.model_name} on {url} ({config.replicas} replica(s), {serving}"
              f"{', API key required' if config.api_key else ''}); SIGTERM or Ctrl-C drains and stops",
              file=sys.stderr, flush=True)

    try:
        return run(config, ready)
    except ValueError as e:
        raise UsageError(str(e)) from e
    except KeyboardInterrupt:  # a second Ctrl-C, or one that reached Ray's own processes (the whole process group)
        print("hsx serve: interrupted before requests in flight drained: answered files are complete, requests that "
              "got no answer should be retried. Send SIGTERM to the hsx process alone for a full drain", file=sys.stderr)
        return 130
