"""A target's own MTP heads, native against fine-tuned by hsx, decoded by speculative decoding on held-out prompts.

    python benchmarks/bench_mtp.py --quick                  # tiny targets, few steps: the plumbing (~2 min)
    python benchmarks/bench_mtp.py --out bench-out          # the reference MTP targets, the figures in docs/drafters.md

Per architecture (deepseek_v3, qwen3_next):
1. The reference target of that architecture with one MTP layer (reference/target.py, mtp_layers=1): trained
   here on the standard library's train split, its MTP layer trained beside it on the corpus' own next-next tokens
   (the native head, as pre-training leaves it), cached.
2. An hsx run (the `hsx run` job) of prompts cut from the train split plus the target's own greedy continuations
   (--regenerate tokens, include_output_tokens), storing layer N only: the self-distillation data MTP fine-tuning
   reads (the native head never saw the target's own outputs: what SFT/RLHF does to real targets).
3. `hsx train-drafter --kind mtp` on that run (from the native weights, MTP layer only, chained loss), and
   `hsx merge-mtp`'s new target folder with the tuned layer.
4. Greedy decoding of held-out prompts (files the target never read): none, mtp native (the target's folder), mtp
   tuned (the standalone checkpoint) and mtp on the merged folder, at each k; every output checked equal to plain
   greedy decoding; acceptance per position and tokens per target step from vLLM's metrics.

Work files live under --work (default $HSX_CACHE/bench-mtp); a second run reuses runs and tuned heads.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_drafters import extract, target_config, write_corpus  # noqa: E402

ARCHS = ("deepseek_v3", "qwen3_next")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny targets, few samples and steps: proves the plumbing")
    ap.add_argument("--archs", default=",".join(ARCHS), help="architectures, comma-separated")
    ap.add_argument("--target-steps", type=int, default=None, help="reference target training steps (default the "
                                                                   "config's)")
    ap.add_argument("--train-tokens", type=int, default=None, help="prompt tokens to regenerate from (default "
                                                                   "120000; --quick 3000)")
    ap.add_argument("--regenerate", type=int, default=None, help="continuation tokens per prompt (default 64)")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per record")
    ap.add_argument("--steps", type=int, default=None, help="MTP fine-tuning steps (default 600; --quick 10)")
    ap.add_argument("--lr", type=float, default=3e-4, help="MTP fine-tuning learning rate")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--num-prompts", type=int, default=None, help="held-out prompts (default 32; --quick 4)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per prompt (default 96; --quick 16)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--work", default=None, help="work folder (runs, tuned heads); reused across invocations")
    ap.add_argument("--out", default=None, help="folder for mtp.json and mtp.md")
    args = ap.parse_args(argv)
    defaults = {"train_tokens": (120_000, 3_000), "steps": (600, 10), "num_prompts": (32, 4),
                "max_tokens": (96, 16), "regenerate": (64, 16)}
    for name, (full, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    args.archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    bad = [a for a in args.archs if a not in ARCHS]
    if bad:
        ap.error(f"--archs {bad}: choose from {list(ARCHS)}")
    return args


def one(arch: str, args, work: str) -> dict:
    from drafters.mtp_checkpoint import write_target_with
    from reference.target import build_reference_target
    from training.evaluate import comparison_table, evaluate_speculation
    from training.train_config import TrainDrafterConfig
    from training_jobs.train import train_drafter

    timings = {}
    t0 = time.perf_counter()
    target = build_reference_target(target_config(args, architecture=arch, mtp_layers=1))
    timings["reference target"] = time.perf_counter() - t0
    rep = target.report
    print(f"{arch}: reference target {target.path} ({'cached' if target.cached else 'built'}): held-out perplexity "
          f"{rep['heldout_perplexity']:.1f}, native MTP held-out loss {rep['mtp_heldout_loss']:.3f}, its argmax is "
          f"x_t+2 at {rep['mtp_heldout_top1']:.1%} of positions", flush=True)
    n = int(rep["config"]["num_hidden_layers"])
    key = f"{os.path.basename(target.path)}-t{args.train_tokens}-p{args.prompt_len}-r{args.regenerate}"
    corpus = os.path.join(work, f"{key}.jsonl")
    if not os.path.exists(corpus):
        write_corpus(target, corpus, args.train_tokens, args.prompt_len)
    run = os.path.join(work, f"{key}-run")
    t0 = time.perf_counter()
    extract(target.path, corpus, run, (n,), args.threads, args.regenerate)
    timings["regeneration run"] = time.perf_counter() - t0
    tuned = os.path.join(work, f"{key}-tuned-s{args.steps}-lr{args.lr}")
    t0 = time.perf_counter()
    if not os.path.isfile(os.path.join(tuned, "config.json")):
        report = train_drafter(TrainDrafterConfig(kind="mtp", run=run, model=target.path, out=tuned, steps=args.steps,
                                                  num_speculative_tokens=max(args.num_speculative_tokens),
                                                  lr=args.lr, batch_tokens=2048, progress=sys.stderr.isatty()))
        print(f"{arch}: tuned the MTP layer for {report['steps']} steps, loss {report['final_loss']:.4f}", flush=True)
    timings["fine-tuning"] = time.perf_counter() - t0
    merged = tuned + "-merged-target"
    if not os.path.isdir(merged):
        write_target_with(target.path, tuned, merged)
    prompts = list(target.prompts[:args.num_prompts])
    methods = {"none": None}
    for k in args.num_speculative_tokens:
        methods[f"mtp native k={k}"] = {"method": "mtp", "num_speculative_tokens": k}
        methods[f"mtp tuned k={k}"] = {"method": "mtp", "model": tuned, "num_speculative_tokens": k}
    t0 = time.perf_counter()
    results = evaluate_speculation(target.path, prompts, methods, args.max_tokens, threads=args.threads,
                                   strict=False, errors="record")
    k = max(args.num_speculative_tokens)
    merged_results = evaluate_speculation(merged, prompts, {f"mtp merged target k={k}": {
        "method": "mtp", "num_speculative_tokens": k}}, args.max_tokens, threads=args.threads, strict=False,
        errors="record")
    timings["evaluation"] = time.perf_counter() - t0
    table = comparison_table([*results, *merged_results[1:]])
    rows = [r.to_dict() if hasattr(r, "to_dict") else r.__dict__ for r in [*results, *merged_results[1:]]]
    return {"arch": arch, "target": target.path, "target_report": {k: v for k, v in rep.items() if k != "loss_curve"},
            "run": run, "tuned": tuned, "merged": merged, "results": rows, "table": table, "timings": timings,
            "lossless": all(r.lossless for r in [*results, *merged_results])}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    base = os.environ.get("HSX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hsx")
    work = args.work or os.path.join(base, "bench-mtp" + ("-quick" if args.quick else ""))
    os.makedirs(work, exist_ok=True)
    out = [one(arch, args, work) for arch in args.archs]
    md = []
    for r in out:
        md += [f"### {r['arch']} (reference target, one MTP layer)", "", *r["table"], "",
               f"held-out prompts: {args.num_prompts} x {args.max_tokens} tokens, greedy; tuned on {args.train_tokens} "
               f"prompt tokens + {args.regenerate}-token continuations, {args.steps} steps; timings (s): "
               + ", ".join(f"{k} {v:.0f}" for k, v in r["timings"].items()), ""]
    text = "\n".join(md)
    if args.out:
        from benchmarks.common import write_results

        os.makedirs(args.out, exist_ok=True)
        write_results(args.out, "mtp", {"args": vars(args), "archs": out}, text)
    else:
        print(text)
    return 0 if all(r["lossless"] for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
