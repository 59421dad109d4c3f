"""The data-scaling curve: drafter families trained on 1x, 2x, 4x, 8x the data of one target, measured by speculative
decoding on held-out prompts — where, if anywhere, the block drafters (DFlash, DSpark) cross EAGLE-3.

    python benchmarks/bench_data_scaling.py --quick                 # tiny target, tiny data: the plumbing (~5 min)
    python benchmarks/bench_data_scaling.py --out bench-out         # the reference target (about an hour on 2 cores)

1. The reference target (reference/target.py, a Llama trained here on the standard library), cached.
2. Per data size d in --scales (x --base-tokens prompt tokens of train-split text): an hsx run of prompts cut from the
   train split plus the target's own greedy continuations (--regenerate, include_output_tokens), the layers every
   family reads; the runs of the sizes are prefixes of one another (the same records, more of them).
3. Each family in --kinds (default eagle3, peagle, dflash, dspark) trained on each run for --epochs epochs (steps =
   epochs x run tokens / batch tokens, at least --min-steps), the same learning rate and batch for all.
4. Greedy decoding of the same held-out prompts at k = --num-speculative-tokens (and each block drafter at its natural
   block): AL, per-position acceptance, tokens per target step; every output checked equal to plain decoding.
5. One figure (hsx report's style: Agg canvas, no pyplot; training/plot_text.py) of tokens per target step and AL
   against the data size, one line per family, and data_scaling.json / .md with the table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_drafters import extract, target_config, write_corpus  # noqa: E402

KINDS = ("eagle3", "peagle", "dflash", "dspark")
OPTIONS = {"dflash": {"block_size": 8}, "dspark": {"block_size": 8}, "peagle": {}, "eagle3": {}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small target, tiny data and few steps: the plumbing")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--scales", default="1,2,4,8", help="data sizes as multiples of --base-tokens")
    ap.add_argument("--base-tokens", type=int, default=None, help="prompt tokens at 1x (default 20000; --quick 1500)")
    ap.add_argument("--regenerate", type=int, default=None, help="continuation tokens per prompt (default 64)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--epochs", type=float, default=None, help="passes over each run (default 4; --quick 1)")
    ap.add_argument("--min-steps", type=int, default=None, help="at least this many steps (default 200; --quick 5)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=None, help="held-out prompts (default 24; --quick 3)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per prompt (default 96; --quick 16)")
    ap.add_argument("--target-steps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    defaults = {"base_tokens": (20_000, 1_500), "regenerate": (64, 16), "epochs": (4.0, 1.0), "min_steps": (200, 5),
                "num_prompts": (24, 3), "max_tokens": (96, 16)}
    for name, (full, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else full)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    args.scales = [int(s) for s in args.scales.split(",")]
    bad = [k for k in args.kinds if k not in KINDS]
    if bad:
        ap.error(f"--kinds {bad}: choose from {list(KINDS)}")
    return args


def run_tokens(run: str) -> int:
    """Tokens stored in run `run` (its committed samples, from the manifest)."""
    import pyarrow.compute as pc

    from connectors.manifest import ok_rows

    return int(pc.sum(ok_rows(run)["num_tokens"]).as_py())


def plot(rows: list[dict], path: str) -> None:
    """Tokens per target step and AL against data size, one line per family (hsx report's figure style)."""
    from training.plot_text import figure, png

    fig = figure(11, 3.6)
    axes = fig.subplots(1, 2)
    for ax, key, title in ((axes[0], "tokens_per_target_step", "tokens per target step"),
                           (axes[1], "mean_acceptance_length", "mean acceptance length")):
        for kind in sorted({r["kind"] for r in rows}):
            pts = sorted((r["train_tokens"], r[key]) for r in rows if r["kind"] == kind and r.get(key) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=kind)
        ax.set_xscale("log", base=2)
        xs = sorted({r["train_tokens"] for r in rows})
        ax.set_xticks(xs, [f"{x:,}" for x in xs])  # plain numbers: the figure's text is literal (no mathtext)
        ax.minorticks_off()
        ax.set_xlabel("training tokens (prompt + continuation)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    with open(path, "wb") as f:
        f.write(png(fig, dpi=90, bbox_inches="tight"))


def main(argv: list[str] | None = None) -> int:
    from reference.target import build_reference_target
    from training.evaluate import comparison_table, evaluate_speculation
    from training.train_config import TrainDrafterConfig
    from training_jobs.train import train_drafter

    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    target = build_reference_target(target_config(argparse.Namespace(quick=args.quick, threads=args.threads,
                                                                     target_steps=args.target_steps)))
    n = int(target.report["config"]["num_hidden_layers"])
    layers = (2, n // 2, n - 3, n)
    base = os.environ.get("HSX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hsx")
    work = args.work or os.path.join(base, "bench-data-scaling" + ("-quick" if args.quick else ""))
    os.makedirs(work, exist_ok=True)
    key = f"{os.path.basename(target.path)}-b{args.base_tokens}-p{args.prompt_len}-r{args.regenerate}"
    largest = os.path.join(work, f"{key}-x{max(args.scales)}.jsonl")
    if not os.path.exists(largest):
        write_corpus(target, largest, args.base_tokens * max(args.scales), args.prompt_len)
    records = open(largest).read().splitlines()
    rows, timings = [], {}
    prompts = list(target.prompts[:args.num_prompts])
    for scale in args.scales:
        corpus = os.path.join(work, f"{key}-x{scale}.jsonl")
        if not os.path.exists(corpus):  # a prefix of the largest: the same records, fewer of them
            with open(corpus, "w") as f:
                f.write("\n".join(records[:max(1, len(records) * scale // max(args.scales))]) + "\n")
        run = corpus[:-len(".jsonl")] + "-run"
        t0 = time.perf_counter()
        extract(target.path, corpus, run, layers, args.threads, args.regenerate)
        timings[f"run x{scale}"] = time.perf_counter() - t0
        tokens = run_tokens(run)  # the whole run's, also when this call only resumed it (result.tokens: new ones)
        methods = {"none": None}
        for kind in args.kinds:
            out = os.path.join(work, f"{key}-x{scale}-{kind}-e{args.epochs}-lr{args.lr}")
            steps = max(args.min_steps, int(args.epochs * max(tokens, 1) / args.batch_tokens))
            if not os.path.isfile(os.path.join(out, "config.json")):
                t0 = time.perf_counter()
                train_drafter(TrainDrafterConfig(kind=kind, run=run, model=target.path, out=out, steps=steps,
                                                 num_speculative_tokens=args.num_speculative_tokens, lr=args.lr,
                                                 batch_tokens=args.batch_tokens, device=args.device or "auto",
                                                 family_options=OPTIONS[kind], progress=sys.stderr.isatty()))
                timings[f"train {kind} x{scale}"] = time.perf_counter() - t0
            methods[f"{kind} x{scale}"] = {"method": kind, "model": out,
                                           "num_speculative_tokens": args.num_speculative_tokens}
        t0 = time.perf_counter()
        results = evaluate_speculation(target.path, prompts, methods, args.max_tokens, threads=args.threads,
                                       device=args.device, strict=False, errors="record")
        timings[f"evaluation x{scale}"] = time.perf_counter() - t0
        print("\n".join(comparison_table(results)), flush=True)
        for r in results[1:]:
            d = r.to_dict()
            rows.append({"kind": r.method.split()[0], "scale": scale, "train_tokens": tokens, **{
                k: d.get(k) for k in ("mean_acceptance_length", "tokens_per_target_step", "acceptance_per_position",
                                      "lossless")}})
    table = ["| family | " + " | ".join(f"x{s}" for s in args.scales) + " |",
             "|---|" + "---|" * len(args.scales)]
    for kind in args.kinds:
        cells = []
        for s in args.scales:
            r = next((r for r in rows if r["kind"] == kind and r["scale"] == s), None)
            cells.append("-" if r is None or r["tokens_per_target_step"] is None else
                         f"{r['tokens_per_target_step']:.2f} (AL {r['mean_acceptance_length']:.2f})")
        table.append(f"| {kind} | " + " | ".join(cells) + " |")
    md = "\n".join(["tokens per target step (AL) on held-out prompts, k = "
                    f"{args.num_speculative_tokens}, by training data size", "", *table, "",
                    "timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items())])
    out_dir = args.out or work
    os.makedirs(out_dir, exist_ok=True)
    plot(rows, os.path.join(out_dir, "data_scaling.png"))
    from benchmarks.common import write_results

    write_results(out_dir, "data_scaling", {"args": vars(args), "rows": rows, "timings": timings}, md)
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
