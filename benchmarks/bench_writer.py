"""Writer benchmark: how close the hidden-states connector comes to raw writes, and what a file costs on disk.

    python benchmarks/bench_writer.py --out bench-out              # local disk + loopback S3 (moto), defaults
    python benchmarks/bench_writer.py --out bench-out --no-s3 --hidden 2048 --requests 4

Measures, in one run (never pass/fail; targets are printed next to the figures):
    local throughput    the connector (start_request -> save_hidden_states in chunks -> request_finished ->
                        wait_for_save) writing N requests to a local folder, against a raw sequential write of the
                        same tensor bytes to the same folder (open, write, close), and against the same raw write
                        made durable as the connector makes it (fsync of the file, then of the folder). Target:
                        ratio to the durable raw write >= 0.8; the ratio to the plain raw write is the cost of
                        durability (the connector fsyncs every file since structure issue 10). The connector's time
                        includes hashing every file's data for its checksum (xxh3_64, on the writer threads, since
                        issue 11); the raw writes hash nothing.
    s3 throughput       the same against a loopback moto S3 server, against raw `pipe_file` puts of the same bytes.
    size overhead       bytes on disk / (T * L * H * dtype size) for one file per T. Target: <= 1.01.

Writes results.json and results.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connectors import KVTransferConfig, RequestInfo  # noqa: E402
from connectors.format import HiddenStatesSpec  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for results.json and results.md")
    p.add_argument("--dir", default=None,
                   help="folder the local runs write into (default: a temp folder inside --out, same disk)")
    p.add_argument("--layers", type=int, default=4, help="L, stored layers per token (EAGLE-3: 3 aux + last)")
    p.add_argument("--hidden", type=int, default=4096, help="H, hidden size")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tokens", default="512,2048,8192", help="T values for the size overhead, comma-separated")
    p.add_argument("--throughput-tokens", type=int, default=2048, help="T of each request in the throughput runs")
    p.add_argument("--requests", type=int, default=8, help="requests per throughput run")
    p.add_argument("--chunks", type=int, default=4, help="save_hidden_states calls per request (prefill chunks)")
    p.add_argument("--threads", type=int, default=8, help="num_writer_threads of the connector")
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement; the median is reported")
    p.add_argument("--no-s3", action="store_true", help="skip the loopback S3 runs")
    p.add_argument("--s3-tokens", type=int, default=512, help="T of each request in the S3 runs")
    p.add_argument("--s3-requests", type=int, default=8, help="requests per S3 run")
    return p.parse_args(argv)


def make_requests(n: int, num_tokens: int, layers: int, hidden: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 150_000, (num_tokens,), generator=g),
             torch.randn(num_tokens, layers, hidden, generator=g).to(dtype))  # [T, L, H]
            for _ in range(n)]


def payload_bytes(requests) -> int:
    return sum(ids.numel() * ids.element_size() + hs.numel() * hs.element_size() for ids, hs in requests)


def run_connector(root: str, spec: HiddenStatesSpec, requests, *, chunks: int, threads: int,
                  storage_options: dict | None = None, **extra_config) -> tuple[float, list[str]]:
    """Seconds from the first start_request to wait_for_save returning; the paths written. A request is (token ids,
    states), saved in `chunks` pieces, or a list of (token ids, states, extra) pieces saved as they are (e.g. rows an
    engine quantized on its device); `extra_config` adds connector settings (storage_dtype)."""
    kv = KVTransferConfig(kv_connector_extra_config={
        "shared_storage_path": root, "num_writer_threads": threads, "storage_options": storage_options or {},
        **extra_config})
    connector = kv.create_connector(spec)
    paths = []
    try:
        start = time.perf_counter()
        for i, request in enumerate(requests):
            rid = f"bench-{i}"
            pieces = (request if isinstance(request, list) else
                      [(a, b, None) for a, b in zip(request[0].tensor_split(chunks), request[1].tensor_split(chunks))])
            connector.start_request(RequestInfo(rid, sum(p[0].shape[0] for p in pieces)))
            for id_chunk, state_chunk, extra in pieces:
                connector.save_hidden_states(rid, id_chunk, state_chunk, extra)
            paths.append(connector.request_finished(rid)["hidden_states_path"])
        failures = connector.wait_for_save()
        elapsed = time.perf_counter() - start
    finally:
        connector.shutdown()
    if failures:
        raise RuntimeError(f"connector writes failed: {failures}")
    return elapsed, paths


def _raw_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy())


def run_raw_local(folder: str, requests, durable: bool = False) -> float:
    """Sequential write of the same tensor bytes, one file per request; `durable`: fsync each file and the folder."""
    start = time.perf_counter()
    for i, (ids, states) in enumerate(requests):
        with open(os.path.join(folder, f"raw-{i}.bin"), "wb") as f:
            f.write(_raw_view(ids))
            f.write(_raw_view(states))
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if durable:
            fd = os.open(folder, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    return time.perf_counter() - start


def run_raw_s3(fs, prefix: str, requests) -> float:
    start = time.perf_counter()
    for i, (ids, states) in enumerate(requests):
        fs.pipe_file(f"{prefix}/raw-{i}.bin", bytes(_raw_view(ids)) + bytes(_raw_view(states)))
    return time.perf_counter() - start


def bench_local(args, spec, dtype, workdir: str) -> dict:
    requests = make_requests(args.requests, args.throughput_tokens, args.layers, args.hidden, dtype)
    nbytes = payload_bytes(requests)
    raw_s, durable_s, conn_s = [], [], []
    for r in range(args.repeats):
        for kind in ("raw", "raw_durable", "connector"):  # interleaved: drift in the page cache hits all alike
            folder = os.path.join(workdir, f"{kind}-{r}")
            os.makedirs(folder)
            if kind == "raw":
                raw_s.append(run_raw_local(folder, requests))
            elif kind == "raw_durable":
                durable_s.append(run_raw_local(folder, requests, durable=True))
            else:
                conn_s.append(run_connector(folder, spec, requests, chunks=args.chunks, threads=args.threads)[0])
            shutil.rmtree(folder)
    raw, durable, conn = statistics.median(raw_s), statistics.median(durable_s), statistics.median(conn_s)
    return {"bytes": nbytes, "requests": args.requests, "tokens_per_request": args.throughput_tokens,
            "raw_s": raw_s, "raw_durable_s": durable_s, "connector_s": conn_s, "raw_MBps": nbytes / raw / 1e6,
            "raw_durable_MBps": nbytes / durable / 1e6, "connector_MBps": nbytes / conn / 1e6,
            "ratio": durable / conn, "ratio_to_raw_without_fsync": raw / conn, "target_ratio": 0.8}


def bench_s3(args, spec, dtype) -> dict:
    import s3fs
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}
        fs = s3fs.S3FileSystem(**options)
        fs.mkdir("hsx-bench")
        requests = make_requests(args.s3_requests, args.s3_tokens, args.layers, args.hidden, dtype)
        nbytes = payload_bytes(requests)
        raw_s, conn_s = [], []
        for r in range(args.repeats):
            raw_s.append(run_raw_s3(fs, f"hsx-bench/raw-{r}", requests))
            conn_s.append(run_connector(f"s3://hsx-bench/conn-{r}", spec, requests, chunks=args.chunks,
                                        threads=args.threads, storage_options=options)[0])
            fs.rm("hsx-bench", recursive=True)
            fs.mkdir("hsx-bench")
    finally:
        server.stop()
    raw, conn = statistics.median(raw_s), statistics.median(conn_s)
    return {"bytes": nbytes, "requests": args.s3_requests, "tokens_per_request": args.s3_tokens,
            "raw_s": raw_s, "connector_s": conn_s, "raw_MBps": nbytes / raw / 1e6,
            "connector_MBps": nbytes / conn / 1e6, "ratio": raw / conn}


def bench_sizes(args, spec, dtype, workdir: str) -> list[dict]:
    rows = []
    dsize = torch.empty(0, dtype=dtype).element_size()
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        folder = os.path.join(workdir, f"size-{num_tokens}")
        os.makedirs(folder)
        requests = make_requests(1, num_tokens, args.layers, args.hidden, dtype)
        _, (path,) = run_connector(folder, spec, requests, chunks=args.chunks, threads=1)
        st = os.stat(path)
        ideal = num_tokens * args.layers * args.hidden * dsize
        rows.append({"tokens": num_tokens, "ideal_bytes": ideal, "file_bytes": st.st_size,
                     "allocated_bytes": st.st_blocks * 512, "ratio": st.st_size / ideal,
                     "allocated_ratio": st.st_blocks * 512 / ideal, "target_ratio": 1.01})
        shutil.rmtree(folder)
        del requests
    return rows


def to_markdown(results: dict) -> str:
    c = results["config"]
    lines = [f"# Writer benchmark\n\nL={c['layers']} H={c['hidden']} dtype={c['dtype']}, "
             f"{c['threads']} writer threads, {c['chunks']} chunks per request, median of {c['repeats']} runs; "
             f"{c['host']}. Local raw = the raw write with fsync, as durable as the connector.\n",
             "| run | requests x tokens | MB | raw MB/s | connector MB/s | connector / raw | target |",
             "|---|---|---|---|---|---|---|"]
    for name in ("local", "s3"):
        r = results.get(name)
        if r:
            target = ">= 0.8" if name == "local" else "-"
            raw = r["raw_durable_MBps"] if name == "local" else r["raw_MBps"]
            lines.append(f"| {name} | {r['requests']} x {r['tokens_per_request']} | {r['bytes'] / 1e6:.0f} | "
                         f"{raw:.0f} | {r['connector_MBps']:.0f} | {r['ratio']:.2f} | {target} |")
    local = results.get("local")
    if local:
        lines += ["", f"Local, durability: raw write with fsync (file + folder) {local['raw_durable_MBps']:.0f} MB/s; "
                      f"the connector (which fsyncs) is {local['ratio']:.2f}x the durable raw write and "
                      f"{local['ratio_to_raw_without_fsync']:.2f}x the raw write without fsync."]
    lines += ["", "| T | ideal bytes (T*L*H*dtype) | file bytes | file / ideal | allocated / ideal | target |",
              "|---|---|---|---|---|---|"]
    for r in results["sizes"]:
        lines.append(f"| {r['tokens']} | {r['ideal_bytes']} | {r['file_bytes']} | {r['ratio']:.5f} | "
                     f"{r['allocated_ratio']:.5f} | <= 1.01 |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    spec = HiddenStatesSpec(layer_ids=tuple(range(1, args.layers + 1)), num_hidden_layers=args.layers,
                            hidden_size=args.hidden, dtype=args.dtype, model="benchmark")
    workdir = tempfile.mkdtemp(prefix="bench-writer-", dir=args.dir or str(out))
    try:
        results = {"config": {**vars(args), "host": f"{platform.node()} ({os.cpu_count()} CPUs)",
                              "torch": torch.__version__}}
        results["local"] = bench_local(args, spec, dtype, workdir)
        results["sizes"] = bench_sizes(args, spec, dtype, workdir)
        if not args.no_s3:
            results["s3"] = bench_s3(args, spec, dtype)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    markdown = to_markdown(results)
    (out / "results.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
