"""Drafter training on Ray Train replicas (issue 27): one process vs --workers 2 on the same global batch.

    python benchmarks/bench_train_parallel.py --out bench-out                 # CPU, gloo: ~3 minutes on 2 cores
    python benchmarks/bench_train_parallel.py --out bench-out --device cuda   # one GPU per replica, NCCL

A random run (--samples samples of 64-512 tokens, the tiny Llama's width --hidden-size, EAGLE-3's layers) trains an
EAGLE-3 for --steps steps twice: one process with --batch-tokens 2B, and `--workers 2 --batch-tokens B`, the same
global batches. Reported from each training's OUT/samples.jsonl (--log-sample-ids: loss tokens and the time each
step ended): steady tokens/s (from step 3, after start-up), the 2-replica / 1-process ratio, wall seconds with
start-up, and the largest relative difference of the per-step losses. On a CPU both replicas share its cores, so
the ratio says what the synchronisation costs, not what a second device gives (the GPU figure needs 2 GPUs:
benchmarks/gpu_check.sh runs it where a machine has them). Never pass/fail.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_results  # noqa: E402


def steady(out: str, skip: int = 2) -> tuple[float, list[float]]:
    lines = [json.loads(x) for x in Path(out, "samples.jsonl").read_text().splitlines()]
    tail = lines[skip:]
    span = tail[-1]["time"] - lines[skip - 1]["time"]
    return sum(x["tokens"] for x in tail) / span, [x["loss"] for x in lines]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=2048, help="B, per replica (one process: 2B)")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    logging.basicConfig(level=logging.WARNING)

    import ray

    from connectors import HiddenStatesSpec
    from harness.runs import random_samples, write_run
    from reference.tiny_models import build_tiny_model
    from training_jobs.config import TrainJobConfig
    from training_jobs.train import train_drafter

    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-train-", dir=args.out)
    n_layers = 4
    model = build_tiny_model("llama", os.path.join(work, "model"), hidden_size=args.hidden_size,
                             intermediate_size=2 * args.hidden_size, num_hidden_layers=n_layers,
                             num_attention_heads=4, num_key_value_heads=2)
    spec = HiddenStatesSpec(layer_ids=(1, 2, 3, n_layers), num_hidden_layers=n_layers, hidden_size=args.hidden_size,
                            dtype="bfloat16", model=model)
    samples = random_samples(args.samples, spec, seed=0, min_len=64, max_len=512)
    run = os.path.join(work, "run")
    write_run(run, samples, spec)
    tokens = sum(len(s.token_ids) for s in samples)

    ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, logging_level=logging.WARNING)
    results = {"samples": args.samples, "tokens": tokens, "hidden_size": args.hidden_size, "device": args.device,
               "batch_tokens": args.batch_tokens, "steps": args.steps, "cpus": os.cpu_count()}
    common = dict(run=run, model=model, kind="eagle3", steps=args.steps, lr=1e-3, draft_vocab_size=256,
                  checkpoint_every=10**6, device=args.device, progress=False, log_sample_ids=True)
    for name, extra in (("one process", dict(batch_tokens=2 * args.batch_tokens)),
                        ("2 replicas", dict(batch_tokens=args.batch_tokens, workers=2,
                                            gpus_per_worker=1 if args.device == "cuda" else 0))):
        out = os.path.join(work, name.replace(" ", "-"))
        started = time.perf_counter()
        report = train_drafter(TrainJobConfig(out=out, **common, **extra))
        rate, losses = steady(out)
        results[name] = {"wall_s": time.perf_counter() - started, "tokens_per_s": rate, "losses": losses,
                         "trained_tokens": report["tokens"]}
    ray.shutdown()
    a, b = results["one process"], results["2 replicas"]
    results["ratio"] = b["tokens_per_s"] / a["tokens_per_s"]
    results["max_loss_rel_diff"] = max(abs(x - y) / abs(x) for x, y in zip(a["losses"], b["losses"]))
    lines = ["# Drafter training: one process vs 2 Ray Train replicas (same global batch)", "",
             f"EAGLE-3 on a random run of {args.samples} samples ({tokens:,} tokens), width {args.hidden_size}, "
             f"{args.steps} steps of {2 * args.batch_tokens} tokens; {args.device}, {os.cpu_count()} cores.", "",
             "| training | steady tokens/s | wall s (with start-up) |", "|---|---:|---:|"]
    for name in ("one process", "2 replicas"):
        lines.append(f"| {name} | {results[name]['tokens_per_s']:,.0f} | {results[name]['wall_s']:.1f} |")
    lines += ["", f"2 replicas / one process: {results['ratio']:.2f}x (target >= 1.8 on 2 GPUs); per-step losses "
                  f"differ by at most {results['max_loss_rel_diff']:.1e} (relative)."]
    write_results(args.out, "train-parallel", results, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
