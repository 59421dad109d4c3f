"""Drafter quality by storage format (issue 25): the same EAGLE-3 recipe trained on one run stored three ways — bf16,
fp8 (per-token-per-layer scales) and fp8 + a top-k 64 target in place of the last layer — then measured by greedy
speculative decoding of the same held-out prompts on the reference target.

    python benchmarks/bench_storage_quality.py --quick                 # the plumbing, a few minutes
    python benchmarks/bench_storage_quality.py --out bench-out         # the figures (docs/performance.md)

1. The reference target (reference/target.py, cached) and a regenerated run (bench_drafters' corpus: stdlib
   prompts, each stored with the target's own greedy continuation), extracted once in the model dtype (float32).
2. That run rewritten through the real connector three ways (its `storage_dtype`; the top-k target computed from the
   stored last layer by the target's own final norm and lm_head, as the engine does — tests/extractor/
   test_topk_target.py shows the two equal): the three runs hold the same tokens, so only the storage differs.
3. EAGLE-3 trained on each with the same recipe, once per seed (--seeds): the spread of the seeds is the noise floor.
4. Each drafter decodes the held-out prompts (k = 3, greedy, every output checked equal to plain greedy decoding):
   mean acceptance length (AL) and tokens per target step, each format's mean over seeds against bf16's (target:
   within 2%).

Work files live under --work (reused: runs and drafters are not made twice). Never pass/fail, except lossy decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_drafters import extract, reference_target, rewrite_run, write_corpus  # noqa: E402

FORMATS = {"bf16": ("bfloat16", ""), "fp8": ("float8_e4m3fn", ""), "fp8 + top-k 64": ("float8_e4m3fn", "top_k:64")}
TARGET_WITHIN = 0.02


def reference_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments of the benchmarks that train drafters on the reference target's regenerated corpus and decode
    held-out prompts with them (this one, bench_online.py); each adds its own and fills defaults (with_defaults)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small target, few samples and steps: the plumbing")
    ap.add_argument("--target-steps", type=int, default=None, help="reference target training steps")
    ap.add_argument("--train-tokens", type=int, default=None, help="prompt tokens to regenerate from (default 30000)")
    ap.add_argument("--regenerate", type=int, default=64, help="greedy tokens stored after each prompt")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--drafter-lr", type=float, default=2e-3)
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=None, help="held-out prompts (default 32; --quick 4)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per prompt (default 96; --quick 16)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=None)
    return ap


def with_defaults(args: argparse.Namespace, table) -> argparse.Namespace:
    """`args` with each (name, full, quick) of `table` set where not given, to `quick` under --quick."""
    for name, full, small in (("num_prompts", 32, 4), ("max_tokens", 96, 16), *table):
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    return args


def regenerated_run(args: argparse.Namespace):
    """(reference target, work folder, corpus, its regenerated run in the model dtype, timings): made once under the
    work folder and reused (this benchmark's and bench_online.py's)."""
    from reference.target import default_cache_root

    target, timings = reference_target(args)
    work = args.work or os.path.join(os.path.dirname(default_cache_root()), "bench-storage-quality",
                                     f"{os.path.basename(target.path)}-t{args.train_tokens}-regen{args.regenerate}")
    os.makedirs(work, exist_ok=True)
    corpus = os.path.join(work, "train.jsonl")
    if not os.path.isfile(corpus):
        write_corpus(target, corpus, args.train_tokens, args.prompt_len)
    run = os.path.join(work, "run-model-dtype")
    t0 = time.perf_counter()
    extract(target.path, corpus, run, None, args.threads, args.regenerate)
    timings["extraction"] = time.perf_counter() - t0
    return target, work, corpus, run, timings


def parse_args(argv=None) -> argparse.Namespace:
    ap = reference_parser(__doc__)
    ap.add_argument("--steps", type=int, default=None, help="EAGLE-3 steps (default 800; --quick 10)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="training seeds (default 0 1)")
    args = with_defaults(ap.parse_args(argv), (("train_tokens", 30_000, 4_000), ("steps", 800, 10),
                                               ("seeds", [0, 1], [0])))
    args.lr_schedule, args.warmup_steps = "cosine", 50
    return args


def rewrite(src: str, dst: str, storage_dtype: str, target: str, model_dir: str) -> None:
    """Run `src` (model dtype, layer N stored last) rewritten into `dst` (bench_drafters.rewrite_run) in
    `storage_dtype`, with layer N replaced by its top-K target when `target` is "top_k:K": the target's own final
    norm and lm_head on the stored layer, log_softmax in float32, as the engine computes it."""
    import dataclasses

    import torch

    from connectors.format import TARGET_TOPK_IDS, TARGET_TOPK_LOGPROBS, target_top_k
    from drafters.base import TargetHead

    k = target_top_k(target)
    head = TargetHead.from_model_dir(model_dir) if k else None

    def files(spec):
        if not k:
            return spec
        if spec.layer_ids[-1] != spec.num_hidden_layers:
            raise ValueError(f"{src} stores layers {list(spec.layer_ids)}: the top-k target needs N last")
        return dataclasses.replace(spec, layer_ids=spec.layer_ids[:-1], target=target)

    def topk(states):  # [T, L, H] -> ([T, L-1, H], the top-K rows of layer N)
        with torch.no_grad():
            top = head.logits(states[:, -1]).float().log_softmax(-1).topk(k)
        return states[:, :-1].contiguous(), {TARGET_TOPK_IDS: top.indices.to(torch.int32),
                                             TARGET_TOPK_LOGPROBS: top.values}

    rewrite_run(src, dst, files=files, transform=topk if k else None, storage_dtype=storage_dtype)


def run_bytes(run: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(os.path.join(run, "data"))
               for f in names if f.endswith(".safetensors"))


def main(argv=None) -> int:
    args = parse_args(argv)
    from benchmarks.common import lossless_status
    from training.evaluate import evaluate_speculation
    from training.train_config import TrainDrafterConfig
    from training_jobs.train import train_drafter

    target, work, corpus, source, timings = regenerated_run(args)
    runs = {}
    for name, (storage, tgt) in FORMATS.items():
        runs[name] = os.path.join(work, "run-" + name.replace(" ", "").replace("+", "-"))
        t0 = time.perf_counter()
        rewrite(source, runs[name], storage, tgt, target.path)
        timings[f"rewrite {name}"] = time.perf_counter() - t0
    print("runs: " + ", ".join(f"{name} {run_bytes(r) / 1e6:.1f} MB" for name, r in runs.items()), flush=True)

    methods, trained = {}, {}
    for name, run in runs.items():
        for seed in args.seeds:
            out = os.path.join(work, "drafters", f"eagle3-{os.path.basename(run)}-s{args.steps}-seed{seed}")
            if not os.path.isfile(os.path.join(out, "report.json")):
                t0 = time.perf_counter()
                train_drafter(TrainDrafterConfig(
                    kind="eagle3", run=run, model=target.path, out=out, steps=args.steps, seed=seed,
                    num_speculative_tokens=args.num_speculative_tokens, lr=args.drafter_lr,
                    lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps, batch_tokens=args.batch_tokens,
                    progress=False))
                timings[f"train {name} seed {seed}"] = time.perf_counter() - t0
            trained[(name, seed)] = out
            methods[f"{name} seed {seed}"] = {"method": "eagle3", "model": out,
                                              "num_speculative_tokens": args.num_speculative_tokens}
            print(f"eagle3 on {name}, seed {seed}: {out}", flush=True)

    prompts = list(target.prompts[:args.num_prompts])
    t0 = time.perf_counter()
    results = evaluate_speculation(target.path, prompts, methods, args.max_tokens, threads=args.threads,
                                   strict=False, errors="record")
    timings["evaluation"] = time.perf_counter() - t0
    by_method = {r.method: r for r in results}
    table = {}
    for name in FORMATS:
        rs = [by_method[f"{name} seed {seed}"] for seed in args.seeds]
        al = [r.mean_acceptance_length for r in rs]
        tps = [r.tokens_per_target_step for r in rs]
        table[name] = {"bytes": run_bytes(runs[name]), "al": al, "tokens_per_step": tps,
                       "al_mean": statistics.mean(al), "tps_mean": statistics.mean(tps)}
    base = table["bf16"]
    lines = ["# EAGLE-3 by storage format", "",
             f"Reference target {os.path.basename(target.path)}; one regenerated run ({args.train_tokens} prompt "
             f"tokens in {args.prompt_len}-token prompts + {args.regenerate} greedy tokens each) stored three ways; "
             f"EAGLE-3 {args.steps} steps of {args.batch_tokens} tokens (lr {args.drafter_lr:g}, cosine, warmup "
             f"{args.warmup_steps}), seeds {args.seeds}; {len(prompts)} held-out prompts x {args.max_tokens} tokens, "
             f"greedy, k = {args.num_speculative_tokens}, every output equal to plain greedy decoding.", "",
             "| run stored as | bytes vs bf16 | AL per seed | AL mean | vs bf16 | tokens / target step per seed | "
             "mean | vs bf16 |", "|---|---:|---|---:|---:|---|---:|---:|"]
    for name, row in table.items():
        lines.append(f"| {name} | {row['bytes'] / base['bytes']:.3f} | {', '.join(f'{a:.3f}' for a in row['al'])} | "
                     f"{row['al_mean']:.3f} | {row['al_mean'] / base['al_mean']:.3f} | "
                     f"{', '.join(f'{t:.3f}' for t in row['tokens_per_step'])} | {row['tps_mean']:.3f} | "
                     f"{row['tps_mean'] / base['tps_mean']:.3f} |")
    spread = max(max(r["al"]) - min(r["al"]) for r in table.values())
    lines += ["", f"Spread of AL over seeds (largest, any format): {spread:.3f}; target: each format within "
                  f"{TARGET_WITHIN:.0%} of bf16.", "", "timings: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())]
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results-storage-quality.json"), "w") as f:
            json.dump({"args": vars(args), "table": table, "timings": timings,
                       "results": [r.to_dict() for r in results]}, f, indent=2, default=str)
        with open(os.path.join(args.out, "results-storage-quality.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return lossless_status([r.method for r in results if not r.lossless])


if __name__ == "__main__":
    sys.exit(main())
