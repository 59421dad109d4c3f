"""The sample registry at scale (issue 26): 10M synthetic ids claimed through the real shard actors on a local Ray,
the peak RSS of every process, against the registry as it was (a dict of 16-byte digests to source strings); and
the resume set of a large manifest loaded.

    python benchmarks/bench_registry.py --ids 10000000 --out bench-out
    python benchmarks/bench_registry.py --ids 1000000 --resume-rows 1000000 --out bench-out     # quicker

1. --ids ids "corpus/part-NNN.jsonl:LINE" in blocks of --block, each through corpus.sample_registry.claim_block (what a read
   task calls: keys hashed in the caller, one call per shard); after every tenth of them the RSS of the driver and
   of each shard actor (its process found by its pid), and at the end each one's peak (VmHWM).
2. The old registry's memory for --old-ids ids, measured in this process: {blake2b-16 digest: source} as it was.
3. --resume-rows rows written as a manifest (parts of 100k rows), compacted, then DoneSet.load timed: what a resume
   of such a run holds in the driver (8 bytes an id).
Never pass/fail.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import rss, status_kb, write_results  # noqa: E402


def shard_pids(shards) -> list[int]:
    import ray

    return ray.get([s.__ray_call__.remote(lambda self: os.getpid()) for s in shards])


def old_registry_bytes(n: int) -> float:
    """RSS growth of the registry as it was (corpus/sample_registry.py before issue 26) holding n ids, per id."""
    import gc

    gc.collect()
    before = rss()
    claimed = {hashlib.blake2b(f"sharegpt-{i:09d}".encode(), digest_size=16).digest():
               f"corpus/part-{i // 100000:03d}.jsonl:{i}" for i in range(n)}
    grown = rss() - before
    del claimed
    return grown / n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", type=int, default=10_000_000)
    ap.add_argument("--block", type=int, default=10_000)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--old-ids", type=int, default=1_000_000)
    ap.add_argument("--resume-rows", type=int, default=10_000_000)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from corpus.sample_registry import DoneSet, claim_block, start_registry

    results = {"ids": args.ids, "shards": args.shards, "block": args.block, "samples": []}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        shards = start_registry(DoneSet(), args.shards)
        pids = shard_pids(shards)
        base = {pid: status_kb("VmRSS", pid) for pid in pids}
        results["driver_rss_before_mb"] = rss() / 2**20
        start, step = time.perf_counter(), max(args.ids // 10, args.block)
        for lo in range(0, args.ids, args.block):
            hi = min(args.ids, lo + args.block)
            ids = [f"sharegpt-{i:09d}" for i in range(lo, hi)]
            verdicts = claim_block(shards, ids, [f"corpus/part-{i // 100000:03d}.jsonl:{i}" for i in range(lo, hi)])
            assert not any(verdicts)
            if hi % step == 0 or hi == args.ids:
                results["samples"].append({"ids": hi, "seconds": time.perf_counter() - start,
                                           "driver_rss_mb": rss() / 2**20,
                                           "shard_rss_mb": [status_kb("VmRSS", p) / 2**20 for p in pids]})
                print(results["samples"][-1], flush=True)
        results["claim_seconds"] = time.perf_counter() - start
        results["shard_peak_mb"] = [status_kb("VmHWM", p) / 2**20 for p in pids]
        results["shard_growth_mb_per_million"] = [(status_kb("VmHWM", p) - base[p]) / 2**20 / (args.ids / 1e6)
                                                  for p in pids]
        results["stats"] = {k: sum(s[k] for s in ray.get([x.stats.remote() for x in shards]))
                            for k in ("claimed", "table_bytes")}
    finally:
        ray.shutdown()
    results["driver_peak_mb"] = status_kb("VmHWM") / 2**20
    results["old_registry_bytes_per_id"] = old_registry_bytes(args.old_ids)
    if args.resume_rows:
        from benchmarks.bench_manifest import write_run
        from connectors.manifest import compact_manifest
        from connectors.run import RunDir

        root = os.path.join(args.out, "scratch-registry-resume")
        shutil.rmtree(root, ignore_errors=True)
        write_run(root, args.resume_rows, 100_000)
        compact_manifest(RunDir(root))
        before = rss()
        t0 = time.perf_counter()
        done = DoneSet.load(RunDir(root))
        results["resume_load_seconds"] = time.perf_counter() - t0
        results["resume_rows"] = len(done)
        results["resume_driver_growth_mb"] = (rss() - before) / 2**20
        shutil.rmtree(root, ignore_errors=True)
    lines = [f"# Sample registry: {args.ids:,} ids, {args.shards} shards", "",
             f"claimed in {results['claim_seconds']:.0f} s ({args.ids / results['claim_seconds']:,.0f} ids/s, blocks of "
             f"{args.block:,}); table bytes {results['stats']['table_bytes'] / 2**20:,.0f} MB in all",
             f"shard peak RSS: {', '.join(f'{m:,.0f}' for m in results['shard_peak_mb'])} MB; growth per million ids: "
             f"{', '.join(f'{g:.1f}' for g in results['shard_growth_mb_per_million'])} MB (target <= 20)",
             f"driver peak RSS {results['driver_peak_mb']:,.0f} MB",
             f"the registry as it was: {results['old_registry_bytes_per_id']:.0f} bytes per id in one process "
             f"({results['old_registry_bytes_per_id']:.0f} MB per million)"]
    if args.resume_rows:
        lines.append(f"resume set of a {args.resume_rows:,}-row compacted manifest: {results['resume_load_seconds']:.1f} s, "
                     f"{results['resume_driver_growth_mb']:,.0f} MB in the driver after loading")
    write_results(args.out, "results-registry", results, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
