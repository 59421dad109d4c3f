"""Online = offline (issue 27): the same EAGLE-3 recipe trained from a live extraction (`hsx train-drafter --online`)
and from a stored run of the same corpus (`hsx run`, then `--run`), measured by greedy speculative decoding of the
same held-out prompts on the reference target.

    python benchmarks/bench_online.py --quick                 # the plumbing, a few minutes
    python benchmarks/bench_online.py --out bench-out         # the figures (docs/performance.md)

1. The reference target (reference/target.py, cached) and bench_storage_quality's corpus (stdlib prompts of
   --prompt-len tokens), regenerated: each prompt stored with the target's own greedy continuation of --regenerate
   tokens (`--max-tokens N --include-output-tokens`, float32 states, the job's default layers).
2. Offline: `hsx run` of that corpus (reused from bench_storage_quality's work folder when there), then EAGLE-3 for
   --epochs passes over it. Online: the same extraction settings through `--online` for --epochs passes (the target
   regenerates every pass), nothing stored. Same recipe: lr, cosine schedule over the steps, batch tokens, seed.
3. Both decode the held-out prompts (k = 3, greedy, every output checked equal to plain greedy decoding): mean
   acceptance length and tokens per target step, online against offline (target: within 2%); the online training's
   peak object-store use against --inflight-mb, the peak RSS of this process (the trainer) and of the extraction
   workers (sampled; beside the same extraction as a plain `hsx run`), and the target's forward count against one
   pass per epoch.

Never pass/fail, except lossy decoding.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_drafters import extract  # noqa: E402
from benchmarks.bench_job import ProcessPeaks  # noqa: E402
from benchmarks.bench_storage_quality import reference_parser, regenerated_run, with_defaults  # noqa: E402
from benchmarks.common import peak_rss, reset_peak_rss, write_results  # noqa: E402

WORKER = "ExtractionWorker"  # in the Ray process title of an extraction worker


def parse_args(argv=None) -> argparse.Namespace:
    ap = reference_parser(__doc__)
    ap.add_argument("--epochs", type=int, default=None, help="passes over the corpus (default 4; --quick 1)")
    ap.add_argument("--inflight-mb", type=float, default=256.0)
    ap.add_argument("--shuffle-mb", type=float, default=256.0, help="the online trainer's shuffle buffer")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="training seeds (each trained both ways)")
    return with_defaults(ap.parse_args(argv), (("train_tokens", 30_000, 3_000), ("epochs", 4, 1)))


def compare_drafters(target, args: argparse.Namespace, outs: dict, reports: dict, hows, timings: dict
                     ) -> tuple[dict[str, dict], bool]:
    """The EAGLE-3 drafters `outs` ((how, seed) -> folder) decoding the held-out prompts on the reference target:
    per way of training, AL and tokens per target step per seed and their means (with the trainings' steps and
    tokens from `reports`), and whether every output was lossless."""
    from training.evaluate import evaluate_speculation

    prompts = list(target.prompts[:args.num_prompts])
    methods = {f"{how} seed {seed}": {"method": "eagle3", "model": out,
                                      "num_speculative_tokens": args.num_speculative_tokens}
               for (how, seed), out in outs.items()}
    t0 = time.perf_counter()
    results = {r.method: r for r in evaluate_speculation(target.path, prompts, methods, args.max_tokens,
                                                         threads=args.threads, strict=False, errors="record")}
    timings["evaluation"] = time.perf_counter() - t0
    rows = {}
    for how in hows:
        rs = [results[f"{how} seed {seed}"] for seed in args.seeds]
        rows[how] = {"al": [r.mean_acceptance_length for r in rs], "tokens_per_step": [r.tokens_per_target_step
                                                                                        for r in rs],
                     "steps": reports[(how, args.seeds[0])]["steps"],
                     "tokens": reports[(how, args.seeds[0])]["tokens"]}
        rows[how]["al_mean"] = statistics.mean(rows[how]["al"])
        rows[how]["tps_mean"] = statistics.mean(rows[how]["tokens_per_step"])
    return rows, all(r.lossless for r in results.values())


def rows_table(rows: dict[str, dict], first: str = "trained") -> list[str]:
    """compare_drafters' rows as a markdown table."""
    lines = [f"| {first} | steps | tokens | AL per seed | AL mean | tokens / target step per seed | mean |",
             "|---|---:|---:|---|---:|---|---:|"]
    for how, r in rows.items():
        lines.append(f"| {how} | {r['steps']} | {r['tokens']:,} | {', '.join(f'{a:.3f}' for a in r['al'])} | "
                     f"{r['al_mean']:.3f} | {', '.join(f'{t:.3f}' for t in r['tokens_per_step'])} | "
                     f"{r['tps_mean']:.3f} |")
    return lines


def finish(args: argparse.Namespace, stem: str, figures: dict, lines: list[str], timings: dict) -> int:
    """The timings line, the results written (or printed); 1 when any decoding was lossy."""
    md = "\n".join([*lines, "", "timings: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())]) + "\n"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_results(args.out, stem, figures, md)
    else:
        print(md)
    if not figures["lossless"]:
        print("NOT LOSSLESS", file=sys.stderr)
        return 1
    return 0

def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from training_jobs.config import TrainJobConfig
    from training_jobs.train import train_drafter

    target, work, corpus, run, timings = regenerated_run(args)  # bench_storage_quality's run: the same settings

    recipe = dict(kind="eagle3", model=target.path, epochs=args.epochs,
                  num_speculative_tokens=args.num_speculative_tokens, lr=args.drafter_lr,
                  batch_tokens=args.batch_tokens, progress=False, device="cpu")
    extract_settings = {"max_tokens": args.regenerate, "temperature": 0.0, "include_output_tokens": True,
                        "dtype": "float32", "workers": 1}
    if args.threads:
        extract_settings["cpus_per_worker"] = args.threads
    outs, reports = {}, {}
    for seed in args.seeds:
        tag = f"e{args.epochs}-b{args.batch_tokens}-seed{seed}"
        outs[("offline", seed)] = os.path.join(work, "drafters", f"eagle3-offline-{tag}")
        t0 = time.perf_counter()
        reports[("offline", seed)] = train_drafter(TrainJobConfig(run=run, out=outs[("offline", seed)],
                                                                      seed=seed, **recipe))
        timings[f"train offline seed {seed}"] = time.perf_counter() - t0
        outs[("online", seed)] = os.path.join(work, "drafters", f"eagle3-online-{tag}-sh{args.shuffle_mb:g}")
        t0 = time.perf_counter()
        reset_peak_rss()
        with ProcessPeaks() as rss:
            reports[("online", seed)] = train_drafter(TrainJobConfig(
                online=True, corpus=(corpus,), out=outs[("online", seed)], extract=extract_settings, seed=seed,
                inflight_mb=args.inflight_mb, shuffle_mb=args.shuffle_mb, **recipe))
        timings[f"train online seed {seed} (extraction included)"] = time.perf_counter() - t0
        trainer_peak = peak_rss()
    online = reports[("online", args.seeds[0])]

    # the same extraction as an ordinary `hsx run` (files written), for the worker's RSS without the stream
    import shutil
    import tempfile

    scratch = tempfile.mkdtemp(prefix="bench-online-run-")
    t0 = time.perf_counter()
    reset_peak_rss()
    with ProcessPeaks() as plain:
        extract(target.path, corpus, os.path.join(scratch, "run"), None, args.threads, args.regenerate)
    timings["extraction (hsx run, RSS reference)"] = time.perf_counter() - t0
    driver_peak = peak_rss()
    shutil.rmtree(scratch, ignore_errors=True)

    rows, lossless = compare_drafters(target, args, outs, reports, ("offline", "online"), timings)
    figures = {
        **rows, "online_stream": online["online"],
        "al_ratio": rows["online"]["al_mean"] / rows["offline"]["al_mean"],
        "tps_ratio": rows["online"]["tps_mean"] / rows["offline"]["tps_mean"],
        "seed_spread": max(max(r["al"]) - min(r["al"]) for r in rows.values()),
        "peak_rss_trainer_mb": trainer_peak / 2**20, "peak_rss_worker_mb": rss.peak_of(WORKER) / 2**20,
        "peak_private_worker_mb": rss.peak_of(WORKER, private=True) / 2**20,
        "peak_rss_worker_hsx_run_mb": plain.peak_of(WORKER) / 2**20,
        "peak_private_worker_hsx_run_mb": plain.peak_of(WORKER, private=True) / 2**20,
        "peak_rss_driver_hsx_run_mb": driver_peak / 2**20,
        "inflight_mb": args.inflight_mb, "shuffle_mb": args.shuffle_mb, "timings": timings,
        "lossless": lossless,
    }
    stream = online["online"]
    lines = ["# EAGLE-3 trained online vs offline", "",
             f"Reference target {os.path.basename(target.path)}; {args.train_tokens} prompt tokens in "
             f"{args.prompt_len}-token prompts, each with the target's {args.regenerate} greedy tokens; EAGLE-3, "
             f"{args.epochs} epochs of {args.batch_tokens}-token batches (lr {args.drafter_lr:g}, constant), seeds "
             f"{args.seeds}; online with --shuffle-mb {args.shuffle_mb:g}; {args.num_prompts} held-out prompts x "
             f"{args.max_tokens} tokens, greedy, k = {args.num_speculative_tokens}, every output equal to plain "
             "greedy decoding.", "", *rows_table(rows)]
    lines += ["", f"Online / offline: AL {figures['al_ratio']:.3f}, tokens per target step {figures['tps_ratio']:.3f} "
                  f"(target: within 2%); largest spread of AL over seeds {figures['seed_spread']:.3f}.",
              f"Online (seed {args.seeds[0]}): {stream['extracted']} samples in {stream['passes']} passes (the target "
              f"ran once per sample and pass: {stream['target_forwards']} forwards), {stream['failed']} failed; "
              f"object store peak {stream['peak_object_store_bytes'] / 2**20:.1f} MiB (--inflight-mb "
              f"{args.inflight_mb:g}). Peak RSS (VmHWM; private RssAnon in brackets) in the online training of seed "
              f"{args.seeds[-1]}: trainer {figures['peak_rss_trainer_mb']:.0f} MiB, extraction worker "
              f"{figures['peak_rss_worker_mb']:.0f} MiB ({figures['peak_private_worker_mb']:.0f}); the same "
              f"extraction as a plain `hsx run` (files written): worker {figures['peak_rss_worker_hsx_run_mb']:.0f} "
              f"MiB ({figures['peak_private_worker_hsx_run_mb']:.0f}), driver "
              f"{figures['peak_rss_driver_hsx_run_mb']:.0f} MiB."]
    return finish(args, "online", figures, lines, timings)


if __name__ == "__main__":
    sys.exit(main())
