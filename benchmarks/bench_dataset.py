"""Measure the training feed: dataset open time against a file walk, and read throughput against plain safetensors.

    python benchmarks/bench_dataset.py [--rows 100000] [--walk-files 100000] [--samples 300] [--out DIR]

1. Open time: HiddenStatesDataset over manifests of 10k and --rows rows (run.json + Parquet, written through
   connectors.run and connectors.manifest; no data file is touched), next to a walk (os.walk, what loaders that discover files do) of
   --walk-files files in sub-folders.
2. Read throughput from local disk: --samples files written by the connector (bf16, T ~ U[64, 512], L=4, H=1024 by
   default), read as dataset items (raw and EAGLE-3 layouts) vs `safetensors.torch.load_file` in a loop over the same
   files. Every pass runs after a warm-up pass, so all read from the page cache: this compares the code paths, not
   the disk.

Writes DIR/bench_dataset.json and DIR/bench_dataset.md; never passes or fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pyarrow as pa  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import best_of  # noqa: E402
from connectors import HiddenStatesSpec, KVTransferConfig, RequestInfo  # noqa: E402
from connectors.manifest import OK, new_attempt_id, write_manifest_part  # noqa: E402
from connectors.run import RunSpec, write_run_spec  # noqa: E402
from training.collate import PadCollator  # noqa: E402
from training.dataset import HiddenStatesDataset  # noqa: E402


def write_manifest(root: str, n: int, spec: HiddenStatesSpec) -> None:
    """A run of `n` manifest rows (one part) and its run.json, without data files: what opening costs."""
    ids = pa.array([f"sample-{i:08d}" for i in range(n)])
    paths = pa.array([f"data/{i // 1000:05d}/sample-{i:08d}.safetensors" for i in range(n)])
    lengths = pa.array([(i * 7919) % 2048 + 1 for i in range(n)], pa.int64())
    table = pa.table({"sample_id": ids, "path": paths, "num_tokens": lengths, "num_prompt_tokens": lengths,
                      "status": pa.array([OK] * n), "bytes": pa.array([0] * n, pa.int64())})
    write_run_spec(root, RunSpec.from_file_spec(spec))
    write_manifest_part(root, table, new_attempt_id(), 0)


def bench_open(tmp: str, rows: int, walk_files: int, repeats: int) -> list[dict]:
    spec = HiddenStatesSpec(layer_ids=(2, 16, 29, 32), num_hidden_layers=32, hidden_size=4096, dtype="bfloat16",
                            model="org/model-8b")
    results = []
    for n in sorted({10_000, rows}):
        root = os.path.join(tmp, f"open-{n}")
        write_manifest(root, n, spec)
        t = best_of(lambda root=root: HiddenStatesDataset(root, layout="eagle3"), repeats)
        results.append({"what": f"HiddenStatesDataset open, {n:,} manifest rows", "count": n, "seconds": t})

    walk_root = os.path.join(tmp, "walk")
    for i in range(walk_files):
        d = os.path.join(walk_root, f"{i // 1000:05d}")
        if i % 1000 == 0:
            os.makedirs(d, exist_ok=True)
        open(os.path.join(d, f"hs_{i}.safetensors"), "wb").close()

    def walk():
        found = [os.path.join(r, f) for r, _, files in os.walk(walk_root) for f in files if f.endswith(".safetensors")]
        assert len(found) == walk_files

    t = best_of(walk, repeats)
    results.append({"what": f"os.walk over {walk_files:,} files (file-discovering loaders)", "count": walk_files,
                    "seconds": t})
    return results


def bench_read(tmp: str, samples: int, hidden: int, layers: int, repeats: int) -> tuple[list[dict], dict]:
    spec = HiddenStatesSpec(layer_ids=tuple(range(1, layers + 1)), num_hidden_layers=layers, hidden_size=hidden,
                            dtype="bfloat16", model="bench/model")
    root = os.path.join(tmp, "read-run")
    connector = KVTransferConfig(kv_connector_extra_config={"shared_storage_path": root,
                                                            "allow_custom_save_path": True}).create_connector(spec)
    g = torch.Generator().manual_seed(0)
    rows, files, total_bytes, total_tokens = [], [], 0, 0
    for i in range(samples):
        t = int(torch.randint(64, 513, (1,), generator=g))
        rel = f"data/{i // 1000:04d}/s{i:06d}.safetensors"
        rid = f"r{i}"
        connector.start_request(RequestInfo(rid, t, {"hidden_states_path": rel}, sample_id=f"s{i:06d}",
                                            loss_mask=torch.ones(t, dtype=torch.uint8)))
        connector.save_hidden_states(rid, torch.randint(0, 32000, (t,)),
                                     torch.randn(t, layers, hidden, generator=g).to(torch.bfloat16))
        connector.request_finished(rid)
        rows.append({"sample_id": f"s{i:06d}", "path": rel, "num_tokens": t, "num_prompt_tokens": t, "status": OK,
                     "bytes": 0})
        total_tokens += t
    assert not connector.wait_for_save()
    connector.shutdown()
    for row in rows:
        path = os.path.join(root, row["path"])
        row["bytes"] = os.path.getsize(path)
        total_bytes += row["bytes"]
        files.append(path)
    write_manifest_part(root, rows, new_attempt_id(), 0)
    write_run_spec(root, RunSpec.from_file_spec(spec))

    raw = HiddenStatesDataset(root, include_sample_id=False)
    eagle3 = HiddenStatesDataset(root, layout="eagle3", include_sample_id=False)

    def consume(tensors) -> None:
        # touch every 4 KiB page of every tensor: load_file returns memory-mapped tensors whose bytes are only read
        # when used, so an untouched baseline would measure nothing
        for t in tensors:
            t.reshape(-1).view(torch.uint8)[::4096].sum()

    def loop_dataset(ds):
        for i in range(len(ds)):
            consume(ds[i].values())

    def loop_load_file():
        for p in files:
            consume(safetensors.torch.load_file(p).values())

    def loop_dataloader(workers: int):
        loader = torch.utils.data.DataLoader(raw, batch_size=8, num_workers=workers, collate_fn=PadCollator())
        for batch in loader:
            consume(v for v in batch.values() if isinstance(v, torch.Tensor))

    cases = [("safetensors.torch.load_file loop (baseline)", loop_load_file),
             ("HiddenStatesDataset raw items", lambda: loop_dataset(raw)),
             ("HiddenStatesDataset eagle3 items", lambda: loop_dataset(eagle3)),
             ("DataLoader(raw, batch_size=8, PadCollator), num_workers=0", lambda: loop_dataloader(0)),
             ("DataLoader(raw, batch_size=8, PadCollator), num_workers=2 (incl. worker start-up)",
              lambda: loop_dataloader(2))]
    loop_load_file()  # warm the page cache
    results = []
    for name, fn in cases:
        t = best_of(fn, repeats)
        results.append({"what": name, "seconds": t, "samples_per_s": samples / t,
                        "mb_per_s": total_bytes / t / 1e6, "tokens_per_s": total_tokens / t})
    return results, {"samples": samples, "bytes": total_bytes, "tokens": total_tokens, "layers": layers,
                     "hidden_size": hidden, "dtype": "bfloat16"}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rows", type=int, default=100_000, help="manifest rows for the open-time measurement")
    parser.add_argument("--walk-files", type=int, default=100_000, help="files in the walk baseline")
    parser.add_argument("--samples", type=int, default=300, help="files for the read-throughput measurement")
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="passes per measurement; the best is reported")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads in the reading process (DataLoader workers use 1)")
    parser.add_argument("--tmp", default=None, help="scratch folder (default: a temp folder, removed after)")
    parser.add_argument("--out", default="bench-results", help="folder for bench_dataset.json / .md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        open_results = bench_open(tmp, args.rows, args.walk_files, args.repeats)
        read_results, read_setup = bench_read(tmp, args.samples, args.hidden_size, args.layers, args.repeats)

    report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__, "torch_threads": args.threads},
              "open": open_results, "read_setup": read_setup, "read": read_results}
    base = next(r for r in read_results if "baseline" in r["what"])
    lines = ["## Dataset open time", "", "| what | seconds |", "| --- | ---: |"]
    lines += [f"| {r['what']} | {r['seconds']:.3f} |" for r in open_results]
    s = read_setup
    lines += ["", f"## Read throughput, local disk (page cache warm): {s['samples']} samples, {s['tokens']:,} tokens, "
                  f"{s['bytes'] / 1e6:.0f} MB, bf16 [T, {s['layers']}, {s['hidden_size']}]", "",
              "| reader | samples/s | MB/s | tokens/s | vs load_file |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['what']} | {r['samples_per_s']:.0f} | {r['mb_per_s']:.0f} | {r['tokens_per_s']:,.0f} | "
              f"{r['samples_per_s'] / base['samples_per_s']:.2f}x |" for r in read_results]
    markdown = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_dataset.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(args.out, "bench_dataset.md"), "w") as f:
        f.write(markdown)
    print(markdown)
    return report


if __name__ == "__main__":
    main()
