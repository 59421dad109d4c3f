"""Drafters end to end on a target that has learned something: extract -> train -> speculative decoding -> acceptance.

    python benchmarks/bench_drafters.py --quick              # small target, few samples and steps: the plumbing
    python benchmarks/bench_drafters.py --out bench-out      # the reference target, the figures for the README

1. The reference target (reference/target.py): a small Llama trained on this CPU on the standard library's
   sources, cached; its held-out prompts come from stdlib files it never saw.
2. An hsx run (jobs.pipeline, the `hsx run` job) over its train texts, as pre-tokenized records of at most the
   target's context length; default layers = EAGLE-3's [2, N//2, N-3] + N.
3. Each drafter kind whose trainer exists (training.trainer; a kind whose module is missing is skipped and
   said so) trained on that run: EAGLE (vLLM's eagle), EAGLE-3, P-EAGLE (all k drafts in one forward), DFlash (a block
   of 8 slots in one forward), Medusa, MLPSpeculator; P-EAGLE and DFlash are also decoded at their natural block
   (k = 7, NATURAL_K) beside the shared k.
4. The teeth: the same EAGLE-3 recipe on deliberately wrong data, the bugs users hit:
   - "post-norm as pre-norm": the good run's last layer put through the target's final norm but still labelled
     pre-norm (hsx's job always stores id N pre-norm, so this run is made by rewriting the good run's files through
     the connector with the wrong data under the old label);
   - "aux ids shifted": a second hsx run extracting [1, N//2-1, N-4] (the 0-based output indices of SpecForge /
     ModelOpt read as vLLM ids) whose files are then rewritten through the connector labelled [2, N//2, N-3].
   Both should decode with a lower acceptance length than the good run: if they do not, the measurement has no teeth.
5. Greedy decoding of held-out prompts (training/evaluate.py): none, ngram k=3 and 5, each drafter at each
   k, the teeth at k=3; vLLM's spec_decode.py lines per method, a comparison table, every output checked equal to
   plain greedy decoding. All prompts decode together (vLLM's offline example submits them at once), then again one
   request at a time (--one-at-a-time, default on; none, ngram and the good drafters): the latency regime
   speculative decoding is for. On a small model a step costs about the same at any batch width, so a wide batch
   runs until its slowest row is done and pays the drafter and the k+1-token verification every step; one request
   at a time gains its own acceptance length.

Work files live under --work (default $HSX_CACHE/bench-drafters or ~/.cache/hsx/bench-drafters), keyed by the target
and sizes: a second run reuses the extraction runs (hsx run resumes) and trained drafters. Never pass/fail, except
that a lossy method exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KINDS = ("eagle", "eagle3", "peagle", "dflash", "medusa", "mlp_speculator")
NATURAL_K = {"peagle": 7, "dflash": 7}
"""Drafts per step a family is built for besides the shared --num-speculative-tokens: P-EAGLE's parallel depths and
DFlash's block of 8 (anchor + 7 slots), each drafted in one forward."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a small target (1-2 min to train), few samples, few drafter steps: proves the plumbing")
    ap.add_argument("--target-steps", type=int, default=None,
                    help="reference target training steps (default: the config's, ~5 min on 2 cores; more = a better "
                         "target, cached separately)")
    ap.add_argument("--train-tokens", type=int, default=None,
                    help="tokens of train text to extract (default 300000; --quick 12000)")
    ap.add_argument("--steps", type=int, default=None, help="drafter training steps (default 1500; --quick 10)")
    ap.add_argument("--drafter-lr", type=float, default=1e-3, help="drafter learning rate")
    ap.add_argument("--lr-schedule", default="constant", choices=("constant", "cosine"),
                    help="drafter learning-rate schedule (hsx train-drafter --lr-schedule)")
    ap.add_argument("--warmup-steps", type=int, default=0, help="drafter learning-rate warmup steps")
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="drafter training tokens per packed batch (default 2048; --quick 1024)")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, nargs="+", default=None,
                    help="draft lengths (default 3 5; --quick 3)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="drafter kinds to train, comma-separated")
    ap.add_argument("--no-teeth", action="store_true", help="skip the deliberately wrong EAGLE-3 runs")
    ap.add_argument("--num-prompts", type=int, default=None, help="held-out prompts (default 32; --quick 6)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per prompt (default 128; --quick 24)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per method (default 3; --quick 1)")
    ap.add_argument("--regenerate", type=int, default=0,
                    help="regenerate: each record is a --prompt-len-token prompt and the run stores it plus the "
                         "target's own greedy continuation of this many tokens (include_output_tokens), the "
                         "self-distillation data EAGLE-3 / Medusa recipes train on; 0 = the corpus text as is")
    ap.add_argument("--prompt-len", type=int, default=64, help="with --regenerate: prompt tokens per record")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (on a shared CPU 1 avoids spinning threads; default torch's)")
    ap.add_argument("--device", default=None, help="decoding and training device (default cpu / auto)")
    ap.add_argument("--one-at-a-time", action=argparse.BooleanOptionalAction, default=True,
                    help="also time none, ngram and the good drafters with max_num_seqs=1 (default on)")
    ap.add_argument("--work", default=None, help="work folder (runs, drafters); reused across invocations")
    ap.add_argument("--out", default=None, help="folder for results.json and results.md")
    args = ap.parse_args(argv)
    quick = args.quick
    defaults = {"train_tokens": (300_000, 12_000), "steps": (1500, 10), "num_speculative_tokens": ([3, 5], [3]),
                "num_prompts": (32, 6), "max_tokens": (128, 24), "repeats": (3, 1), "batch_tokens": (2048, 1024)}
    for name, (full, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in args.kinds if k not in KINDS]
    if bad:
        ap.error(f"--kinds {bad}: choose from {list(KINDS)}")
    return args


QUICK_TARGET = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=192,
                    vocab_size=1024, context_length=128, batch_size=8, steps=60, warmup_steps=6, max_train_files=60,
                    num_prompts=16, prompt_tokens=48)
"""--quick's reference target: trained in a minute or two (the plumbing, not the figures)."""


def target_config(args, **overrides):
    """The reference target for args.quick / args.target_steps / args.threads; `overrides` (e.g. architecture,
    mtp_layers) on top."""
    from reference.target import ReferenceTargetConfig

    sizes = dict(QUICK_TARGET) if args.quick else {}
    if args.target_steps:
        sizes["steps"] = args.target_steps
    return ReferenceTargetConfig(threads=args.threads, **{**sizes, **overrides})


# -- the corpus and the runs ------------------------------------------------------------------------------------------


def write_corpus(target, path: str, max_tokens: int, block: int) -> int:
    """The train texts as pre-tokenized JSONL records of at most `block` tokens, up to `max_tokens` tokens in all."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target.path)
    total = 0
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for file in target.train_files:
            ids = tok(file.read())["input_ids"] + [tok.eos_token_id]
            for i in range(0, len(ids), block):
                piece = ids[i:i + block]
                if len(piece) < 8:
                    continue
                f.write(json.dumps({"id": f"{file.rel}#{i // block}", "input_ids": piece}) + "\n")
                total += len(piece)
                if total >= max_tokens:
                    break
            if total >= max_tokens:
                break
    os.replace(tmp, path)
    return total


def extract(model: str, corpus: str, output: str, layers: tuple[int, ...] | None, threads: int | None,
            regenerate: int = 0):
    """An hsx run (the `hsx run` job, local Ray) of `corpus` through `model`; resumes when `output` has one. With
    `regenerate`, each record is a prompt and the run also stores the target's greedy continuation."""
    from jobs.config import JobConfig
    from jobs.pipeline import run_job

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    generation = dict(max_tokens=regenerate, temperature=0.0, include_output_tokens=True) if regenerate else {}
    config = JobConfig(model=model, corpus=(corpus,), output=output, layers=layers, dtype="float32",
                       workers=1, cpus_per_worker=threads, progress=False, fail_on_error=True, **generation)
    result = run_job(config)
    if result.failed:
        raise RuntimeError(f"extraction into {output}: {result.failed} samples failed, first {result.failures[:1]}")
    return result


def rewrite_run(src: str, dst: str, *, files=None, transform=None, storage_dtype: str = "") -> int:
    """Copy the committed samples of run `src` to a new run `dst` through the connector: each sample's states
    [T, L, H] passed through `transform` (returning the states, or (states, extra per-token rows) for a top-k
    target), the files (and run.json) described by `files(source file spec)` instead of the source's spec, stored in
    `storage_dtype`. The teeth use it for deliberately wrong data (labels that no longer say what the numbers are);
    bench_storage_quality for one run stored several ways. Prompt and generated tokens stay as the source has them."""
    from connectors import KVTransferConfig, RequestInfo
    from connectors.manifest import new_attempt_id, ok_rows, write_manifest_part
    from connectors.reader import load_hidden_states, read_hidden_states_info
    from connectors.run import RunDir, read_run_spec, write_run_spec

    if os.path.isfile(os.path.join(dst, "run.json")):
        return -1  # made by an earlier invocation
    source = RunDir(src)
    spec = read_run_spec(source)
    spec_files = files(spec.files) if files is not None else spec.files
    if storage_dtype:
        spec_files = dataclasses.replace(spec_files, storage_dtype=storage_dtype)
    connector = KVTransferConfig(kv_connector_extra_config={
        "shared_storage_path": dst, "allow_custom_save_path": True, "storage_dtype": storage_dtype or "model"}
    ).create_connector(spec_files)
    rows = []
    for row in ok_rows(source).to_pylist():
        sample = load_hidden_states(source.url_of(row["path"]))
        states, extra = sample["hidden_states"], None  # [T, L, H]
        if transform is not None:
            states = transform(states)
            if isinstance(states, tuple):
                states, extra = states
        rid, t = row["sample_id"], int(states.shape[0])
        prompt = int(read_hidden_states_info(source.url_of(row["path"])).metadata.get("num_prompt_tokens", t))
        mask = sample.get("loss_mask")
        connector.start_request(RequestInfo(request_id=rid, num_prompt_tokens=prompt, sample_id=rid,
                                            kv_transfer_params={"hidden_states_path": row["path"],
                                                                "include_output_tokens": prompt < t},
                                            loss_mask=None if mask is None else mask[:prompt]))
        connector.save_hidden_states(rid, sample["token_ids"], states, extra)
        connector.request_finished(rid)
        rows.append({"sample_id": rid, "status": "ok", "path": row["path"], "num_tokens": t,
                     "num_prompt_tokens": prompt})
    failures = connector.wait_for_save()
    connector.shutdown()
    if failures:
        raise RuntimeError(f"rewriting {src} -> {dst}: {len(failures)} files failed: {next(iter(failures.values()))}")
    for row in rows:
        path = os.path.join(dst, row["path"])
        row["bytes"] = os.path.getsize(path)
        row["checksum"] = read_hidden_states_info(path).checksum
    out = RunDir(dst)
    write_manifest_part(out, rows, new_attempt_id(), 0)
    write_run_spec(out, dataclasses.replace(spec, files=spec_files))  # last: a run without run.json is redone
    return len(rows)


def post_norm_last_layer(model: str, layer_ids: tuple[int, ...], n: int):
    """[T, L, H] -> the same with layer id N replaced by final_norm(layer N): post-norm where pre-norm is claimed."""
    from extractor.norm import FinalNorm

    norm = FinalNorm.from_model_dir(model)
    pos = layer_ids.index(n)

    def transform(states):
        out = states.clone()
        out[:, pos] = norm(states[:, pos].float()).to(states.dtype)
        return out

    return transform


# -- drafters ---------------------------------------------------------------------------------------------------------


def train(kind: str, run: str, model: str, out: str, args) -> tuple[dict | None, str | None]:
    """(report, None) after training `kind` on `run` into `out`, or (None, why it was skipped)."""
    try:
        from drafters.registry import drafter_class
        from training.train_config import TrainDrafterConfig
        from training_jobs.train import train_drafter

        drafter_class(kind)
    except (ImportError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"
    k = max([*args.num_speculative_tokens, NATURAL_K.get(kind, 0)])
    config = TrainDrafterConfig(kind=kind, run=run, model=model, out=out, steps=args.steps,
                                num_speculative_tokens=k, lr=args.drafter_lr,
                                lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps,
                                batch_tokens=args.batch_tokens, device=args.device or "auto",
                                progress=sys.stderr.isatty())
    return train_drafter(config), None


def reference_target(args: argparse.Namespace):
    """(the cached reference target for `args`, {"reference target": seconds}), torch on --threads threads."""
    import torch

    from reference.target import build_reference_target

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    target = build_reference_target(target_config(args))
    return target, {"reference target": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmarks.common import lossless_status
    from reference.target import default_cache_root
    from training.evaluate import comparison_table, eval_methods, evaluate_speculation, result_lines

    target, timings = reference_target(args)
    rep = target.report
    print(f"reference target {target.path} ({'cached' if target.cached else 'built'}; build took "
          f"{rep['build_seconds']:.0f} s): {rep['parameters'] / 1e6:.2f}M parameters, "
          f"{rep['train_tokens_seen']} tokens seen, train loss {rep['final_train_loss']:.3f}, "
          f"held-out loss {rep['heldout_loss']:.3f} (perplexity {rep['heldout_perplexity']:.1f})", flush=True)

    from transformers import AutoConfig

    n = AutoConfig.from_pretrained(target.path).num_hidden_layers
    aux = (2, n // 2, n - 3)
    work = args.work or os.path.join(os.path.dirname(default_cache_root()), "bench-drafters",
                                     f"{os.path.basename(target.path)}-t{args.train_tokens}"
                                     + (f"-regen{args.regenerate}-p{args.prompt_len}" if args.regenerate else ""))
    os.makedirs(work, exist_ok=True)
    corpus = os.path.join(work, "train.jsonl")
    if not os.path.isfile(corpus):
        block = args.prompt_len if args.regenerate else rep["config"]["context_length"]
        tokens = write_corpus(target, corpus, args.train_tokens, block)
        print(f"corpus: {tokens} train tokens -> {corpus}", flush=True)

    good = os.path.join(work, "run")
    t0 = time.perf_counter()
    result = extract(target.path, corpus, good, None, args.threads, args.regenerate)
    timings["extraction (good run)"] = time.perf_counter() - t0
    print(f"hsx run -> {good}: {result.ok} new samples, {result.skipped} already there, {result.tokens} tokens, "
          f"{timings['extraction (good run)']:.0f} s", flush=True)

    runs = {"": good}
    if not args.no_teeth:
        post = os.path.join(work, "run-post-norm-as-pre-norm")
        from training.dataset import read_run_info

        good_ids = tuple(read_run_info(good).layer_ids)
        rewrite_run(good, post, transform=post_norm_last_layer(target.path, good_ids, n))
        shifted_src = os.path.join(work, "run-aux-minus-one")
        t0 = time.perf_counter()
        extract(target.path, corpus, shifted_src, tuple(a - 1 for a in aux) + (n,), args.threads, args.regenerate)
        timings["extraction (shifted run)"] = time.perf_counter() - t0
        shifted = os.path.join(work, "run-aux-shifted-labelled-eagle3")
        rewrite_run(shifted_src, shifted, files=lambda f: dataclasses.replace(f, layer_ids=aux + (n,)))
        runs.update({"post-norm as pre-norm": post, "aux ids shifted by one": shifted})

    drafters, skipped, reports = [], {}, {}
    jobs = [(kind, "", good) for kind in args.kinds]
    if "eagle3" in args.kinds:
        jobs += [("eagle3", label, run) for label, run in runs.items() if label]
    for kind, label, run in jobs:
        name = kind + (f" ({label})" if label else "")
        out = os.path.join(work, "drafters", f"{kind}-{label.replace(' ', '-') or 'good'}-s{args.steps}"
                           f"-lr{args.drafter_lr:g}-b{args.batch_tokens}"
                           + (f"-{args.lr_schedule}-w{args.warmup_steps}" if args.lr_schedule != "constant"
                              or args.warmup_steps else ""))
        t0 = time.perf_counter()
        report, why = train(kind, run, target.path, out, args)
        if why:
            skipped[name] = why
            print(f"{name}: skipped ({why})", flush=True)
            continue
        timings[f"train {name}"] = time.perf_counter() - t0
        reports[name] = report
        print(f"{name}: trained {args.steps} steps in {timings[f'train {name}']:.0f} s -> {out}", flush=True)
        drafters.append((name, kind, out, bool(label)))

    ks = args.num_speculative_tokens
    methods = eval_methods([(name, kind, out) for name, kind, out, teeth in drafters if not teeth], ks)
    for name, kind, out, teeth in drafters:  # the families' natural blocks, drafted in one forward
        if not teeth and kind in NATURAL_K and NATURAL_K[kind] not in ks:
            methods[f"{name} k={NATURAL_K[kind]}"] = {"method": kind, "model": out,
                                                      "num_speculative_tokens": NATURAL_K[kind]}
    good_dirs = {out for _, _, out, teeth in drafters if not teeth}
    for name, kind, out, teeth in drafters:
        if teeth:
            methods[f"{name} k={ks[0]}"] = {"method": kind, "model": out, "num_speculative_tokens": ks[0]}
    prompts = list(target.prompts[:args.num_prompts])
    t0 = time.perf_counter()
    results = evaluate_speculation(target.path, prompts, methods, args.max_tokens, repeats=args.repeats,
                                   threads=args.threads, device=args.device, strict=False, errors="record")
    timings["evaluation"] = time.perf_counter() - t0
    single = []
    if args.one_at_a_time:
        t0 = time.perf_counter()
        good = {name: cfg for name, cfg in methods.items()
                if cfg is None or cfg.get("method") == "ngram" or cfg.get("model") in good_dirs}
        single = evaluate_speculation(target.path, prompts, good, args.max_tokens, repeats=args.repeats,
                                      threads=args.threads, device=args.device, strict=False, errors="record",
                                      max_num_seqs=1)
        timings["evaluation, one request at a time"] = time.perf_counter() - t0

    lines = []
    for r in results:
        lines += result_lines(r) + [""]
    lines += [f"{len(prompts)} held-out prompts x {args.max_tokens} tokens, greedy, medians of {args.repeats}; "
              f"target {os.path.basename(target.path)} ({rep['parameters'] / 1e6:.2f}M parameters, held-out "
              f"perplexity {rep['heldout_perplexity']:.1f}); drafters {args.steps} steps of {args.batch_tokens} tokens "
              f"(lr {args.drafter_lr:g}, {args.lr_schedule}, warmup {args.warmup_steps}) on {args.train_tokens} "
              "tokens" + (f" of {args.prompt_len}-token prompts + {args.regenerate} regenerated tokens each"
                          if args.regenerate else ""), ""]
    lines += ["all prompts at once:"] + comparison_table(results)
    if single:
        lines += ["", "one request at a time (max_num_seqs=1):"] + comparison_table(single)
    plain = results[0]
    if plain.token_ids:  # what the target writes: a degenerate target (one token repeated) makes every AL high
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(target.path)
        lines += ["", "samples of plain greedy decoding (prompt | output):"]
        lines += [f"  {prompts[i][-60:]!r} | {tok.decode(plain.token_ids[i])[:120]!r}"
                  for i in range(min(3, len(prompts)))]
    if skipped:
        lines += [""] + [f"skipped {name}: {why}" for name, why in skipped.items()]
    lines += ["", "timings: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())]
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"target": {"path": target.path, **{k: v for k, v in rep.items() if k != "loss_curve"}},
                       "args": vars(args), "timings": timings, "skipped": skipped,
                       "training": {k: v for k, v in reports.items()},
                       "results": [r.to_dict() for r in results],
                       "results_one_at_a_time": [r.to_dict() for r in single]}, f, indent=2, default=str)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return lossless_status([f"{r.method} (max_num_seqs {r.max_num_seqs or 'default'})" for r in results + single
                            if not r.lossless])


if __name__ == "__main__":
    sys.exit(main())
