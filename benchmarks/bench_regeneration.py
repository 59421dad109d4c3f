"""Regeneration benchmark: hsx generating responses and writing their hidden states vs transformers `generate`.

    python benchmarks/bench_regeneration.py --out bench-out                 # CPU: the "small" shape, fp32
    python benchmarks/bench_regeneration.py --out bench-out --device cuda   # GPU: Llama-3-8B shape, bf16

What users do to build drafter data from a model's own answers: generate up to --max-tokens per prompt and keep the
hidden states of prompt + response. Same random model (bench_extraction's shapes, built locally), prompts, dtype and
device for every row, in one process:

    (a) transformers   `model.generate(do_sample=False)` on length-sorted, left-padded batches of --batch-size prompts
                       (what regeneration scripts do); nothing kept
    (b) hsx            `LLM.generate` with `include_output_tokens`: every prompt and output token's states of 4
                       layers written as safetensors files, timed until every file is durable; continuous batching
                       up to max_num_seqs = --batch-size rows
    (c) hsx, prompts   the same engine without `include_output_tokens`: only the prompts' states are written (what
                       capturing and writing the output tokens' states costs)

Two workloads: "fixed" (ignore_eos: every row generates exactly --max-tokens, so batches end together and continuous
batching has nothing to refill) and "eos" (an end-of-sequence token the model really emits part-way — the token its
free greedy outputs produce most — so rows end at different steps, as answers do: transformers keeps a batch
decoding until its longest row ends, hsx refills finished rows' slots from waiting prompts). Every hsx row's tokens
are checked equal to transformers' for the same prompt (greedy). Tokens/s counts generated tokens only. Approaches
are interleaved per repeat; medians of per-repeat ratios are reported; never pass/fail (target: (b)/(a) >= 1.0).
Writes results.json and results.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import SHAPES, build_model, machine_info, make_corpus, sync  # noqa: E402
from connectors import KVTransferConfig  # noqa: E402
from extractor import LLM, SamplingParams  # noqa: E402

TARGET = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for results, the model and the written files")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--shape", default="auto", choices=["auto", *SHAPES])
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=None, help="default 64 on CPU, 512 on CUDA")
    p.add_argument("--batch-size", type=int, default=None, help="rows per batch (both); default 32 CPU, 256 CUDA")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workloads", default="fixed,eos")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=None)
    return p.parse_args(argv)


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cuda = args.device.startswith("cuda")
    if on_cuda and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device} but CUDA is not available here; use --device cpu")
    args.dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if on_cuda else "float32")
    args.shape = args.shape if args.shape != "auto" else ("llama3-8b" if on_cuda else "small")
    args.num_prompts = args.num_prompts or (512 if on_cuda else 64)
    args.batch_size = args.batch_size or (256 if on_cuda else 32)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.model_dir = args.model_dir or os.path.join(args.out, f"model-{args.shape}-{args.dtype}")
    return args


def hf_generate(model, prompts: list[list[int]], batch_size: int, max_tokens: int, eos: int | None, pad_id: int,
                device) -> list[list[int]]:
    """Length-sorted, left-padded batches through transformers' generate; outputs in prompt order, cut at EOS."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    outs: dict[int, list[int]] = {}
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for b, i in enumerate(idx):
            ids[b, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[b, width - len(prompts[i]):] = 1
        kw = {"min_new_tokens": max_tokens} if eos is None else {"eos_token_id": eos}
        with torch.inference_mode():
            gen = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=pad_id, **kw)[:, width:].tolist()
        for b, i in enumerate(idx):
            row = gen[b]
            if eos is not None and eos in row:
                row = row[:row.index(eos) + 1]
            outs[i] = row
    return [outs[i] for i in range(len(prompts))]


def pick_eos(model, prompts, args, device, pad_id) -> int:
    """The token the model's free greedy outputs produce most (from a few prompts): a real mid-answer stop."""
    free = hf_generate(model, prompts[:8], 8, args.max_tokens, None, pad_id, device)
    counts = torch.bincount(torch.tensor([t for row in free for t in row[4:]]))
    return int(counts.argmax())


def main(argv: list[str] | None = None) -> None:
    args = resolve(parse_args(argv))
    os.makedirs(args.out, exist_ok=True)
    build_model(args)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    pad_id = tokenizer.pad_token_id or 0
    prompts = make_corpus(tokenizer, args.num_prompts, args.min_len, args.max_len, args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype)).to(device).eval()
    files = os.path.join(args.out, "hs")
    layers = [2, 4, 5, 8] if args.shape == "small" else [2, 16, 29, 32]
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}}
    common = dict(dtype=args.dtype, device=args.device, max_num_seqs=args.batch_size,
                  max_num_batched_tokens=max(8192, args.max_len), speculative_config=spec)
    writer = LLM(model=args.model_dir, kv_transfer_config=KVTransferConfig(
        kv_connector_extra_config={"shared_storage_path": files}), **common)
    results = {"machine": machine_info(device), "args": vars(args), "workloads": {}}
    for workload in args.workloads.split(","):
        eos = None if workload == "fixed" else pick_eos(model, prompts, args, device, pad_id)
        stop = [] if eos is None else [eos]  # the model's own EOS is ignored in both workloads; this one stops
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, stop_token_ids=stop,
                                extra_args={"kv_transfer_params": {"include_output_tokens": True}})
        plain = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, stop_token_ids=stop)
        reference = hf_generate(model, prompts, args.batch_size, args.max_tokens, eos, pad_id, device)  # warm-up
        n_tokens = sum(len(r) for r in reference)
        times: dict[str, list[float]] = {"transformers": [], "hsx": [], "hsx_prompt_files": []}
        for rep in range(args.repeats + 1):  # repeat 0 warms the engine up
            names = list(times)
            names = names[rep % 3:] + names[:rep % 3]
            for name in names:
                shutil.rmtree(files, ignore_errors=True)
                sync(device)
                t0 = time.perf_counter()
                if name == "transformers":
                    got = hf_generate(model, prompts, args.batch_size, args.max_tokens, eos, pad_id, device)
                else:
                    outs = writer.generate([{"prompt_token_ids": p} for p in prompts],
                                           params if name == "hsx" else plain)
                    got = [o.outputs[0].token_ids for o in outs]
                    bad = [o.error for o in outs if o.error]
                    if bad:
                        raise SystemExit(f"hsx requests failed: {bad[:3]}")
                sync(device)
                if rep:
                    times[name].append(time.perf_counter() - t0)
                if got != reference:
                    diff = sum(a != b for a, b in zip(got, reference))
                    print(f"warning: {name} differs from transformers on {diff} of {len(prompts)} prompts "
                          "(float non-associativity in batched matmuls can flip a near-tie)")
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = statistics.median(t_hf / t_hsx for t_hf, t_hsx in zip(times["transformers"], times["hsx"]))
        ratio_nf = statistics.median(t_hf / t for t_hf, t in zip(times["transformers"], times["hsx_prompt_files"]))
        results["workloads"][workload] = {
            "generated_tokens": n_tokens, "eos": eos, "seconds": med,
            "tokens_per_s": {k: n_tokens / v for k, v in med.items()},
            "hsx_over_transformers": ratio, "hsx_prompt_files_over_transformers": ratio_nf, "target": TARGET}
        print(f"[{workload}] {len(prompts)} prompts, {n_tokens} generated tokens, batch {args.batch_size}: "
              + ", ".join(f"{k} {n_tokens / v:.0f} tok/s" for k, v in med.items())
              + f"; hsx/transformers {ratio:.2f}x (prompt files only {ratio_nf:.2f}x; target >= {TARGET})")
    writer.shutdown()
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    lines = ["| workload | transformers tok/s | hsx tok/s (files) | hsx tok/s (prompt files only) | hsx / transformers |",
             "|---|---|---|---|---|"]
    for w, r in results["workloads"].items():
        t = r["tokens_per_s"]
        lines.append(f"| {w} | {t['transformers']:.0f} | {t['hsx']:.0f} | {t['hsx_prompt_files']:.0f} | "
                     f"{r['hsx_over_transformers']:.2f}x |")
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
