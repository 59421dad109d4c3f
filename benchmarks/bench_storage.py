"""Storage-dtype benchmark (issue 25): bytes per token and reconstruction error of each storage dtype, side by side on
one corpus through the real engine and connector.

    python benchmarks/bench_storage.py --out bench-out                      # CPU: small shape, float32 model
    python benchmarks/bench_storage.py --out bench-out --device cuda        # GPU: Llama-3-8B shape, bf16 model

For each storage dtype (the model's, bfloat16, fp8 = float8_e4m3fn + a float32 scale per token and layer), and for
fp8 with a top-k 64 target in place of the last layer (`--target top_k:64`), the same prompts are extracted
(prompt-only, EAGLE-3's default layers) into their own folder; then:
    bytes per token      the files' total bytes / tokens, and the ratio to the bfloat16 files (target fp8 <= 0.51,
                         fp8 + top-k 64 <= 0.40 at the 8B shape)
    relative RMS error   per stored layer, of the values read back (load_hidden_states, in the model dtype) against
                         the model-dtype files: sqrt(mean err^2) / sqrt(mean ref^2) over all samples
    the Llama-3-8B shape  the same byte ratios computed from the file layout (connectors.header.file_size) for
                         T = 2048 at layers [2, 16, 29, 32] — the figures the issue's targets are about, exact on
                         CPU (a small model's top-k target weighs more against its narrow layers: 512 bytes a token
                         against 2H = 1 KiB for a bf16 layer at H 512, 8 KiB at H 4096)

The random model has no massive activations, so its layers are closer in magnitude than a trained model's: the
per-layer scale's advantage over one scale per token (tests/connectors/test_storage_dtype.py) does not show here.
The drafter-quality comparison (EAGLE-3 on fp8 vs bf16 runs, acceptance within 2%) is not measured by this script.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import build_model, machine_info, make_corpus, speculative_config, write_results  # noqa: E402
from connectors import KVTransferConfig, load_hidden_states  # noqa: E402
from connectors.format import FP8, HiddenStatesSpec  # noqa: E402
from connectors.header import file_entries, file_size, request_metadata  # noqa: E402
from extractor import LLM, SamplingParams  # noqa: E402
from extractor.layers import default_layer_ids  # noqa: E402

TARGETS = {"fp8_over_bf16": 0.51, "fp8_topk64_over_bf16": 0.40}
TOP_K = "top_k:64"
FP8_TOPK = f"{FP8}+{TOP_K}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for results-storage.json/.md, the model and scratch files")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--num-samples", type=int, default=16)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=None, help="where the random model is built or reused")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cuda = args.device.startswith("cuda")
    args.shape, args.dtype, args.vocab_size = ("llama3-8b" if on_cuda else "small"), \
        ("bfloat16" if on_cuda else "float32"), None
    args.model_dir = args.model_dir or os.path.join(args.out, f"model-{args.shape}-{args.dtype}")
    return args


def extract(args, layers, corpus, folder: str, storage: str) -> None:
    storage, _, target = storage.partition("+")
    llm = LLM(model=args.model_dir, speculative_config=speculative_config(layers), dtype=args.dtype,
              device=args.device, target=target, kv_transfer_config=KVTransferConfig(kv_connector_extra_config={
                  "shared_storage_path": folder, "storage_dtype": storage}))
    try:
        outs = llm.generate([{"prompt_token_ids": s} for s in corpus], SamplingParams(max_tokens=0),
                            request_ids=[f"s{i}" for i in range(len(corpus))])
        bad = [o.error for o in outs if o.error]
        if bad:
            raise RuntimeError(f"{len(bad)} requests failed, first: {bad[0]}")
    finally:
        llm.shutdown()


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(folder) for n in names
               if n.endswith(".safetensors"))


def relative_rms(folder: str, reference: str, n: int, num_layers: int) -> list[float]:
    err, ref = torch.zeros(num_layers, dtype=torch.float64), torch.zeros(num_layers, dtype=torch.float64)
    for i in range(n):
        got = load_hidden_states(os.path.join(folder, f"s{i}.safetensors"))["hidden_states"].double()
        want = load_hidden_states(os.path.join(reference, f"s{i}.safetensors"))["hidden_states"].double()
        want = want[:, :got.shape[1]]  # a top-k target run stores all but the last layer
        err += (got - want).pow(2).sum(dim=(0, 2))
        ref += want.pow(2).sum(dim=(0, 2))
    return (err / ref).sqrt().tolist()


def layout_ratios(tokens: int = 2048) -> dict[str, float]:
    """fp8 / bf16 and fp8 + top-k 64 / bf16 file bytes at the Llama-3-8B shape (H 4096, 32 layers, layers
    [2, 16, 29, 32]; the top-k target in place of 32), from the layout."""
    sizes = {}
    for name, storage, target in (("bf16", "bfloat16", ""), ("fp8", FP8, ""), ("fp8_topk64", FP8, TOP_K)):
        layers = (2, 16, 29) if target else (2, 16, 29, 32)
        spec = HiddenStatesSpec(layer_ids=layers, num_hidden_layers=32, hidden_size=4096, dtype="bfloat16",
                                storage_dtype=storage, target=target)
        meta = request_metadata(spec.to_metadata(), request_id="x" * 16, num_tokens=tokens, num_prompt_tokens=tokens,
                                include_output_tokens=False, sample_id="x" * 16)
        sizes[name] = file_size(file_entries(spec, tokens, loss_mask=True), meta)
    return {f"{name}_over_bf16": sizes[name] / sizes["bf16"] for name in ("fp8", "fp8_topk64")}


def markdown(r: dict) -> str:
    lines = ["# Storage dtypes", "", f"Model: random {r['shape']} in {r['dtype']}, {r['samples']} samples, "
             f"{r['tokens']} tokens, layers {r['layers']}; {r['machine']['cpu_model']}.", "",
             "| storage | bytes / token | vs bfloat16 files | relative RMS error per layer (vs model dtype) |",
             "|---|---:|---:|---|"]
    for name, row in r["storage"].items():
        rms = ", ".join(f"{e:.2e}" for e in row["relative_rms"]) if row["relative_rms"] else "exact (reference)"
        lines.append(f"| {name} | {row['bytes_per_token']:.0f} | {row['vs_bf16']:.3f} | {rms} |")
    lines += ["", "Llama-3-8B shape from the file layout (T = 2048, 4 layers): "
              + "; ".join(f"{k.removesuffix('_over_bf16').replace('_', ' + ')} / bf16 = {v:.4f} (target <= "
                          f"{TARGETS[k]})" for k, v in r["layout_8b"].items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    build_model(args)
    num_layers = json.load(open(os.path.join(args.model_dir, "config.json")))["num_hidden_layers"]
    layers = list(default_layer_ids(num_layers))
    from transformers import AutoTokenizer

    corpus = make_corpus(AutoTokenizer.from_pretrained(args.model_dir), args.num_samples, args.min_len, args.max_len,
                         args.seed)
    tokens = sum(map(len, corpus))
    scratch = os.path.join(args.out, "scratch-storage")
    shutil.rmtree(scratch, ignore_errors=True)
    folders = {}
    storages = ["model", "bfloat16", FP8, FP8_TOPK] if args.dtype != "bfloat16" else ["model", FP8, FP8_TOPK]
    for storage in storages:
        folders[storage] = os.path.join(scratch, storage)
        extract(args, layers, corpus, folders[storage], storage)
    bf16 = folders["bfloat16" if "bfloat16" in folders else "model"]
    results = {"shape": args.shape, "dtype": args.dtype, "samples": len(corpus), "tokens": tokens, "layers": layers,
               "machine": machine_info(torch.device(args.device)), "storage": {},
               "layout_8b": layout_ratios()}
    for storage, folder in folders.items():
        name = f"model ({args.dtype})" if storage == "model" else storage
        results["storage"][name] = {
            "bytes": folder_bytes(folder), "bytes_per_token": folder_bytes(folder) / tokens,
            "vs_bf16": folder_bytes(folder) / folder_bytes(bf16),
            "relative_rms": [] if storage == "model" else relative_rms(folder, folders["model"], len(corpus),
                                                                       len(layers) - (storage == FP8_TOPK))}
    shutil.rmtree(scratch, ignore_errors=True)
    write_results(args.out, "results-storage", results, markdown(results))


if __name__ == "__main__":
    main()
