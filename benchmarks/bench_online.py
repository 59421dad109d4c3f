"""Online = offline (issue 27): the same EAGLE-3 recipe trained from a live extraction (`hsx train-drafter --online`)
and from a stored run of the same corpus (`hsx run`, then `--run`), measured by greedy speculative decoding of the
same held-out prompts on the reference target.

    python benchmarks/bench_online.py --quick                 # the plumbing, a few minutes
    python benchmarks/bench_online.py --out bench-out         # the figures (docs/performance.md)

1. The reference target (training/reference_target.py, cached) and bench_storage_quality's corpus (stdlib prompts of
   --prompt-len tokens), regenerated: each prompt stored with the target's own greedy continuation of --regenerate
   tokens (`--max-tokens N --include-output-tokens`, float32 states, the job's default layers).
2. Offline: `hsx run` of that corpus (reused from bench_storage_quality's work folder when there), then EAGLE-3 for
   --epochs passes over it. Online: the same extraction settings through `--online` for --epochs passes (the target
   regenerates every pass), nothing stored. Same recipe: lr, cosine schedule over the steps, batch tokens, seed.
3. Both decode the held-out prompts (k = 3, greedy, every output checked equal to plain greedy decoding): mean
   acceptance length and tokens per target step, online against offline (target: within 2%); the online training's
   peak object-store use against --inflight-mb, the peak RSS of this process (the trainer) and of the extraction
   workers (sampled), and the target's forward count against one pass per epoch.

Never pass/fail, except lossy decoding.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_drafters import extract, reference_target, write_corpus  # noqa: E402
from benchmarks.common import write_results  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small target, few samples: the plumbing")
    ap.add_argument("--target-steps", type=int, default=None)
    ap.add_argument("--train-tokens", type=int, default=None, help="prompt tokens (default 30000; --quick 3000)")
    ap.add_argument("--regenerate", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=None, help="passes over the corpus (default 4; --quick 1)")
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--drafter-lr", type=float, default=2e-3)
    ap.add_argument("--inflight-mb", type=float, default=256.0)
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=None, help="held-out prompts (default 32; --quick 4)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per prompt (default 96; --quick 16)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for name, full, small in (("train_tokens", 30_000, 3_000), ("epochs", 4, 1), ("num_prompts", 32, 4),
                              ("max_tokens", 96, 16)):
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    return args


class PeakRss:
    """Peak RSS (bytes) of this process and of the Ray extraction workers on this machine, sampled every 0.2 s."""

    def __init__(self) -> None:
        self.trainer = self.workers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.wait(0.2):
            self.trainer = max(self.trainer, me.memory_info().rss)
            for p in psutil.process_iter(["cmdline", "memory_info"]):
                cmd = p.info["cmdline"] or []
                if cmd and cmd[0].startswith("ray::") and "ExtractionWorker" in cmd[0] and p.info["memory_info"]:
                    self.workers = max(self.workers, p.info["memory_info"].rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from jobs.train import train_drafter
    from training.evaluate import evaluate_speculation
    from training.reference_target import default_cache_root
    from training.trainer import TrainDrafterConfig

    target, timings = reference_target(args)
    work = args.work or os.path.join(os.path.dirname(default_cache_root()), "bench-storage-quality",
                                     f"{os.path.basename(target.path)}-t{args.train_tokens}-regen{args.regenerate}")
    os.makedirs(work, exist_ok=True)
    corpus = os.path.join(work, "train.jsonl")
    if not os.path.isfile(corpus):
        write_corpus(target, corpus, args.train_tokens, args.prompt_len)
    run = os.path.join(work, "run-model-dtype")  # bench_storage_quality's extraction: the same settings
    t0 = time.perf_counter()
    extract(target.path, corpus, run, None, args.threads, args.regenerate)
    timings["extraction (offline)"] = time.perf_counter() - t0

    recipe = dict(kind="eagle3", model=target.path, epochs=args.epochs, num_speculative_tokens=args.num_speculative_tokens,
                  lr=args.drafter_lr, batch_tokens=args.batch_tokens, progress=False, device="cpu", seed=0)
    tag = f"e{args.epochs}-b{args.batch_tokens}"
    offline_out = os.path.join(work, "drafters", f"eagle3-offline-{tag}")
    t0 = time.perf_counter()
    offline = train_drafter(TrainDrafterConfig(run=run, out=offline_out, **recipe))
    timings["train offline"] = time.perf_counter() - t0

    online_out = os.path.join(work, "drafters", f"eagle3-online-{tag}")
    extract_settings = {"max_tokens": args.regenerate, "temperature": 0.0, "include_output_tokens": True,
                        "dtype": "float32", "workers": 1}
    if args.threads:
        extract_settings["cpus_per_worker"] = args.threads
    t0 = time.perf_counter()
    with PeakRss() as rss:
        online = train_drafter(TrainDrafterConfig(online=True, corpus=(corpus,), out=online_out,
                                                  extract=extract_settings, inflight_mb=args.inflight_mb, **recipe))
    timings["train online (extraction included)"] = time.perf_counter() - t0

    prompts = list(target.prompts[:args.num_prompts])
    methods = {name: {"method": "eagle3", "model": out, "num_speculative_tokens": args.num_speculative_tokens}
               for name, out in (("offline", offline_out), ("online", online_out))}
    t0 = time.perf_counter()
    results = {r.method: r for r in evaluate_speculation(target.path, prompts, methods, args.max_tokens,
                                                         threads=args.threads, strict=False, errors="record")}
    timings["evaluation"] = time.perf_counter() - t0
    off, on = results["offline"], results["online"]
    samples = online["online"]["extracted"]
    figures = {
        "offline": {"al": off.mean_acceptance_length, "tokens_per_step": off.tokens_per_target_step,
                    "steps": offline["steps"], "tokens": offline["tokens"], "final_loss": offline["final_loss"]},
        "online": {"al": on.mean_acceptance_length, "tokens_per_step": on.tokens_per_target_step,
                   "steps": online["steps"], "tokens": online["tokens"], "final_loss": online["final_loss"],
                   **online["online"]},
        "al_ratio": on.mean_acceptance_length / off.mean_acceptance_length,
        "tps_ratio": on.tokens_per_target_step / off.tokens_per_target_step,
        "peak_rss_trainer_mb": rss.trainer / 2**20, "peak_rss_worker_mb": rss.workers / 2**20,
        "inflight_mb": args.inflight_mb, "timings": timings, "lossless": off.lossless and on.lossless,
    }
    lines = ["# EAGLE-3 trained online vs offline", "",
             f"Reference target {os.path.basename(target.path)}; {args.train_tokens} prompt tokens in "
             f"{args.prompt_len}-token prompts, each with the target's {args.regenerate} greedy tokens; EAGLE-3, "
             f"{args.epochs} epochs of {args.batch_tokens}-token batches (lr {args.drafter_lr:g}, constant), seed 0; "
             f"{len(prompts)} held-out prompts x {args.max_tokens} tokens, greedy, k = {args.num_speculative_tokens}, "
             "every output equal to plain greedy decoding.", "",
             "| trained | steps | tokens | mean AL | tokens / target step |", "|---|---:|---:|---:|---:|"]
    for name in ("offline", "online"):
        f = figures[name]
        lines.append(f"| {name} | {f['steps']} | {f['tokens']:,} | {f['al']:.3f} | {f['tokens_per_step']:.3f} |")
    lines += ["", f"Online / offline: AL {figures['al_ratio']:.3f}, tokens per target step {figures['tps_ratio']:.3f} "
                  "(target: within 2%).",
              f"Online: {samples} samples extracted in {online['online']['passes']} passes (the target ran once per "
              f"sample and pass: {online['online']['target_forwards']} forwards), {online['online']['failed']} "
              f"failed; object store peak {online['online']['peak_object_store_bytes'] / 2**20:.1f} MiB "
              f"(--inflight-mb {args.inflight_mb:g}); peak RSS trainer {figures['peak_rss_trainer_mb']:.0f} MiB, "
              f"extraction worker {figures['peak_rss_worker_mb']:.0f} MiB.", "",
              "timings: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())]
    md = "\n".join(lines) + "\n"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_results(args.out, "online", figures, md)
    else:
        print(md)
    if not figures["lossless"]:
        print("NOT LOSSLESS", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
