"""What each drafter family costs to train: step time and peak memory at the same --batch-tokens, side by side.

    python benchmarks/bench_training_cost.py [--shapes tiny,mid] [--batch-tokens 2048,4096,8192] [--steps 3]
        [--families eagle3,...] [--device cpu|cuda] [--dtype float32|bfloat16] [--memory-cap-gb 16] [--out DIR]
        [--options JSON] [--memory '{"ce_chunk_tokens": 4096, "gradient_checkpointing": true}'] [--doc-tokens 512]

Every (family, shape, batch) runs in a process of its own (peak memory is a process's): the family's drafter is
built for a run of random states shaped like the target's (aux layers 1, 2, 3 and N), prepared, and trained
`--steps` AdamW steps on one packed batch of --batch-tokens tokens (documents of 512 tokens), as `hsx train-drafter`
packs them. Reported: the mean step time after the first (warm) step, and the peak memory: process RSS on CPU (above
the process's RSS after the target's head and the drafter are built), torch.cuda.max_memory_allocated on GPU. A
process that needs more than --memory-cap-gb (CPU: its address space is capped) is reported as "over the cap", the
others go on. --memory turns on the memory levers of `hsx train-drafter` (drafters/memory.py) in every family.

Shapes: tiny = the suite's 4-layer, 64-wide Llama (vocabulary 512); small = 8 layers, 512 wide, vocabulary 4,096 (the
shape the issue measured); mid = 4 layers, 1024 wide, vocabulary 32,000
(the issue's H 1024 / vocab 32k); 8b = Llama-3-8B's width and vocabulary (GPU only: benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    # the measured case: a 512-wide, 8-layer tiny Llama, vocabulary 4,096 (EAGLE-3 11.3 GB at 8k tokens)
    "small": dict(hidden_size=512, intermediate_size=1792, num_attention_heads=8, num_key_value_heads=2,
                  vocab_size=4096, num_hidden_layers=8),
    "mid": dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2,
                vocab_size=32000),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               vocab_size=128256),
}
OPTIONS = {"eagle3": {"draft_vocab_size": 256}, "peagle": {"draft_vocab_size": 256}, "dflash": {"block_size": 4},
           "medusa": {"medusa_num_layers": 2}}
"""The families' options (k = 3 drafts everywhere); a draft vocabulary where the family has one."""
DOC_TOKENS = 512


def child(args) -> dict:
    """One measurement, in this process."""
    import torch

    from benchmarks.common import peak_rss, reset_peak_rss, rss
    from connectors import HiddenStatesSpec
    from drafters.base import DrafterBatch, TargetHead
    from drafters.memory import MemoryOptions, autocast
    from drafters.registry import drafter_class
    from harness.runs import random_samples, write_run
    from reference.tiny_models import build_tiny_model
    from training import HiddenStatesDataset, PackCollator

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        shape = {"num_hidden_layers": 4, **SHAPES[args.shape]}
        model_dir = build_tiny_model("llama", os.path.join(tmp, "target"), **shape)
        n = shape["num_hidden_layers"]
        layers = (1, 2, 3, n)
        spec = HiddenStatesSpec(layer_ids=layers, num_hidden_layers=n, hidden_size=shape["hidden_size"],
                                dtype="float32", model=model_dir)
        docs = -(-args.batch_tokens // args.doc_tokens)
        write_run(os.path.join(tmp, "run"), random_samples(docs, spec, min_len=args.doc_tokens,
                                                           max_len=args.doc_tokens), spec)
        ds = HiddenStatesDataset(os.path.join(tmp, "run"))
        target = TargetHead.from_model_dir(model_dir)
        torch.manual_seed(0)
        options = OPTIONS.get(args.family, {}) if args.options is None else json.loads(args.options)
        drafter = drafter_class(args.family).for_run(ds.run_info, target, 3, **options)
        drafter.prepare(ds)
        drafter = drafter.to(device=device, dtype=dtype)
        drafter.use_memory(MemoryOptions(**json.loads(args.memory)))
        target = target.to(device, dtype)
        batch = DrafterBatch.from_packed(PackCollator(args.batch_tokens)([ds[i] for i in range(len(ds))]),
                                         ds.run_info.layer_ids)
        batch = batch.to(device, dtype)
        opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
        base = rss()
        reset_peak_rss()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            with autocast(drafter.memory, device):
                loss = drafter.training_step(batch, target).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss() - base
    warm = times[1:] or times
    return {"family": args.family, "shape": args.shape, "batch_tokens": args.batch_tokens,
            "step_s": sum(warm) / len(warm), "peak_bytes": peak, "base_rss_bytes": base,
            "memory": "cuda max allocated" if device.type == "cuda" else "RSS above the built drafter's"}


def measure(family: str, shape: str, batch_tokens: int, args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--family", family, "--shape", shape, "--batch-tokens",
           str(batch_tokens), "--steps", str(args.steps), "--device", args.device, "--dtype", args.dtype,
           "--memory-cap-gb", str(args.memory_cap_gb), "--doc-tokens", str(args.doc_tokens),
           "--memory", args.memory] + ([] if args.options is None else ["--options", args.options])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        over = "MemoryError" in done.stderr or "DefaultCPUAllocator" in done.stderr or done.returncode == -9
        return {"family": family, "shape": shape, "batch_tokens": batch_tokens,
                "error": f"over the {args.memory_cap_gb:g} GB cap" if over else done.stderr.strip()[-300:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict], args) -> str:
    out = [f"Steps: {args.steps} (mean of the warm ones), device {args.device}, {args.dtype}; memory: "
           + ("torch.cuda.max_memory_allocated" if args.device == "cuda" else "peak RSS above the built drafter's")
           + f"; memory levers {args.memory}; family options "
           + ("the benchmark's (OPTIONS)" if args.options is None else args.options),
           "", "| family | shape | batch tokens | step (s) | peak memory (GB) |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['family']} | {r['shape']} | {r['batch_tokens']} | - | {r['error']} |")
        else:
            out.append(f"| {r['family']} | {r['shape']} | {r['batch_tokens']} | {r['step_s']:.2f} | "
                       f"{r['peak_bytes'] / 1e9:.2f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="")
    ap.add_argument("--shapes", default="tiny")
    ap.add_argument("--batch-tokens", default="2048,4096,8192")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--memory-cap-gb", type=float, default=16.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--memory", default="{}", help="the memory levers as JSON, drafters.memory.MemoryOptions' fields "
                    '(e.g. \'{"ce_chunk_tokens": 4096, "gradient_checkpointing": true}\'; default none)')
    ap.add_argument("--doc-tokens", type=int, default=DOC_TOKENS, help="tokens per document packed into the row")
    ap.add_argument("--options", default=None, help="the families' options as JSON (default: OPTIONS; {} = the "
                                                     "families' own defaults, as hsx train-drafter uses them)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--family", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.batch_tokens = int(args.batch_tokens)
        if args.device == "cpu":
            cap = int(args.memory_cap_gb * (1 << 30))
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        print(json.dumps(child(args)))
        return 0
    from drafters.registry import trainable_families

    names = args.families.split(",") if args.families else trainable_families()
    rows = [measure(f, s, int(b), args) for s in args.shapes.split(",") for b in args.batch_tokens.split(",")
            for f in names]
    for r in rows:
        print(json.dumps(r), file=sys.stderr)
    table = markdown(rows, args)
    if args.out:
        from benchmarks.common import write_results

        os.makedirs(args.out, exist_ok=True)
        write_results(args.out, "training_cost", {"rows": rows}, table)
    else:
        print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
