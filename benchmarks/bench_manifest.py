"""The manifest of a large run (issue 26): opening it as a job leaves it (one part per 1000 committed rows) against
after `hsx compact` (a few large parts sorted by sample id), and what compaction costs.

    python benchmarks/bench_manifest.py --rows 10000000 --out bench-out     # the issue's 10M rows
    python benchmarks/bench_manifest.py --rows 1000000 --out bench-out      # quicker

A run of --rows "ok" rows (sample ids, data paths, token counts, checksums as a job records them; no data files)
is written as parts of --part-rows rows through connectors.run's part writer, then measured:
    read_manifest     every row of every live part (the parts read concurrently)
    ok rows           connectors.manifest.ok_rows: one committed row per sample, sorted (what readers open)
    committed ids     the resume set a re-run skips
    dataset           HiddenStatesDataset(run): run.json + ok rows + its index arrays (target: within 2x of opening)
    compact           compact_manifest: read, stable-sort, write, switch, remove the old parts
each the best of --repeats, before and after compaction, with the process's peak RSS. Never pass/fail.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import resource
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa  # noqa: E402

from benchmarks.common import best_of, write_results  # noqa: E402
from connectors import HiddenStatesSpec  # noqa: E402
from connectors.manifest import (
    OK,
    committed_ids,
    compact_manifest,
    live_manifest_parts,
    ok_rows,
    read_manifest,
    write_manifest_part,
)
from connectors.run import RunDir, RunSpec, data_path, write_run_spec
from training.dataset import HiddenStatesDataset  # noqa: E402

TARGETS = {"open_s": 2.0, "dataset_over_open": 2.0}


def write_run(root: str, rows: int, part_rows: int) -> None:
    spec = HiddenStatesSpec(layer_ids=(2, 16, 29, 32), num_hidden_layers=32, hidden_size=4096, dtype="bfloat16",
                            model="org/model-8b")
    write_run_spec(root, RunSpec.from_file_spec(spec))
    run = RunDir(root)

    def part(seq: int) -> None:
        lo, hi = seq * part_rows, min(rows, (seq + 1) * part_rows)
        ids = [f"sharegpt-{i:09d}" for i in range(lo, hi)]
        n = len(ids)
        tokens = pa.array([(i * 7919) % 2048 + 1 for i in range(lo, hi)], pa.int64())
        write_manifest_part(run, pa.table({
            "sample_id": ids, "path": [data_path(s) for s in ids], "num_tokens": tokens, "num_prompt_tokens": tokens,
            "status": pa.array([OK] * n), "bytes": pa.array([4096 * 8] * n, pa.int64()),
            "source": pa.array([f"corpus/part-{lo // 100000:03d}.jsonl:{i}" for i in range(lo, hi)]),
            "truncated": pa.array([False] * n), "checksum": [f"xxh3_64:{i:016x}" for i in range(lo, hi)]}),
            "20261203T000000.000000Z-bench000", seq)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(part, range(-(-rows // part_rows))))


def measure(root: str, repeats: int) -> dict:
    run = RunDir(root)
    return {"parts": len(live_manifest_parts(run)),
            "read_manifest_s": best_of(lambda: read_manifest(run), repeats),
            "ok_rows_s": best_of(lambda: ok_rows(run), repeats),
            "committed_ids_s": best_of(lambda: committed_ids(run), repeats),
            "dataset_s": best_of(lambda: HiddenStatesDataset(root), repeats),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def markdown(r: dict) -> str:
    lines = [f"# Manifest of {r['rows']:,} rows", "", f"Written as {r['before']['parts']:,} parts of {r['part_rows']:,} "
             f"rows; best of {r['repeats']}; {os.cpu_count()} CPUs.", "",
             "| manifest | parts | read_manifest | ok rows (open) | committed ids (resume set) | HiddenStatesDataset | "
             "dataset / open | peak RSS |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ("before", "after"):
        m = r[name]
        lines.append(f"| {name} compaction | {m['parts']:,} | {m['read_manifest_s']:.2f} s | {m['ok_rows_s']:.2f} s | "
                     f"{m['committed_ids_s']:.2f} s | {m['dataset_s']:.2f} s | {m['dataset_s'] / m['ok_rows_s']:.2f} | "
                     f"{m['peak_rss_mb']:,.0f} MB |")
    lines += ["", f"compact_manifest: {r['compact_s']:.1f} s ({r['before']['parts']:,} parts -> "
                  f"{r['after']['parts']}); targets: open < {TARGETS['open_s']} s, dataset within "
                  f"{TARGETS['dataset_over_open']}x of it", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--part-rows", type=int, default=1000, help="rows per part as the job commits them")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default=None, help="scratch folder (default under --out)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    root = args.work or os.path.join(args.out, f"scratch-manifest-{args.rows}")
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    write_run(root, args.rows, args.part_rows)
    results = {"rows": args.rows, "part_rows": args.part_rows, "repeats": args.repeats,
               "write_s": time.perf_counter() - t0, "before": measure(root, args.repeats)}
    t0 = time.perf_counter()
    compact_manifest(RunDir(root))
    results["compact_s"] = time.perf_counter() - t0
    results["after"] = measure(root, args.repeats)
    shutil.rmtree(root, ignore_errors=True)
    write_results(args.out, "results-manifest", results, markdown(results))


if __name__ == "__main__":
    main()
