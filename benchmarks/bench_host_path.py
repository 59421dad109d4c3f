"""Host path priced per byte (issue 46): CPU-seconds per GB the connector writes, bf16 and fp8, local disk, checksums
and fsync on, with the breakdown by stage.

    python benchmarks/bench_host_path.py --out bench-out                 # Llama-3-8B's shape: 4 layers x 4096, bf16
    python benchmarks/bench_host_path.py --out bench-out --tokens 512 --requests 4 --repeats 1      # a quick look

Measures, in one process (never pass/fail; the goal, <= 1.0 CPU-s per GB written, is printed beside the figures):
    end to end   the connector (start_request -> save_hidden_states in chunks -> request_finished -> wait_for_save)
                 writing --requests files of --tokens tokens; CPU-seconds = the process's CPU time (every thread, user
                 and system) over the run; GB = bytes of the files written. Median of --repeats.
    stages       each stage alone, single-threaded, on the same states (CPU-s per GB of the file it produces): the
                 state check before (the float scans: isfinite, then != 0) and now (connectors.quant.row_magnitudes:
                 one integer pass), fp8's conversion before (the whole-tensor float expression) and now (blocked,
                 byte-identical), the checksum (xxh3_64 over the file's data), the write with fsync.
    fp8 converted on the device: the connector fed rows already in fp8 with their scales and magnitudes (what the
                 engine hands it on CUDA, where the runner converts before the copy): the host's share of an fp8 file.

Writes host_path.json and host_path.md to --out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_writer import make_requests, run_connector  # noqa: E402
from connectors.format import FP8, HiddenStatesSpec  # noqa: E402

GOAL = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for host_path.json and host_path.md")
    p.add_argument("--dir", default=None, help="folder the files are written into (default: a temp folder in --out)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per request")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--chunks", type=int, default=4, help="save_hidden_states calls per request")
    p.add_argument("--threads", type=int, default=2, help="num_writer_threads (this VM has 2 cores)")
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def end_to_end(args, storage: str, requests, workdir: str, on_device: bool = False) -> dict:
    """`on_device`: the connector fed rows already converted to fp8 with their scales and magnitudes, as the engine
    hands them when it converts on the GPU (converted before the clock starts: that is the device's work)."""
    from connectors.format import HIDDEN_STATES_SCALES
    from connectors.quant import ROW_MAGNITUDES, quantize, row_magnitudes

    def on_the_device(ids, rows):
        stored, scales = quantize(rows, FP8, magnitudes := row_magnitudes(rows))
        return ids, stored, {HIDDEN_STATES_SCALES: scales, ROW_MAGNITUDES: magnitudes}

    spec = HiddenStatesSpec(layer_ids=tuple(range(1, args.layers + 1)), num_hidden_layers=args.layers,
                            hidden_size=args.hidden, dtype="bfloat16", storage_dtype=storage)
    if on_device:
        requests = [[on_the_device(*piece) for piece in zip(i.tensor_split(args.chunks), s.tensor_split(args.chunks))]
                    for i, s in requests]
    runs = []
    for r in range(args.repeats):
        folder = tempfile.mkdtemp(prefix=f"{storage}-{r}-", dir=workdir)
        cpu, wall = time.process_time(), time.perf_counter()
        _, paths = run_connector(folder, spec, requests, chunks=args.chunks, threads=args.threads,
                                 storage_dtype=storage)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        written = sum(os.path.getsize(p) for p in paths)
        runs.append({"cpu_s": cpu, "wall_s": wall, "bytes": written, "cpu_s_per_GB": cpu / (written / 1e9)})
        shutil.rmtree(folder)
    return {"storage": storage + (" converted on the device" if on_device else ""), "runs": runs,
            "cpu_s_per_GB": statistics.median(r["cpu_s_per_GB"] for r in runs),
            "GB_per_s": statistics.median(r["bytes"] / r["wall_s"] / 1e9 for r in runs)}


def _cpu(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def stages(args, states: torch.Tensor, workdir: str) -> list[dict]:
    """Each stage alone on one request's states, one thread: CPU-s per GB of the bf16 file and of the fp8 file."""
    import xxhash

    from connectors.quant import FP8_MAX, SCALE_FLOOR, quantize, row_magnitudes

    torch.set_num_threads(1)
    bf16_gb, fp8_gb = states.numel() * 2 / 1e9, states.numel() / 1e9

    def old_check():
        bool(torch.isfinite(states).all())
        (states != 0).any(dim=-1).any(dim=0)

    def old_fp8():
        x = states.float()
        scales = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=SCALE_FLOOR)
        return (x / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

    magnitudes = row_magnitudes(states)
    data = memoryview(states.contiguous().view(torch.uint8).numpy())
    path = os.path.join(workdir, "stage.bin")

    def write():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    rows = [("state check, before (isfinite, != 0: float scans)", old_check, bf16_gb),
            ("state check, now (row_magnitudes: one integer pass)", lambda: row_magnitudes(states), bf16_gb),
            ("fp8 conversion, before (whole-tensor float32)", old_fp8, fp8_gb),
            ("fp8 conversion, now (blocked, magnitudes shared)", lambda: quantize(states, FP8, magnitudes), fp8_gb),
            ("checksum (xxh3_64 of the data)", lambda: xxhash.xxh3_64(data).digest(), bf16_gb),
            ("write + fsync (local disk)", write, bf16_gb)]
    out = [{"stage": name, "cpu_s": (s := _cpu(fn, args.repeats)), "cpu_s_per_GB": s / gb, "per": "bf16 file"
            if gb == bf16_gb else "fp8 file"} for name, fn, gb in rows]
    os.remove(path)
    return out


def to_markdown(results: dict) -> str:
    c = results["config"]
    lines = [f"# Host path: CPU-seconds per GB written\n\n{c['requests']} requests x {c['tokens']} tokens x "
             f"{c['layers']} layers x {c['hidden']} (bf16 states), {c['chunks']} chunks each, {c['threads']} writer "
             f"threads, checksums and fsync on; median of {c['repeats']}; {c['host']}. Goal <= {GOAL} CPU-s/GB.\n",
             "| storage | CPU-s per GB written | GB/s (wall) |", "|---|---|---|"]
    for row in results["end_to_end"]:
        lines.append(f"| {row['storage']} | {row['cpu_s_per_GB']:.2f} | {row['GB_per_s']:.2f} |")
    lines += ["", "Stages alone (one request, one thread):", "", "| stage | CPU-s per GB | of |", "|---|---|---|"]
    for row in results["stages"]:
        lines.append(f"| {row['stage']} | {row['cpu_s_per_GB']:.2f} | {row['per']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import platform

    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="host-path-", dir=args.dir or args.out)
    try:
        requests = make_requests(args.requests, args.tokens, args.layers, args.hidden, torch.bfloat16)
        e2e = [end_to_end(args, storage, requests, workdir) for storage in ("model", FP8)]
        e2e.append(end_to_end(args, FP8, requests, workdir, on_device=True))
        stage_rows = stages(args, requests[0][1], workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results = {"config": {**vars(args), "host": f"{platform.machine()}, {os.cpu_count()} CPUs, torch "
                                               f"{torch.__version__}"},
               "end_to_end": e2e, "stages": stage_rows}
    from benchmarks.common import write_results

    write_results(args.out, "host_path", results, to_markdown(results))  # and prints it
    return 0


if __name__ == "__main__":
    sys.exit(main())
