"""The training commands: export (training/export/), train-drafter (the trainer) and eval-drafter (speculative
decoding with trained drafters)."""

from __future__ import annotations

import argparse
import sys
import time

from cli.args import EXIT_FAILED, EXIT_OK, UsageError, add_command, config_from_args
from connectors.lease import LeaseHeld, LeaseLost
from connectors.run import RunFormatError
from training.evaluate import EvalDrafterConfig, run_eval
from training.export.config import FORMATS, ExportConfig
from training.mtp_target import MergeMtpConfig, merge_mtp
from training_jobs.config import TrainJobConfig


def register(sub) -> None:
    """Add this floor's subcommands to the `hsx` subparsers."""
    add_command(sub, "export", ExportConfig, _cmd_export, positional=("output", "dest"), choices={"format": FORMATS},
                help="write a run in the layout of speculators, SpecForge or ModelOpt",
                description="Rewrite an extraction run (OUTPUT, with run.json and manifest/) into DEST in the on-disk "
                            "layout another drafter trainer reads. Streaming (one sample at a time) and resumable "
                            "(re-run the same command after an interruption: finished samples are skipped; "
                            "DEST/hsx_export.json is written last). A run a live `hsx run` writes is refused unless "
                            "--snapshot; damaged data exits 1.")

    # hsx train-drafter --kind FAMILY --run OUTPUT --model TARGET --out DIR: flags map one to
    # one onto training_jobs.config.TrainJobConfig, the trainer's settings and Ray's (cheap to import: torch loads when
    # the command runs)
    def _cmd_train_drafter(args: argparse.Namespace) -> int:
        from training.feed import TrainingStopped  # torch: the CLI's parser must stay cheap
        from training_jobs.train import (  # torch, pyarrow: the CLI's parser must stay cheap
            ReplicasFailed,
            train_drafter,
        )

        config: TrainJobConfig = config_from_args(args, TrainJobConfig)
        try:
            r = train_drafter(config)
        except (TrainingStopped, LeaseLost, ReplicasFailed) as e:  # bad data, a diverged training, dead replicas
            print(f"hsx train-drafter: {e}", file=sys.stderr)
            return EXIT_FAILED
        except (ValueError, FileNotFoundError) as e:
            raise UsageError(str(e)) from e
        if "trainers" in r:  # --fanout: a line per trainer, then the stream's
            failed = [t for t in r["trainers"] if "error" in t]
            for t in r["trainers"]:
                print(f"{t['out']}: failed: {t['error']}" if "error" in t else
                      f"{t['out']}: trained {t['kind']} for {t['steps']} steps ({t['tokens']} tokens), loss "
                      f"{t['final_loss']:.4f}, simulated acceptance length {t['simulated_acceptance_length']:.3f}")
            s = r["online"]
            print(f"one stream for {len(r['trainers'])} trainers: {s['passes']} passes, the target ran for "
                  f"{s['target_forwards']} samples, {s['failed']} failed to extract")
            return EXIT_FAILED if failed else EXIT_OK
        acc = "/".join(f"{a:.3f}" for a in r["accuracy_per_position"])
        on = f" on {r['workers']} replicas" if config.distributed() else ""
        print(f"trained {r['kind']}{on} for {r['steps']} steps ({r['tokens']} tokens, {r['wall_seconds']:.1f}s): loss "
              f"{r['final_loss']:.4f}, accuracy per position {acc}, simulated acceptance length "
              f"{r['simulated_acceptance_length']:.3f}; drafter in {r['out']}, report {r['out']}/report.json")
        if r.get("snapshot"):
            print(f"  snapshot (--snapshot): --run was being written by {r['snapshot_writer']}; trained on the "
                  f"{r['samples']} samples committed then (report.json says so)")
        return EXIT_OK

    add_command(sub, "train-drafter", TrainJobConfig, _cmd_train_drafter,
                choices={"dtype": ("float32", "bfloat16", "float16")},
                help="train a drafter of any registered family on a run",
                description="Train a drafter on an extraction run (OUTPUT) against its target model; writes the "
                            "checkpoint serving engines load (speculative_config method = --kind) and report.json to "
                            "--out. Re-running the same command resumes from --out/checkpoint. --workers N trains N "
                            "data-parallel replicas on Ray (a private local Ray, or --address).")

    add_command(sub, "merge-mtp", MergeMtpConfig, _cmd_merge_mtp,
                help="a new target folder with MTP layers tuned by `hsx train-drafter --kind mtp`",
                description="Copy the target folder --model to --out with its MTP tensors replaced by the tuned ones "
                            "in --drafter (same keys and layout; only the shards holding them are rewritten). "
                            "--model is never written; speculative_config {'method': 'mtp'} on --out then drafts "
                            "with the tuned layers.")
    add_command(sub, "eval-drafter", EvalDrafterConfig, _cmd_eval_drafter,
                help="greedy decoding with drafters vs ngram vs none: acceptance length, tokens/s",
                description="Decode held-out prompts greedily on TARGET with each drafter (and ngram, and no "
                            "speculation); print vLLM's spec_decode.py lines per method and a comparison table; "
                            "--out DIR writes DIR/<method>/acceptance.csv (the layout drafter benchmarks publish), "
                            "summary.csv and a plot; fail (exit 1) when any speculative output differs from plain "
                            "greedy decoding or a method could not be evaluated.")


def _cmd_export(args: argparse.Namespace) -> int:
    """Checks first (a refusal: exit 2, nothing written), then the work (a damaged sample, a full disk, a lost lease:
    exit 1, one line, the files written so far kept for a resume)."""
    from training.export import ExportConfig, execute_export, prepare_export  # torch: the CLI's parser must stay cheap

    config: ExportConfig = config_from_args(args, ExportConfig)
    last = [time.monotonic(), None]  # report every 5 s, not at the first sample; the last summary seen

    def progress(s) -> None:
        last[1] = s
        now = time.monotonic()
        if now - last[0] >= 5:
            last[0] = now
            print(f"  {s.written + s.skipped}/{s.samples} samples", file=sys.stderr, flush=True)

    try:
        plan = prepare_export(config)
    except RunFormatError as e:  # a damaged run.json or manifest: the run needs mending, not the command
        print(f"hsx export: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_FAILED
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from e
    try:
        s = execute_export(plan, progress=progress)
    except LeaseHeld as e:  # another export writes DEST now
        raise UsageError(str(e)) from e
    except (ValueError, OSError, RuntimeError) as e:  # damaged data, a full disk, a lost lease
        done = last[1]
        kept = (f"; {done.written + done.skipped} of {done.samples} samples are exported and kept" if done else "")
        print(f"hsx export: failed: {' '.join(str(e).split())}{kept} — fix that and re-run the same command to "
              "finish (DEST has no completion marker until then)", file=sys.stderr)
        return EXIT_FAILED
    if s.snapshot is not None:
        print(f"snapshot (--snapshot): OUTPUT was being written by {s.snapshot}; exported the samples committed "
              f"then (hsx_export.json says so)")
    removed = f", {s.removed} of samples no longer in the run removed" if s.removed else ""
    print(f"exported {s.samples} samples ({s.tokens} tokens) to {s.dest} as {s.format}: {s.written} written, "
          f"{s.skipped} already done{removed}, {s.seconds:.1f}s")
    return EXIT_OK


def _cmd_merge_mtp(args: argparse.Namespace) -> int:
    config: MergeMtpConfig = config_from_args(args, MergeMtpConfig)
    try:
        r = merge_mtp(config)
    except (ValueError, OSError) as e:  # bad folders; a disk that fills or refuses the new folder
        raise UsageError(str(e)) from e
    print(f"wrote {r['out']}: {r['replaced_tensors']} MTP tensors replaced in {', '.join(r['rewritten_shards'])}; "
          f"{config.model} unchanged")
    return EXIT_OK


def _cmd_eval_drafter(args: argparse.Namespace) -> int:
    config: EvalDrafterConfig = config_from_args(args, EvalDrafterConfig)
    try:
        return run_eval(config)
    except ValueError as e:
        raise UsageError(str(e)) from e
