"""What the benchmarks share: the locally built random model (Llama-3 shapes), a text corpus cut to log-uniform
lengths, the engine set up for prompt-only extraction and the approaches run on it, timing, peak memory from /proc,
machine facts and the results files. Imported as `benchmarks.common` (each benchmark puts the repository root on
sys.path first); never run on its own.

    SHAPES, model_config(args), build_model(args)       args: shape, dtype, vocab_size, model_dir, device, seed
    make_corpus(tokenizer, n, min_len, max_len, seed)
    make_llm(args, layer_ids, out_dir), plan(llm, corpus), run_bare(llm, batches), run_hsx(llm, corpus, out_dir),
    hooks_off(llm), speculative_config(layer_ids)
    timed(fn, device), sync(device), machine_info(device), cpu_model()
    reset_peak_rss(), status_kb(key, pid), rss(), peak_rss()
    write_results(out, stem, results, markdown), lossless_status(lossy)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import shutil
import sys
import time

import torch

from connectors import KVTransferConfig
from extractor import LLM, SamplingParams

SHAPES = {
    # Llama-3-8B scaled down 8x in width and 4x in depth; GQA 4:1, MLP 3.5x; vocabulary scaled so the lm_head is
    # the same share of the FLOPs as in the 8B (~7.5%).
    "small": dict(hidden_size=512, intermediate_size=1792, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096, rope_theta=500000.0),
    # one long sample's states against a cheap attention (bench_long_sample.py): 8 KiB of float32 states a token over
    # all 4 layers, 2 heads of 32 and one KV head, positions up to 64k
    "long": dict(hidden_size=512, intermediate_size=512, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, vocab_size=512, max_position_embeddings=65536,
                 rope_theta=500000.0),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
}


def model_config(args: argparse.Namespace):
    from transformers import LlamaConfig

    from reference.tiny_models import build_tokenizer

    shape = dict(SHAPES[args.shape])
    if args.vocab_size:
        shape["vocab_size"] = args.vocab_size
    tok = build_tokenizer(args.model_dir)  # saved next to the model
    config = LlamaConfig(**shape, rms_norm_eps=1e-5, initializer_range=0.02, tie_word_embeddings=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    return config, tok


def build_model(args: argparse.Namespace) -> None:
    """Build the random model once per (shape, dtype, vocab) in --model-dir; reuse it on later runs."""
    from transformers import AutoModelForCausalLM

    marker = os.path.join(args.model_dir, "bench-shape.json")
    want = {"shape": args.shape, "dtype": args.dtype, "vocab_size": args.vocab_size}
    if os.path.exists(marker) and json.load(open(marker)) == want:
        return
    shutil.rmtree(args.model_dir, ignore_errors=True)
    config, _ = model_config(args)
    init_device = args.device if args.device.startswith("cuda") else "cpu"  # 8B random init is minutes on CPU
    torch.manual_seed(args.seed)
    with torch.device(init_device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.save_pretrained(args.model_dir)
    del model
    if init_device != "cpu":
        torch.cuda.empty_cache()
    with open(marker, "w") as f:
        json.dump(want, f)


def make_corpus(tokenizer, n: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """n samples of real-ish text; lengths log-uniform in [min_len, max_len], cut from one token stream."""
    from reference.tiny_models import sample_text

    rng = random.Random(seed)
    lengths = [int(round(math.exp(rng.uniform(math.log(min_len), math.log(max_len))))) for _ in range(n)]
    stream: list[int] = []
    batch = 0
    while len(stream) < max_len * 4:
        stream.extend(tokenizer(" ".join(sample_text(200, seed=seed * 1000 + batch))).input_ids)
        batch += 1
    out = []
    for length in lengths:
        start = rng.randrange(0, len(stream) - length)
        out.append(stream[start:start + length])
    return out


def machine_info(device: torch.device) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "cpu_affinity": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "cpu_model": cpu_model()}
    import transformers

    info["transformers"] = transformers.__version__
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def speculative_config(layer_ids) -> dict:
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}


def make_llm(args: argparse.Namespace, layer_ids, out_dir: str) -> LLM:
    extra = {"shared_storage_path": out_dir, "storage_dtype": getattr(args, "storage_dtype", "") or ""}
    return LLM(model=args.model_dir, speculative_config=speculative_config(layer_ids),
               kv_transfer_config=KVTransferConfig(kv_connector_extra_config=extra),
               dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens, device=args.device,
               attn_implementation=args.attn, packing=getattr(args, "packing", "auto"))


def plan(llm: LLM, corpus: list[list[int]]):
    """The batches hsx runs for this corpus (its own scheduler's plan: packed where its runner packs, else padded
    with its device's forward cost)."""
    return llm._scheduler.plan_prompt_only(corpus, len)


def run_bare(llm: LLM, batches) -> None:
    """(a) The decoder stack over hsx's batches and inputs (padded, or packed: attention per prompt); nothing
    captured, kept or written."""
    runner = llm.runner
    with hooks_off(llm), torch.inference_mode():
        for batch in batches:
            if batch.packed:
                ids, positions, starts = runner.packer.inputs(batch.items, runner.device)
                with runner.packer.active(starts, [len(r) for r in batch.items]):
                    runner.base(input_ids=ids, position_ids=positions, attention_mask=None, use_cache=False)
                continue
            ids, mask, positions, _ = runner.pad(batch.items, left=False)
            width = ids.shape[1]
            cache = runner._new_cache() if batch.chunk_size < width else None
            for c0 in range(0, width, batch.chunk_size):
                c1 = min(width, c0 + batch.chunk_size)
                inputs = {"input_ids": ids[:, c0:c1], "position_ids": positions[:, c0:c1],
                          "attention_mask": None if mask is None else mask[:, :c1], "use_cache": cache is not None}
                if cache is not None:
                    inputs[runner._cache_kw] = cache
                runner.base(**inputs)


@contextlib.contextmanager
def hooks_off(llm: LLM):
    """hsx's capture hooks stay registered on the shared model; make them inert for (a), (c) and checks."""
    llm.runner.capture.enabled = False
    try:
        yield
    finally:
        llm.runner.capture.enabled = True


def run_hsx(llm: LLM, corpus: list[list[int]], out_dir: str) -> list:
    """(b)/(e) Prompt-only extraction; returns once every file is durable."""
    outs = llm.generate([{"prompt_token_ids": s} for s in corpus], SamplingParams(max_tokens=0))
    bad = [o.error for o in outs if o.error]
    if bad:
        raise RuntimeError(f"{len(bad)} hsx requests failed, first: {bad[0]}")
    return outs


def timed(fn, device: torch.device) -> tuple[float, float]:
    """(wall seconds, process CPU seconds over all threads)."""
    sync(device)
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    sync(device)
    return time.perf_counter() - w0, time.process_time() - c0


def best_of(fn, repeats: int) -> float:
    """The shortest of `repeats` timed calls of fn(), in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def status_kb(key: str, pid: int | str = "self") -> int:
    """A /proc/PID/status memory field (reported in kB), in bytes."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def rss() -> int:
    try:
        return status_kb("VmRSS")
    except (OSError, KeyError):
        import psutil

        return psutil.Process().memory_info().rss


def peak_rss() -> int:
    return status_kb("VmHWM")


def lossless_status(lossy: list[str]) -> int:
    """A decoding benchmark's exit status: 0, or 1 with "NOT LOSSLESS: [...]" on stderr naming the `lossy` results."""
    if lossy:
        print(f"NOT LOSSLESS: {lossy}", file=sys.stderr)
        return 1
    return 0


def write_results(out: str, stem: str, results: dict, md: str) -> None:
    """OUT/STEM.json and OUT/STEM.md, and the markdown on stdout."""
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(md)
    print(md)
