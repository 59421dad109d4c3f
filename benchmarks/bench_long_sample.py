"""Long-sample benchmark (issue 25, item 5): peak RSS of extracting one sample far longer than
--max-num-batched-tokens, with the connector's staging bound and without it, through the real engine and connector.

    python benchmarks/bench_long_sample.py --out bench-out                   # CPU: 32k tokens, chunks of 2048, ~5 min
    python benchmarks/bench_long_sample.py --out bench-out --device cuda     # GPU: the same sample and model

One random Llama built for the purpose ("long" in benchmarks.common.SHAPES: hidden 512 x 4 layers, all four stored,
so a token's states are 8 KiB in float32 while attention stays cheap: 2 heads of 32, one KV head), one sample of
--num-tokens random ids, prefilled in chunks of --max-num-batched-tokens. Each variant runs in a fresh subprocess
(peaks never mix), loads the model, reads its RSS (the model's own footprint), resets the peak (VmHWM) and runs the
sample once:
    engine          the decoder stack over the same chunks, nothing captured: the engine's own prefill peak (the KV
                    cache, attention over a chunk x the whole prefix)
    unbounded       extraction with the staging bound out of reach (every chunk kept until the request finishes, as
                    before the bound existed)
    bounded         extraction with max_staged_bytes_per_request = --bound-mib: past it, rows go to a spool file on
                    the writer threads and the file is assembled from it
each for every --storage dtype. Reported: peak RSS over the model's footprint, the same over the engine's own prefill
peak (what capture and staging add), the connector's own count of the most bytes one request held in memory, and
whether the bounded and unbounded files are byte for byte the same.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    build_model,
    machine_info,
    peak_rss,
    plan,
    reset_peak_rss,
    rss,
    run_bare,
    run_hsx,
    speculative_config,
    write_results,
)
from connectors import KVTransferConfig  # noqa: E402
from connectors.format import data_hasher  # noqa: E402
from connectors.storage import open_url  # noqa: E402
from extractor import LLM  # noqa: E402

MIB = 1 << 20
UNBOUNDED = 1 << 50  # the bound out of reach: every chunk stays in memory until the request finishes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for results-long-sample.json/.md, the model and scratch")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--num-tokens", type=int, default=32768)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--bound-mib", type=int, default=64, help="max_staged_bytes_per_request of the bounded runs")
    p.add_argument("--storage", default="model,float8_e4m3fn", help="storage dtypes, comma-separated")
    p.add_argument("--dtype", default=None, help="model dtype (default float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=None, help="where the random model is built or reused")
    p.add_argument("--s3", action="store_true",
                   help="write to a loopback S3 server (moto, in a process of its own) instead of local disk")
    p.add_argument("--s3-endpoint", default=None, help=argparse.SUPPRESS)
    p.add_argument("--malloc-mmap-threshold", type=int, default=1 << 20,
                   help="MALLOC_MMAP_THRESHOLD_ of the subprocesses (as bench_extraction.py; 0 = glibc's default)")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # a subprocess: run one variant, print JSON
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.shape, args.vocab_size, args.attn = "long", None, None
    args.model_dir = args.model_dir or os.path.join(args.out, f"model-{args.shape}-{args.dtype}")
    return args


def sample(args) -> list[int]:
    """--num-tokens random ids (values do not change memory or speed)."""
    rng = random.Random(args.seed)
    return [rng.randrange(16, 512) for _ in range(args.num_tokens)]


def run_variant(args) -> dict:
    """In a fresh process: load, note the model's RSS, reset the peak, run the one sample, report."""
    kind, _, storage = args.variant.partition(":")
    scratch = os.path.join(args.out, "scratch-long", args.variant.replace(":", "-"))
    shutil.rmtree(scratch, ignore_errors=True)
    options = {"client_kwargs": {"endpoint_url": args.s3_endpoint}} if args.s3_endpoint else {}
    root = f"s3://bench/{args.variant.replace(':', '-')}" if args.s3_endpoint else scratch
    layers = list(range(1, json.load(open(os.path.join(args.model_dir, "config.json")))["num_hidden_layers"] + 1))
    connector = {"shared_storage_path": root, "storage_options": options, "storage_dtype": storage or "model"}
    if kind == "bounded":
        connector["max_staged_bytes_per_request"] = args.bound_mib * MIB
    elif kind == "unbounded":
        connector["max_staged_bytes_per_request"] = UNBOUNDED
    llm = LLM(model=args.model_dir, speculative_config=speculative_config(layers), dtype=args.dtype,
              max_num_batched_tokens=args.max_num_batched_tokens, device=args.device,
              kv_transfer_config=KVTransferConfig(kv_connector_extra_config=connector))
    tokens = sample(args)
    model_rss = rss()
    reset_peak_rss()
    wall = time.perf_counter()
    if kind == "engine":
        run_bare(llm, plan(llm, [tokens]))
    else:
        run_hsx(llm, [tokens], scratch)
    wall = time.perf_counter() - wall
    out = {"variant": args.variant, "model_rss_bytes": model_rss, "peak_rss_bytes": peak_rss(), "wall_s": wall,
           "layers": layers}
    if kind != "engine":
        out["connector_peak_staged_bytes"] = llm.connector.peak_staged_bytes
        out["writer_peak_bytes_in_flight"] = llm.connector.peak_bytes_in_flight
        fs, path = open_url(root, options)
        files = [f for f in fs.find(path) if f.endswith(".safetensors")]
        assert len(files) == 1, files
        out["file"], out["file_bytes"] = files[0], fs.size(files[0])
        out["file_xxh3"] = file_hash(fs, files[0])
        fs.rm(files[0])
    llm.shutdown()
    return out


def file_hash(fs, path: str) -> str:
    hasher = data_hasher()
    with fs.open(path, "rb") as f:
        while block := f.read(MIB):
            hasher.update(block)
    return hasher.hexdigest()


def spawn(args, variant: str) -> dict:
    env = dict(os.environ)
    if args.malloc_mmap_threshold:
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(args.malloc_mmap_threshold))
    cmd = [sys.executable, __file__, "--out", args.out, "--device", args.device, "--dtype", args.dtype,
           "--num-tokens", str(args.num_tokens), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--bound-mib", str(args.bound_mib), "--seed", str(args.seed), "--model-dir", args.model_dir,
           "--variant", variant] + (["--s3-endpoint", args.s3_endpoint] if args.s3_endpoint else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"variant {variant} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def markdown(r: dict) -> str:
    c = r["config"]
    lines = [f"# One long sample in bounded memory — {c['num_tokens']} tokens, chunks of {c['max_num_batched_tokens']}",
             "", f"Model: random `long` shape in {c['dtype']} on {c['device']} ({r['machine']['cpu_model']}), layers "
             f"{r['engine']['layers']} stored; the sample's states [T, L, H] are {r['states_bytes'] / MIB:.0f} MiB in "
             f"the model dtype. Model footprint (RSS after load): {r['engine']['model_rss_bytes'] / MIB:.0f} MiB; "
             f"the engine's own prefill peak without capture: +{r['engine_over_model'] / MIB:.0f} MiB over it.", "",
             f"Bound: max_staged_bytes_per_request = {c['bound_mib']} MiB; files to "
             f"{'a loopback S3 server (moto, its own process)' if c['s3'] else 'local disk'}.", "",
             "| storage | path | peak RSS over the model | over the engine's own peak | connector's peak staged "
             "| file | wall s |", "|---|---|---:|---:|---:|---:|---:|"]
    for storage, row in r["storage"].items():
        for kind in ("unbounded", "bounded"):
            v = row[kind]
            lines.append(f"| {storage} | {kind} | {v['over_model'] / MIB:.0f} MiB | {v['over_engine'] / MIB:+.0f} MiB "
                         f"| {v['connector_peak_staged_bytes'] / MIB:.0f} MiB | {v['file_bytes'] / MIB:.0f} MiB "
                         f"| {v['wall_s']:.0f} |")
        lines.append(f"| {storage} | files identical | {'yes' if row['identical'] else 'NO'} | | | | |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    os.makedirs(args.out, exist_ok=True)
    build_model(args)
    server = start_s3(args) if args.s3 else None
    try:
        results = measure(args)
    finally:
        if server is not None:
            server.kill()
    shutil.rmtree(os.path.join(args.out, "scratch-long"), ignore_errors=True)
    write_results(args.out, "results-long-sample" + ("-s3" if args.s3 else ""), results, markdown(results))


def start_s3(args) -> subprocess.Popen:
    """moto's S3 server on loopback in its own process (the objects it keeps are not the variants' memory), with a
    bucket "bench"; sets args.s3_endpoint."""
    code = ("import os, time\n"
            "os.environ.update(AWS_ACCESS_KEY_ID='bench', AWS_SECRET_ACCESS_KEY='bench', AWS_DEFAULT_REGION='us-east-1')\n"
            "from moto.server import ThreadedMotoServer\n"
            "s = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False)\n"
            "s.start()\nprint(s.get_host_and_port()[1], flush=True)\ntime.sleep(1e9)\n")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # the variants inherit them
        os.environ.setdefault(key, "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    args.s3_endpoint = f"http://127.0.0.1:{int(server.stdout.readline())}"
    fs, _ = open_url("s3://bench", {"client_kwargs": {"endpoint_url": args.s3_endpoint}})
    fs.mkdir("bench")
    return server


def measure(args) -> dict:
    engine = spawn(args, "engine")
    engine_over = engine["peak_rss_bytes"] - engine["model_rss_bytes"]
    hidden = json.load(open(os.path.join(args.model_dir, "config.json")))["hidden_size"]
    results = {"config": {k: getattr(args, k) for k in ("num_tokens", "max_num_batched_tokens", "bound_mib", "dtype",
                                                         "device", "seed", "shape", "s3")},
               "machine": machine_info(torch.device(args.device)), "engine": engine,
               "engine_over_model": engine_over,
               "states_bytes": args.num_tokens * len(engine["layers"]) * hidden * getattr(torch, args.dtype).itemsize,
               "storage": {}}
    for storage in args.storage.split(","):
        row = {}
        for kind in ("unbounded", "bounded"):
            v = spawn(args, f"{kind}:{storage}")
            v["over_model"] = v["peak_rss_bytes"] - v["model_rss_bytes"]
            v["over_engine"] = v["over_model"] - engine_over
            row[kind] = v
        row["identical"] = row["unbounded"]["file_xxh3"] == row["bounded"]["file_xxh3"]
        results["storage"][storage] = row
    return results


if __name__ == "__main__":
    main()
