"""The sharded layout against a file per sample on a loopback S3 server (issue 26): objects, PUT requests, write and
read throughput.

    python benchmarks/bench_shards.py --out bench-out                       # 2,000 samples of 64 KiB, 8 MiB shards
    python benchmarks/bench_shards.py --out bench-out --samples 500 --tokens 1024 --shard-mb 64

One set of sample files (the connector's own, written once to local disk: bf16, --layers x --hidden, --tokens rows
each) is stored on moto's S3 server (in-process, behind a counting loopback proxy) two ways, as a job's workers store
them:
    files      one object per sample: storage.put_atomic of each file (what the connector does per request)
    sharded    connectors.shards.write_shard of each --shard-mb worth of them (one streamed, multipart upload)
then read back whole, every sample, as the training feed reads (connectors.reader.read_rows on one filesystem,
checksums checked; sharded: by the sample's byte range).
Counted at the proxy: objects, PUT/POST requests (a multipart upload is a create, its parts and a complete), GET
requests; each figure is also given per 100k samples. Timed: the store and the proxy share this machine's cores, so
throughput is a ratio between the layouts measured side by side, not a figure for a real S3. Never pass/fail.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_results  # noqa: E402
from connectors import KVTransferConfig, RequestInfo  # noqa: E402
from connectors.format import HiddenStatesSpec  # noqa: E402
from connectors.reader import read_rows  # noqa: E402
from connectors.shards import write_shard  # noqa: E402
from connectors.storage import open_url, put_atomic  # noqa: E402
from harness.http_proxy import LoopbackProxy  # noqa: E402


def make_files(args, folder: str) -> list[str]:
    spec = HiddenStatesSpec(layer_ids=tuple(range(1, args.layers + 1)), num_hidden_layers=args.layers,
                            hidden_size=args.hidden, dtype="bfloat16", model="bench/model")
    connector = KVTransferConfig(kv_connector_extra_config={"shared_storage_path": folder}).create_connector(spec)
    g = torch.Generator().manual_seed(0)
    paths = []
    for i in range(args.samples):
        rid = f"s{i:07d}"
        connector.start_request(RequestInfo(rid, args.tokens, {}, sample_id=rid))
        connector.save_hidden_states(rid, torch.randint(0, 32000, (args.tokens,), generator=g),
                                     torch.randn(args.tokens, args.layers, args.hidden, generator=g).bfloat16())
        paths.append(connector.request_finished(rid)["hidden_states_path"])
    assert connector.wait_for_save() == {}
    connector.shutdown()
    return paths


def counts(proxy: LoopbackProxy) -> dict[str, int]:
    log = list(proxy.log)
    return {"put_requests": sum(e.method in ("PUT", "POST") for e in log),
            "get_requests": sum(e.method == "GET" for e in log), "requests": len(log)}


def run_layout(layout: str, files: list[str], fs, root: str, proxy: LoopbackProxy,
               shard_bytes: int) -> dict:
    proxy.reset_log()
    started = time.perf_counter()
    where: list[tuple[str, tuple[int, int] | None]] = []
    if layout == "files":
        for f in files:
            path = f"{root}/data/{os.path.basename(f)}"
            put_atomic(fs, path, Path(f).read_bytes())
            where.append((path, None))
    else:
        group: list[str] = []
        size = 0
        for i, f in enumerate(files):
            group.append(f)
            size += os.path.getsize(f)
            if size >= shard_bytes or i == len(files) - 1:
                path = f"{root}/shards/{len(where):07d}.hsxshard"
                where.extend((path, span) for span in write_shard(fs, path, group))
                group, size = [], 0
    write_s = time.perf_counter() - started
    wrote = counts(proxy)
    fs.invalidate_cache()
    objects = len(fs.find(root))
    proxy.reset_log()
    started = time.perf_counter()
    nbytes = 0
    for path, span in where:  # the training feed's read (HiddenStatesDataset): one filesystem, checksums checked
        _, obj = read_rows(fs, path, verify=True, byte_range=span)
        nbytes += obj["hidden_states"].numel() * 2
    read_s = time.perf_counter() - started
    read = counts(proxy)
    data = sum(os.path.getsize(f) for f in files)
    return {"objects": objects, "write_s": write_s, "read_s": read_s, "write_MBps": data / write_s / 1e6,
            "read_MBps": data / read_s / 1e6, "put_requests": wrote["put_requests"],
            "write_requests": wrote["requests"], "read_get_requests": read["get_requests"],
            "read_requests": read["requests"]}


def markdown(r: dict) -> str:
    n = r["samples"]
    lines = ["# Sharded layout vs a file per sample (loopback S3, moto)", "",
             f"{n:,} samples of {r['sample_bytes']:,} bytes ({r['tokens']} tokens x {r['layers']} layers x "
             f"{r['hidden']} bf16), shards of {r['shard_mb']} MiB ({r['samples_per_shard']:.0f} samples each); "
             f"{os.cpu_count()} CPUs shared by client, proxy and server.", "",
             "| layout | objects | per 100k samples | PUT/POST requests | per 100k | write MB/s | read MB/s | "
             "GET requests (read) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ("files", "sharded"):
        m = r[name]
        lines.append(f"| {name} | {m['objects']:,} | {m['objects'] * 100_000 / n:,.0f} | {m['put_requests']:,} | "
                     f"{m['put_requests'] * 100_000 / n:,.0f} | {m['write_MBps']:.1f} | {m['read_MBps']:.1f} | "
                     f"{m['read_get_requests']:,} |")
    f, s = r["files"], r["sharded"]
    lines += ["", f"sharded / files: {s['objects'] / f['objects']:.4f} of the objects, "
                  f"{s['put_requests'] / f['put_requests']:.4f} of the PUT requests, write throughput "
                  f"{s['write_MBps'] / f['write_MBps']:.2f}x, read throughput {s['read_MBps'] / f['read_MBps']:.2f}x", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--shard-mb", type=float, default=8.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from moto.server import ThreadedMotoServer

    for key, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(key, value)
    staged = tempfile.mkdtemp(prefix="hsx-bench-shards-")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        files = make_files(args, staged)
        host, port = server.get_host_and_port()
        with LoopbackProxy(f"http://{host}:{port}") as proxy:
            options = {"client_kwargs": {"endpoint_url": proxy.endpoint}, "skip_instance_cache": True}
            fs, _ = open_url("s3://bench", options)
            fs.mkdir("bench")
            sample_bytes = os.path.getsize(files[0])
            shard_bytes = int(args.shard_mb * 2**20)
            results = {"samples": args.samples, "tokens": args.tokens, "layers": args.layers, "hidden": args.hidden,
                       "shard_mb": args.shard_mb, "sample_bytes": sample_bytes,
                       "samples_per_shard": max(1, -(-shard_bytes // sample_bytes))}
            for layout in ("files", "sharded"):
                results[layout] = run_layout(layout, files, fs, f"bench/{layout}", proxy, shard_bytes)
    finally:
        server.stop()
        shutil.rmtree(staged, ignore_errors=True)
    write_results(args.out, "results-shards", results, markdown(results))


if __name__ == "__main__":
    main()
