"""Extraction benchmark: hsx against the bare forward pass and against today's per-sample scripts, in one run.

    python benchmarks/bench_extraction.py --out bench-out                   # CPU: small shape, a few minutes
    python benchmarks/bench_extraction.py --out bench-out --device cuda     # GPU: Llama-3-8B shape, bf16, SDPA

Same model (randomly initialised from a LlamaConfig, built locally, no downloads), dtype and corpus for every row.
The corpus is real-ish text (`tiny_models.sample_text` through the local BPE tokenizer, one token stream) cut into
samples with log-uniform lengths in [--min-len, --max-len]; the model's vocabulary is larger than the tokenizer's,
which changes nothing for speed.

    (a) bare forward   the decoder stack over the very batches hsx plans (same padding, same inputs), nothing kept or
                       written: the limit
    (b) hsx            `LLM.generate(..., SamplingParams(max_tokens=0))`, prompt-only extraction of 4 layers with the
                       safetensors connector writing to local disk; timed until every file is durable
    (c) per-sample     what extraction scripts do today: one sample at a time, `model(ids, output_hidden_states=True)`,
                       pick the layers, `safetensors.torch.save_file` one file per sample
    (e) early exit     hsx again with every requested layer <= N/2, against (a)
    (p) padded         hsx with packing off: the same prompts padded to each batch's longest (length-grouped
                       batches), against (b), which packs them end to end where the target allows (extractor.packing)
    (q) bare, padded   (a) over (p)'s padded batches: what packing saves the forward itself
    memory             peak RSS of hsx over the corpus and over the same corpus 10x (ten `generate` calls, as a job
                       feeds it), each in fresh subprocesses, peak reset after a warm-up pass, glibc's mmap threshold
                       pinned (see --malloc-mmap-threshold)
    storage            bytes on disk per token against T * L * H * dtype size
    MFU                model FLOPs (2 * params * tokens + causal attention, real tokens only) / time / peak: the
                       device's dense bf16 peak on CUDA (H100/H200: 989 TFLOP/s; --peak-tflops to override), a
                       measured matmul peak on CPU

Warm-up before timing; approaches interleaved (order rotated each repeat) so drift and neighbours' load hit all of
them alike; medians reported, ratios are medians of per-repeat ratios. Never pass/fail: targets are printed beside
the figures. Writes results.json and results.md to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    SHAPES,
    build_model,
    hooks_off,
    machine_info,
    make_corpus,
    make_llm,
    peak_rss,
    plan,
    reset_peak_rss,
    rss,
    run_bare,
    run_hsx,
    sync,
    timed,
    write_results,
)
from extractor import LLM  # noqa: E402
from extractor.layers import default_layer_ids  # noqa: E402

# Dense bf16 peaks (no sparsity), by substring of torch.cuda.get_device_name().
CUDA_PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
                         "L4": 121.0, "A10": 125.0}
TARGETS = {"b_over_a": 0.95, "b_over_c": 1.4, "early_exit_speedup": 1.8, "memory_growth": 0.05, "mfu_gpu": 0.45}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for results.json, results.md, the model and scratch files")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (CUDA when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="model and stored dtype; auto = bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--shape", default="auto", choices=["auto", *SHAPES],
                   help="model shape; auto = llama3-8b on CUDA, small on CPU")
    p.add_argument("--vocab-size", type=int, default=None, help="override the shape's vocabulary size")
    p.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, flash_attention_2)")
    p.add_argument("--num-samples", type=int, default=None,
                   help="corpus size in samples (default: 32 for small, 256 for llama3-8b)")
    p.add_argument("--min-len", type=int, default=32, help="shortest sample in tokens")
    p.add_argument("--max-len", type=int, default=2048, help="longest sample in tokens (lengths are log-uniform)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", default=None,
                   help="layer ids for (b), comma-separated (default: EAGLE-3's [2, N/2, N-3, N])")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the engine's token budget per forward")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per approach; medians are reported")
    p.add_argument("--storage-dtype", default="", help="how hsx's files store the states (the connector's "
                   "storage_dtype: model, bfloat16, fp8, ...); e.g. fp8 halves the bytes a host-bound run writes")
    p.add_argument("--slices", type=int, default=None,
                   help="interleave approaches on this many slices of the corpus per pass (default: 4 on CPU, "
                        "1 on CUDA); each slice is one generate call")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--packing", default="auto", choices=["auto", "on", "off"],
                   help="the engine's packing for (a), (b), (e) [(p) and (q) always pad]")
    p.add_argument("--sections", default="extraction,early_exit,packing,memory,storage",
                   help="comma-separated subset of extraction,early_exit,packing,memory,storage (packing loads a "
                        "second engine, padded, for (p) and (q))")
    p.add_argument("--memory-samples", type=int, default=None,
                   help="corpus size of the memory runs (default: 16 for small, 64 for llama3-8b)")
    p.add_argument("--memory-scale", type=int, default=10, help="the larger memory run is this many times the corpus")
    p.add_argument("--memory-repeats", type=int, default=None,
                   help="fresh subprocesses per memory size, median peak reported (default: 2, 1 for llama3-8b)")
    p.add_argument("--malloc-mmap-threshold", type=int, default=1 << 20,
                   help="MALLOC_MMAP_THRESHOLD_ (bytes) for the memory subprocesses; 0 = glibc's dynamic default. "
                        "Pinned, a freed tensor goes back to the OS, so peak RSS tracks live memory; dynamic, "
                        "identical runs differ by up to ~10%% from heap fragmentation alone")
    p.add_argument("--profile", action="store_true",
                   help="after timing, run each approach once more on one slice under torch.profiler: op tables go "
                        "to OUT/profile-<approach>.txt, time shares (matmul, attention, other) to results")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: see above)")
    p.add_argument("--model-dir", default=None, help="where the random model is built or reused (default: OUT/model-SHAPE-DTYPE)")
    p.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- setup ------------------------------------------------------------------------------------------------------------
def resolve(args: argparse.Namespace) -> argparse.Namespace:
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device} but CUDA is not available here; use --device cpu")
    on_cuda = args.device.startswith("cuda")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if on_cuda else "float32"
    if args.shape == "auto":
        args.shape = "llama3-8b" if on_cuda else "small"
    big = args.shape == "llama3-8b"
    if args.num_samples is None:
        args.num_samples = 256 if big else 32
    if args.memory_samples is None:
        args.memory_samples = 64 if big else 16
    if args.memory_repeats is None:
        args.memory_repeats = 1 if big else 2
    if args.slices is None:
        args.slices = 1 if on_cuda else 4
    if args.threads:
        torch.set_num_threads(args.threads)
    args.model_dir = args.model_dir or os.path.join(args.out, f"model-{args.shape}-{args.dtype}")
    return args


def peak_flops(args: argparse.Namespace, device: torch.device) -> tuple[float | None, str]:
    """(peak FLOP/s, where it came from)."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in CUDA_PEAK_BF16_TFLOPS.items():
            if key in name and args.dtype in ("bfloat16", "float16"):
                return tflops * 1e12, f"{name} dense {args.dtype} spec"
        return None, f"unknown peak for {name} in {args.dtype} (pass --peak-tflops)"
    dtype = getattr(torch, args.dtype)
    n = 2048
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best = math.inf
    for _ in range(10):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best, f"measured {n}x{n} {args.dtype} matmul, {torch.get_num_threads()} threads"


def model_flops(config, corpus: list[list[int]], depth: int, lm_head: bool) -> float:
    """FLOPs of a forward of every sample alone through `depth` decoder layers: 2 * params * tokens for the matmuls,
    2 * T^2 * d_attn per layer for causal attention (QK^T and AV, half the square), plus the lm_head if computed."""
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    d_q, d_kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer_params = h * d_q + 2 * h * d_kv + d_q * h + 3 * h * inter
    tokens = sum(len(s) for s in corpus)
    flops = 2 * layer_params * depth * tokens + sum(2 * len(s) ** 2 * d_q for s in corpus) * depth
    if lm_head:
        flops += 2 * h * config.vocab_size * tokens
    return float(flops)


# -- the approaches ---------------------------------------------------------------------------------------------------
def run_per_sample(llm: LLM, corpus: list[list[int]], layer_ids, out_dir: str) -> None:
    """(c) Today's scripts: one sample per forward, every hidden state returned, pick, save one file each."""
    import safetensors.torch

    runner = llm.runner
    model, device = runner.model, runner.device
    os.makedirs(out_dir, exist_ok=True)
    with hooks_off(llm), torch.no_grad():
        for i, sample in enumerate(corpus):
            ids = torch.tensor([sample], dtype=torch.long, device=device)
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states  # N + 1 x [1, T, H]
            states = torch.stack([hidden[k][0] for k in layer_ids], dim=1).cpu()  # [T, L, H]
            safetensors.torch.save_file({"hidden_states": states.contiguous(),
                                         "token_ids": torch.tensor(sample, dtype=torch.long)},
                                        os.path.join(out_dir, f"sample_{i}.safetensors"))


def files_size(root: str) -> tuple[int, int]:
    total, n = 0, 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith(".safetensors"):
                total += os.path.getsize(os.path.join(dirpath, name))
                n += 1
    return total, n


# -- sections ---------------------------------------------------------------------------------------------------------
def bench_speed(args, llm: LLM, llm_early: LLM | None, corpus, layer_ids, early_ids, device, scratch,
                checkpoint=lambda res: None, llm_padded: LLM | None = None) -> dict:
    tokens = sum(len(s) for s in corpus)
    wanted = {"a"}
    if "extraction" in args.sections:
        wanted |= {"b", "c"}
    if "storage" in args.sections:
        wanted.add("b")
    if llm_early is not None:
        wanted.add("e")
    if llm_padded is not None:
        wanted |= {"b", "p", "q"}
    order = [k for k in ("a", "b", "c", "e", "p", "q") if k in wanted]

    def approaches(part: list[list[int]]) -> dict:
        batches = plan(llm, part)
        padded = plan(llm_padded, part) if llm_padded is not None else None
        return {"a": lambda: run_bare(llm, batches),
                "b": lambda: run_hsx(llm, part, os.path.join(scratch, "b")),
                "c": lambda: run_per_sample(llm, part, layer_ids, os.path.join(scratch, "c")),
                "e": lambda: run_hsx(llm_early, part, os.path.join(scratch, "e")),
                "p": lambda: run_hsx(llm_padded, part, os.path.join(scratch, "p")),
                "q": lambda: run_bare(llm_padded, padded)}

    warm = approaches(sorted(corpus, key=len)[::4] or corpus)  # a quarter of the corpus, spread over all lengths
    for name in order:
        warm[name]()
        sync(device)
        clear(scratch)

    # Interleave at the level of slices of the corpus, not whole passes: neighbours' load on a shared machine comes
    # and goes over seconds, so approaches timed back to back on the same slice see the same conditions.
    k = max(1, min(args.slices, len(corpus)))
    parts = [corpus[i::k] for i in range(k)]  # every slice spans all lengths
    timed_parts = [approaches(part) for part in parts]
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in order}
    stored = {"bytes": 0, "files": 0}
    diff = None
    step = 0
    for rep in range(args.repeats):
        totals = {name: [0.0, 0.0] for name in order}
        for timed_part in timed_parts:
            for name in order[step % len(order):] + order[:step % len(order)]:  # rotate who goes first
                wall, cpu = timed(timed_part[name], device)
                totals[name][0] += wall
                totals[name][1] += cpu
                if name == "b" and rep == 0:
                    size, files = files_size(os.path.join(scratch, "b"))
                    stored["bytes"] += size
                    stored["files"] += files
                    if diff is None:
                        diff = verify(llm, layer_ids, scratch)
                clear(scratch)
            step += 1
        for name in order:
            runs[name].append(tuple(totals[name]))
    storage = storage_figures(stored, tokens, len(layer_ids), llm, diff) if "b" in order else None

    config = llm.runner.hf_config
    n = config.num_hidden_layers
    flops = {"a": model_flops(config, corpus, n, False), "b": model_flops(config, corpus, max(layer_ids), False),
             "c": model_flops(config, corpus, n, True), "e": model_flops(config, corpus, max(early_ids), False)}
    flops["p"], flops["q"] = flops["b"], flops["a"]
    peak, peak_src = peak_flops(args, device)
    batches = [b for part in parts for b in plan(llm, part)]
    res = {"tokens": tokens, "samples": len(corpus), "forwards": len(batches),
           "padding_overhead": sum(b.padded_tokens(len) for b in batches) / tokens,
           "packed": llm.runner.packer is not None, "packing_refusal": llm.runner.packing_refusal,
           "peak_flops": peak, "peak_source": peak_src, "approaches": {}, "ratios": {}, "storage": storage}
    if llm_padded is not None:
        padded = [b for part in parts for b in plan(llm_padded, part)]
        res["padded_forwards"] = len(padded)
        res["padding_overhead_padded"] = sum(b.padded_tokens(len) for b in padded) / tokens
    for name, rs in runs.items():
        walls, cpus = [r[0] for r in rs], [r[1] for r in rs]
        med = statistics.median(walls)
        res["approaches"][name] = {
            "wall_s": walls, "cpu_s": cpus, "median_wall_s": med, "median_cpu_s": statistics.median(cpus),
            "tokens_per_s": tokens / med, "model_tflops": flops[name] / 1e12,
            "mfu": (flops[name] / med / peak) if peak else None}

    def speedup(fast: str, slow: str) -> float:  # median over repeats of (slow's time / fast's time)
        return statistics.median(runs[slow][i][0] / runs[fast][i][0] for i in range(args.repeats))

    if "b" in runs:
        res["ratios"]["b_over_a"] = speedup("b", "a")
    if "b" in runs and "c" in runs:
        res["ratios"]["b_over_c"] = speedup("b", "c")
    if "e" in runs:
        res["ratios"]["early_exit_speedup"] = speedup("e", "a")
    if "a" in runs and "c" in runs:
        res["ratios"]["a_over_c"] = speedup("a", "c")
    if "p" in runs:
        res["ratios"]["packing_speedup"] = speedup("b", "p")
        res["ratios"]["bare_packing_speedup"] = speedup("a", "q")
    if "b" in runs and "c" in runs and peak:
        # What b/c would be if hsx ran its FLOPs at 100% of the peak while (c) kept its measured time: no engine on
        # this machine can beat (c) by more.
        res["ratios"]["b_over_c_ceiling"] = res["approaches"]["c"]["median_wall_s"] * peak / flops["b"]
    if args.profile:
        checkpoint(res)  # the timings are kept even if profiling runs past a GPU lease's time limit
        res["profile"] = {name: profile_once(timed_parts[0][name], device, os.path.join(args.out, f"profile-{name}.txt"))
                          for name in order}
        clear(scratch)
    return res


# Self-time classes for --profile: the ops' names as aten/kernels report them.
_OP_CLASSES = (("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_weight_int", "gemm",
                           "cutlass", "xmma", "nvjet", "cublas")),
               ("attention", ("scaled_dot_product", "flash", "attention", "fmha", "sdpa")),
               ("copies", ("aten::copy_", "aten::cat", "aten::stack", "aten::index", "memcpy", "Memcpy",
                           "aten::contiguous", "aten::clone")))


def profile_once(fn, device: torch.device, table_path: str) -> dict:
    """One run of `fn` under torch.profiler: the op table to `table_path`, self-time shares by op class."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    events = prof.key_averages()
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    with open(table_path, "w") as f:
        f.write(events.table(sort_by=attr, row_limit=40))
    # On CUDA, only device events carry device time; on CPU, every op's self time adds up to the process's busy time.
    times = [(e.key, getattr(e, attr)) for e in events if getattr(e, attr) > 0]
    total = sum(t for _, t in times) or 1.0
    shares = {name: 0.0 for name, _ in _OP_CLASSES}
    shares["other"] = 0.0
    for key, t in times:
        cls = next((name for name, pats in _OP_CLASSES if any(p in key for p in pats)), "other")
        shares[cls] += t / total
    top = sorted(times, key=lambda kt: -kt[1])[:5]
    return {"shares": shares, "top": [{"op": k, "share": t / total} for k, t in top], "table": table_path,
            "time_kind": attr}


def clear(scratch: str) -> None:
    for sub in ("b", "c", "e"):
        shutil.rmtree(os.path.join(scratch, sub), ignore_errors=True)


def storage_figures(stored: dict, tokens: int, num_layers: int, llm: LLM, diff: float | None) -> dict:
    itemsize = torch.empty(0, dtype=llm.runner.dtype).element_size()
    ideal = tokens * num_layers * llm.runner.hidden_size * itemsize
    return {"files": stored["files"], "bytes": stored["bytes"], "bytes_per_token": stored["bytes"] / tokens,
            "ideal_bytes_per_token": ideal / tokens, "overhead": stored["bytes"] / ideal - 1,
            "max_abs_diff_vs_plain_forward": diff,
            "note": "ideal = L * H * dtype size; extra = token_ids (8 B/token) + header with metadata per file"}


def verify(llm: LLM, layer_ids, scratch: str) -> float | None:
    """Max |hsx - plain forward| over three samples, for layer ids < N (HF's hidden_states[N] is post-norm)."""
    from connectors import load_hidden_states

    n = llm.runner.num_hidden_layers
    cols = [i for i, k in enumerate(layer_ids) if k < n]
    if not cols:
        return None
    files = sorted(Path(scratch, "b").rglob("*.safetensors"), key=lambda p: p.stat().st_mtime)
    worst = 0.0
    with hooks_off(llm), torch.no_grad():
        for path in files[:3]:
            obj = load_hidden_states(str(path))
            ids = obj["token_ids"].tolist()
            hidden = llm.runner.model(input_ids=torch.tensor([ids], device=llm.runner.device),
                                      output_hidden_states=True).hidden_states
            ref = torch.stack([hidden[layer_ids[c]][0] for c in cols], dim=1).float().cpu()
            worst = max(worst, (obj["hidden_states"][:, cols].float() - ref).abs().max().item())
    return worst


def bench_memory(args) -> dict:
    """Each size in fresh subprocesses so neither run's allocations pollute the other; medians over repeats."""
    res: dict = {}
    for scale in (1, args.memory_scale):
        runs = []
        for _ in range(args.memory_repeats):
            job = {"model_dir": args.model_dir, "device": args.device, "dtype": args.dtype, "attn": args.attn,
                   "samples": args.memory_samples, "scale": scale, "seed": args.seed, "min_len": args.min_len,
                   "max_len": args.max_len, "budget": args.max_num_batched_tokens, "threads": args.threads,
                   "layers": args.layers_resolved, "scratch": os.path.join(args.out, f"scratch-memory-{scale}")}
            env = dict(os.environ)
            if args.malloc_mmap_threshold:
                env.setdefault("MALLOC_MMAP_THRESHOLD_", str(args.malloc_mmap_threshold))
            proc = subprocess.run([sys.executable, __file__, "--out", args.out, "--memory-worker", json.dumps(job)],
                                  capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                raise RuntimeError(f"memory worker (scale {scale}) failed:\n{proc.stderr[-4000:]}")
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            runs[-1]["malloc_mmap_threshold"] = env.get("MALLOC_MMAP_THRESHOLD_", "glibc default (dynamic)")
        res[f"x{scale}"] = {"runs": runs, "peak_rss_bytes": statistics.median(r["peak_rss_bytes"] for r in runs),
                            "samples": runs[0]["samples"], "tokens": runs[0]["tokens"],
                            "retained_bytes": statistics.median(r["rss_after_bytes"] - r["rss_before_bytes"]
                                                                for r in runs),
                            "wall_s": statistics.median(r["wall_s"] for r in runs)}
    small, large = res["x1"]["peak_rss_bytes"], res[f"x{args.memory_scale}"]["peak_rss_bytes"]
    res["growth"] = large / small - 1
    res["peak_source"] = res["x1"]["runs"][0]["peak_source"]
    return res


def memory_worker(job: dict) -> None:
    """Warm up, reset the peak, run the corpus `scale` times (one generate call per pass, as a job feeds batches);
    print peak RSS overall and per pass as JSON."""
    if job["threads"]:
        torch.set_num_threads(job["threads"])
    args = argparse.Namespace(model_dir=job["model_dir"], dtype=job["dtype"], max_num_batched_tokens=job["budget"],
                              device=job["device"], attn=job["attn"])
    llm = make_llm(args, job["layers"], job["scratch"])
    corpus = make_corpus(llm.tokenizer, job["samples"], job["min_len"], job["max_len"], job["seed"])
    device = llm.runner.device
    run_hsx(llm, corpus, job["scratch"])  # warm-up: allocator pools, lazy inits, writer threads
    shutil.rmtree(job["scratch"], ignore_errors=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = rss()
    per_pass = []
    wall = time.perf_counter()
    for _ in range(job["scale"]):
        reset = reset_peak_rss()
        run_hsx(llm, corpus, job["scratch"])
        shutil.rmtree(job["scratch"], ignore_errors=True)
        per_pass.append(peak_rss() if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    wall = time.perf_counter() - wall
    out = {"samples": job["samples"] * job["scale"], "tokens": sum(map(len, corpus)) * job["scale"],
           "rss_before_bytes": rss_before, "rss_after_bytes": rss(), "wall_s": wall,
           "peak_rss_bytes": max(per_pass), "per_passpeak_rss_bytes": per_pass,
           "peak_source": "VmHWM, reset after warm-up (clear_refs 5)" if reset else
                          "ru_maxrss (lifetime, incl. model load)",
           "writer_peak_bytes_in_flight": getattr(llm.connector, "peak_bytes_in_flight", None)}
    if device.type == "cuda":
        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    llm.shutdown()
    print(json.dumps(out))


# -- report -----------------------------------------------------------------------------------------------------------
def markdown(r: dict) -> str:
    m = r["machine"]
    lines = [f"## hsx extraction benchmark — {r['config']['shape']}, {r['config']['dtype']}, {r['config']['device']}"
             f", files in {r['config'].get('storage_dtype', 'model')} dtype",
             "",
             f"Machine: {m.get('gpu') or m['cpu_model']}; {m['cpu_affinity']} CPU cores usable, torch threads "
             f"{m['torch_threads']}; torch {m['torch']}, transformers {m['transformers']}; load average "
             f"{r['load_before']} before, {r['load_after']} after.", ""]
    s = r.get("speed")
    if s:
        c = r["config"]
        layout = ("packed" if s.get("packed") else f"padded ({s.get('packing_refusal')})") + (
            f"; padded instead: {s['padded_forwards']} forwards, padding overhead {s['padding_overhead_padded']:.1%}"
            if "padded_forwards" in s else "")
        lines += [f"Corpus: {s['samples']} samples, {s['tokens']} tokens, lengths log-uniform "
                  f"{c['min_len']}-{c['max_len']}; layers {c['layers']} of N={c['num_hidden_layers']}; hsx ran "
                  f"{s['forwards']} forwards, padding overhead {s['padding_overhead']:.1%} ({layout}). Peak for MFU: "
                  f"{_fmt_flops(s['peak_flops'])} ({s['peak_source']}). {c['repeats']} repeats, medians; approaches "
                  f"interleaved on {c['slices']} slice(s) of the corpus per repeat.", "",
                  "| approach | tokens/s | wall s (median) | CPU s (median) | model TFLOP | MFU |",
                  "|---|---:|---:|---:|---:|---:|"]
        names = {"a": "(a) bare forward, same batches (limit)", "b": "(b) hsx, 4 layers, writes on",
                 "c": "(c) per-sample output_hidden_states + save_file",
                 "e": f"(e) hsx early exit, layers {c['early_exit_layers']}",
                 "p": "(p) hsx, packing off (padded batches)", "q": "(q) bare forward, padded batches"}
        for key, row in s["approaches"].items():
            mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
            lines.append(f"| {names[key]} | {row['tokens_per_s']:,.0f} | {row['median_wall_s']:.2f} | "
                         f"{row['median_cpu_s']:.2f} | {row['model_tflops']:.3f} | {mfu} |")
        lines += ["", "| ratio | value | target | meets |", "|---|---:|---:|---|"]
        labels = {"b_over_a": "b/a (hsx vs the limit)", "b_over_c": "b/c (hsx vs per-sample)",
                  "early_exit_speedup": "e/a (early exit vs full forward)",
                  "a_over_c": "a/c (the limit vs per-sample)",
                  "packing_speedup": "b/p (hsx packed vs padded)",
                  "bare_packing_speedup": "a/q (bare forward packed vs padded)",
                  "b_over_c_ceiling": "b/c ceiling: hsx at 100% of the peak vs (c) as measured"}
        for key, val in s["ratios"].items():
            if key in TARGETS:
                lines.append(f"| {labels[key]} | {val:.3f} | >= {TARGETS[key]} | "
                             f"{'yes' if val >= TARGETS[key] else 'no'} |")
            else:
                lines.append(f"| {labels[key]} | {val:.3f} | | |")
        if r["config"]["device"].startswith("cuda") and "b" in s["approaches"] and s["approaches"]["b"]["mfu"]:
            mfu = s["approaches"]["b"]["mfu"]
            lines.append(f"| MFU of (b) | {mfu:.1%} | >= {TARGETS['mfu_gpu']:.0%} | "
                         f"{'yes' if mfu >= TARGETS['mfu_gpu'] else 'no'} |")
        prof = s.get("profile")
        if prof:
            kind = next(iter(prof.values()))["time_kind"].replace("_", " ")
            lines += ["", f"Profile (one slice per approach, torch.profiler, share of {kind}):", "",
                      "| approach | matmul | attention | copies | other | top op |", "|---|---:|---:|---:|---:|---|"]
            for key, row in prof.items():
                sh, top = row["shares"], row["top"][0] if row["top"] else {"op": "-", "share": 0.0}
                lines.append(f"| {names[key]} | {sh['matmul']:.1%} | {sh['attention']:.1%} | {sh['copies']:.1%} | "
                             f"{sh['other']:.1%} | {top['op'][:60]} ({top['share']:.1%}) |")
        st = s.get("storage")
        if st:
            diff = st.get("max_abs_diff_vs_plain_forward")
            lines += ["", f"Storage: {st['bytes_per_token']:,.1f} bytes/token on disk vs {st['ideal_bytes_per_token']:,.0f} "
                      f"(T*L*H*dtype), overhead {st['overhead']:.2%} over {st['files']} files ({st['note']}). "
                      f"hsx states vs a plain forward (ids < N): max |diff| = {diff if diff is None else f'{diff:.2e}'}."]
    mem = r.get("memory")
    if mem:
        k = r["config"]["memory_scale"]
        lines += ["", "| memory run | samples | tokens | peak RSS (median) | per-pass peaks | retained after run | wall s |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for key in ("x1", f"x{k}"):
            row = mem[key]
            passes = [p for run in row["runs"] for p in run["per_passpeak_rss_bytes"]]
            lines.append(f"| {key} | {row['samples']} | {row['tokens']} | {_mib(row['peak_rss_bytes'])} | "
                         f"{_mib(min(passes))} - {_mib(max(passes))} | {_mib(row['retained_bytes'])} | "
                         f"{row['wall_s']:.1f} |")
        ok = mem["growth"] <= TARGETS["memory_growth"]
        lines.append(f"\nPeak RSS growth x1 -> x{k}: {mem['growth']:+.2%} (target <= {TARGETS['memory_growth']:.0%}: "
                     f"{'yes' if ok else 'no'}); {mem['peak_source']}; {r['config']['memory_repeats']} fresh "
                     f"subprocess(es) per size; MALLOC_MMAP_THRESHOLD_ = {mem['x1']['runs'][0]['malloc_mmap_threshold']}.")
    return "\n".join(lines) + "\n"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _fmt_flops(f: float | None) -> str:
    return "n/a" if not f else f"{f / 1e12:.2f} TFLOP/s" if f >= 1e12 else f"{f / 1e9:.1f} GFLOP/s"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.memory_worker:
        memory_worker(json.loads(args.memory_worker))
        return
    args = resolve(args)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    load_before = [round(x, 2) for x in os.getloadavg()]
    build_model(args)
    scratch = os.path.join(args.out, "scratch")
    clear(scratch)
    config = json.load(open(os.path.join(args.model_dir, "config.json")))
    n = config["num_hidden_layers"]
    layer_ids = [int(x) for x in args.layers.split(",")] if args.layers else list(default_layer_ids(n))
    early_ids = sorted({max(1, n * k // 8) for k in (1, 2, 3, 4)})  # four ids, all <= N/2
    args.layers_resolved = layer_ids
    llm = make_llm(args, layer_ids, os.path.join(scratch, "b"))
    corpus = make_corpus(llm.tokenizer, args.num_samples, args.min_len, args.max_len, args.seed)
    results = {"config": {"shape": args.shape, "dtype": args.dtype, "storage_dtype": args.storage_dtype or "model",
                          "device": args.device, "attn": args.attn, "packing": args.packing,
                          "num_hidden_layers": n, "hidden_size": config["hidden_size"],
                          "vocab_size": config["vocab_size"], "layers": layer_ids, "early_exit_layers": early_ids,
                          "min_len": args.min_len, "max_len": args.max_len, "repeats": args.repeats,
                          "max_num_batched_tokens": args.max_num_batched_tokens, "memory_scale": args.memory_scale,
                          "memory_repeats": args.memory_repeats, "slices": args.slices,
                          "corpus": "sample_text through the local BPE tokenizer, log-uniform lengths"},
               "machine": machine_info(device)}
    if {"extraction", "early_exit", "packing", "storage"} & set(args.sections):
        llm_early = make_llm(args, early_ids, os.path.join(scratch, "e")) if "early_exit" in args.sections else None
        llm_padded = (make_llm(argparse.Namespace(**{**vars(args), "packing": "off"}), layer_ids,
                               os.path.join(scratch, "p")) if "packing" in args.sections else None)
        def checkpoint(speed: dict) -> None:
            now = {**results, "speed": speed, "load_before": load_before,
                   "load_after": [round(x, 2) for x in os.getloadavg()]}
            write_results(args.out, "results", now, markdown(now))

        results["speed"] = bench_speed(args, llm, llm_early, corpus, layer_ids, early_ids, device, scratch, checkpoint,
                                       llm_padded)
        for other in (llm_early, llm_padded):
            if other is not None:
                other.shutdown()
        del llm_early, llm_padded
    llm.shutdown()
    del llm
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if "memory" in args.sections:
        results["memory"] = bench_memory(args)
    results["load_before"] = load_before
    results["load_after"] = [round(x, 2) for x in os.getloadavg()]
    shutil.rmtree(scratch, ignore_errors=True)
    write_results(args.out, "results", results, markdown(results))


if __name__ == "__main__":
    main()
