"""Speculative decoding benchmark: greedy tokens/s and mean acceptance length, plain vs ngram vs draft_model.

    python benchmarks/bench_speculative.py                     # 64 prompts x 128 new tokens on the tiny Llama, CPU
    python benchmarks/bench_speculative.py --out bench-out --repeats 5 --device cuda

The target is the tiny Llama of the tests (4 layers, hidden 64, built locally); the draft is its first 2 layers with
its embeddings and lm_head (same vocabulary). Random weights: the acceptance figures measure the machinery, not a
trained drafter. Every row decodes the same prompts greedily; rows are interleaved per repeat, medians reported, and
each row's tokens are checked equal to plain decoding (speculation is lossless). Never pass/fail.
Mean acceptance length = 1 + accepted / drafts, from llm.get_metrics() as vLLM's spec_decode_offline.py computes it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def _metric(llm, name):
    (m,) = [m for m in llm.get_metrics() if m.name == name]
    return m.values if hasattr(m, "values") else m.value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-spec-tokens", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads; on a shared CPU 1 avoids spinning threads that slow tiny models 10x")
    ap.add_argument("--out", default=None, help="folder for results.json and results.md")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from connectors import KVTransferConfig
    from extractor import LLM, SamplingParams
    from reference.tiny_models import build_tiny_model, sample_text

    if args.threads:
        torch.set_num_threads(args.threads)
    work = tempfile.mkdtemp(prefix="hsx-bench-spec-")
    target = build_tiny_model("llama", os.path.join(work, "target"))
    draft = os.path.join(work, "draft")
    small = AutoModelForCausalLM.from_pretrained(target)
    small.model.layers = small.model.layers[:2]
    small.config.num_hidden_layers = 2
    small.save_pretrained(draft)

    k = args.num_spec_tokens
    engines = {
        "plain": LLM(model=target, device=args.device, kv_transfer_config=KVTransferConfig(
            kv_connector_extra_config={"shared_storage_path": os.path.join(work, "hs")})),
        f"ngram k={k}": LLM(model=target, device=args.device, speculative_config={
            "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 5, "prompt_lookup_min": 2}),
        f"draft_model k={k} (2 layers)": LLM(model=target, device=args.device, speculative_config={
            "method": "draft_model", "model": draft, "num_speculative_tokens": k}),
    }
    tok = engines["plain"].tokenizer
    prompts = [{"prompt_token_ids": tok(t).input_ids} for t in sample_text(args.prompts, seed=11)]
    sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    times = {name: [] for name in engines}
    tokens = {}
    reference = None
    names = list(engines)
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            t0 = time.perf_counter()
            outs = engines[name].generate(prompts, sp)
            times[name].append(time.perf_counter() - t0)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
        reference = tokens["plain"]
    rows = []
    for name, llm in engines.items():
        n_tokens = sum(len(t) for t in tokens[name])
        median = statistics.median(times[name])
        row = {"engine": name, "tokens_per_s": n_tokens / median, "median_s": median,
               "same_tokens_as_plain": tokens[name] == reference}
        if name != "plain":
            drafts = _metric(llm, "vllm:spec_decode_num_drafts")
            accepted = _metric(llm, "vllm:spec_decode_num_accepted_tokens")
            per_pos = _metric(llm, "vllm:spec_decode_num_accepted_tokens_per_pos")
            row["mean_acceptance_length"] = 1 + accepted / drafts if drafts else 1.0
            row["acceptance_per_position"] = [p / drafts if drafts else 0.0 for p in per_pos]
        rows.append(row)
    lines = [f"{args.prompts} prompts x {args.output_len} new tokens, greedy, medians of {args.repeats}",
             "", "| engine | tokens/s | mean acceptance length | acceptance per position | lossless |",
             "|---|---|---|---|---|"]
    for r in rows:
        al = f"{r['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in r else "-"
        pos = " / ".join(f"{a:.2f}" for a in r.get("acceptance_per_position", [])) or "-"
        lines.append(f"| {r['engine']} | {r['tokens_per_s']:.0f} | {al} | {pos} | {r['same_tokens_as_plain']} |")
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(rows, f, indent=2)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
