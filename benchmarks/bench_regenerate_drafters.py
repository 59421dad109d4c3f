"""Drafters trained on an `hsx regenerate` run vs on the one-engine regeneration of the same prompts (issue 28): the
same EAGLE-3 recipe on each, measured by greedy speculative decoding of the same held-out prompts on the reference
target.

    python benchmarks/bench_regenerate_drafters.py --quick               # the plumbing, a few minutes
    python benchmarks/bench_regenerate_drafters.py --out bench-out       # the figures (docs/performance.md)

1. The reference target (reference/target.py, cached) and bench_storage_quality's corpus (stdlib prompts of
   --prompt-len tokens) with its one-engine regeneration: `hsx run --max-tokens N --include-output-tokens` (float32,
   the job's default layers; reused from bench_storage_quality's work folder when there).
2. The same prompts through a server: `hsx serve` on the target (the real CLI, float32), `hsx regenerate` (greedy, N
   tokens, the server's own token ids), then `hsx run` prefill-only of the regenerated corpus (same layers, float32).
   How many samples hold the same tokens both ways is counted (batching may flip a near-tie argmax).
3. EAGLE-3 trained on each run with one recipe (bench_online's: --epochs passes, lr, batch tokens, seeds); both decode
   the held-out prompts (k = 3, greedy, every output checked equal to plain greedy decoding): mean acceptance length
   and tokens per target step, regenerate-trained against one-engine-trained (target: within 2%).

Never pass/fail, except lossy decoding.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_drafters import extract  # noqa: E402
from benchmarks.bench_online import compare_drafters, finish, rows_table  # noqa: E402
from benchmarks.bench_storage_quality import reference_parser, regenerated_run, with_defaults  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = reference_parser(__doc__)
    ap.add_argument("--epochs", type=int, default=None, help="passes over the run (default 4; --quick 1)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="training seeds (each trained on both runs)")
    ap.add_argument("--concurrency", type=int, default=32)
    return with_defaults(ap.parse_args(argv), (("train_tokens", 30_000, 3_000), ("epochs", 4, 1)))


def same_tokens(engine_run: str, server_run: str) -> tuple[int, int]:
    """(samples whose tokens agree, samples): the server run holds one token more (the last generated one, which the
    one-engine run never feeds back)."""
    from connectors import load_hidden_states
    from connectors.manifest import ok_rows

    a, b = ok_rows(engine_run), ok_rows(server_run)
    paths_b = dict(zip(b["sample_id"].to_pylist(), b["path"].to_pylist()))
    same = 0
    for sid, path in zip(a["sample_id"].to_pylist(), a["path"].to_pylist()):
        if sid not in paths_b:
            continue
        ta = load_hidden_states(os.path.join(engine_run, path))["token_ids"].tolist()
        tb = load_hidden_states(os.path.join(server_run, paths_b[sid]))["token_ids"].tolist()
        same += tb[:len(ta)] == ta and len(tb) == len(ta) + 1
    return same, a.num_rows


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from connectors.run import read_run_spec
    from harness.serving import API_KEY, ServeProcess
    from regeneration.config import RegenerateConfig
    from regeneration.regenerate import regenerate
    from training_jobs.config import TrainJobConfig
    from training_jobs.train import train_drafter

    target, work, corpus, engine_run, timings = regenerated_run(args)
    layers = tuple(read_run_spec(engine_run).layer_ids)
    regen = os.path.join(work, "regenerate-served")
    server_run = os.path.join(work, "run-regenerate-served")
    t0 = time.perf_counter()
    server = ServeProcess(target.path, os.path.join(work, "serve-out"), os.path.join(work, "serve.log"),
                          layers=(layers[-1],), dtype="float32", max_num_seqs=32, max_queued_requests=1024)
    timings["hsx serve start"] = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        result = regenerate(RegenerateConfig(server=(server.url,), corpus=(corpus,), output=regen, api_key=API_KEY,
                                             max_tokens=args.regenerate, concurrency=args.concurrency,
                                             progress=False))
        timings["hsx regenerate"] = time.perf_counter() - t0
    finally:
        server.kill()
    if result.failed:
        raise RuntimeError("\n".join(result.lines()))
    t0 = time.perf_counter()
    extract(target.path, regen, server_run, layers, args.threads)
    timings["hsx run prefill-only"] = time.perf_counter() - t0
    same, samples = same_tokens(engine_run, server_run)

    recipe = dict(kind="eagle3", model=target.path, epochs=args.epochs,
                  num_speculative_tokens=args.num_speculative_tokens, lr=args.drafter_lr,
                  batch_tokens=args.batch_tokens, progress=False, device="cpu")
    outs, reports = {}, {}
    for seed in args.seeds:
        for how, run in (("one engine", engine_run), ("hsx regenerate", server_run)):
            tag = f"e{args.epochs}-b{args.batch_tokens}-seed{seed}"
            outs[(how, seed)] = os.path.join(work, "drafters", f"eagle3-{how.replace(' ', '-')}-{tag}")
            t0 = time.perf_counter()
            reports[(how, seed)] = train_drafter(TrainJobConfig(run=run, out=outs[(how, seed)], seed=seed,
                                                                    **recipe))
            timings[f"train {how} seed {seed}"] = time.perf_counter() - t0
    rows, lossless = compare_drafters(target, args, outs, reports, ("one engine", "hsx regenerate"), timings)
    figures = {**rows, "al_ratio": rows["hsx regenerate"]["al_mean"] / rows["one engine"]["al_mean"],
               "tps_ratio": rows["hsx regenerate"]["tps_mean"] / rows["one engine"]["tps_mean"],
               "same_tokens": same, "samples": samples, "regenerate": result.lines(), "timings": timings,
               "lossless": lossless}
    lines = ["# EAGLE-3 trained on an hsx regenerate run vs the one-engine regeneration", "",
             f"Reference target {os.path.basename(target.path)}; {args.train_tokens} prompt tokens in "
             f"{args.prompt_len}-token prompts, each with the target's {args.regenerate} greedy tokens: once by the "
             "engine (`hsx run --max-tokens --include-output-tokens`), once by `hsx serve` through `hsx regenerate` "
             f"then `hsx run` prefill-only. {same} of {samples} samples hold the same tokens both ways. EAGLE-3, "
             f"{args.epochs} epochs of {args.batch_tokens}-token batches (lr {args.drafter_lr:g}), seeds {args.seeds}; "
             f"{args.num_prompts} held-out prompts x {args.max_tokens} tokens, greedy, k = {args.num_speculative_tokens}, "
             "every output equal to plain greedy decoding.", "", *rows_table(rows, "trained on")]
    lines += ["", f"hsx regenerate / one engine: AL {figures['al_ratio']:.3f}, tokens per target step "
                  f"{figures['tps_ratio']:.3f} (target: within 2%)."]
    return finish(args, "regenerate-drafters", figures, lines, timings)


if __name__ == "__main__":
    sys.exit(main())
