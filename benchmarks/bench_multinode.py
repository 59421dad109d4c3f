"""A job on a multi-node Ray cluster on this machine (issue 26): what losing a node costs.

    python benchmarks/bench_multinode.py --out bench-out                 # 600 samples, ~5 minutes on 2 cores
    python benchmarks/bench_multinode.py --out bench-out --samples 2000

Ray's own `ray.cluster_utils.Cluster` (harness/multinode.py: a head with 1 CPU and two worker nodes of 3, each a
raylet of its own) runs the same `hsx run --address ... --workers 2 --cpus-per-worker 2` three times on a fresh
output, a tiny model built locally and a corpus of --samples prompts:
    one node      one worker node only (--workers 1): the baseline
    two nodes     a worker on each node
    node lost     two nodes, one removed (its raylet and every process on it, at once) once --lose-at of the samples
                  are committed: the job finishes on the node left
Each run ends checked: one "ok" row and one complete file per sample, no other file. Reported: wall seconds, samples/s
and what the lost node cost against the two-node run. On one machine the nodes share its cores, so two nodes are
not faster than one here (the GPU figure is a run on real nodes); the cost of the loss is the figure this measures.
Never pass/fail.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow.compute as pc  # noqa: E402

from benchmarks.common import write_results  # noqa: E402
from connectors.manifest import ok_rows, read_manifest  # noqa: E402
from connectors.run import RunDir  # noqa: E402
from harness.corpora import word_corpus  # noqa: E402
from harness.multinode import MultiNodeCluster  # noqa: E402
from reference.tiny_models import build_tiny_model  # noqa: E402

WORKER = "ray::MapWorker(MapBatches(ExtractionWorker))"


def run(cluster, model: str, corpus: str, output: str, workers: int, lose_at: float | None, total: int) -> dict:
    args = [sys.executable, "-m", "cli", "run", "--model", model, "--corpus", corpus, "--output", output,
            "--address", cluster.address, "--workers", str(workers), "--cpus-per-worker", "2",
            "--tokens-per-task", "256", "--manifest-flush-rows", "16", "--no-progress"]
    started = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lost_at = None
    if lose_at is not None:
        while proc.poll() is None:
            if RunDir(output).exists("manifest") and read_manifest(output, ["status"]).num_rows >= lose_at * total:
                node = next(n for n in cluster.workers_nodes if cluster.worker_pids(n, WORKER))
                cluster.remove_node(node)
                cluster.workers_nodes.remove(node)
                lost_at = time.perf_counter() - started
                break
            time.sleep(0.1)
    out, err = proc.communicate()
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"hsx run failed ({proc.returncode}):\n{err[-3000:]}")
    committed = ok_rows(output)
    files = [p for p in Path(output, "data").rglob("*.safetensors")]
    assert committed.num_rows == total == len(files), (committed.num_rows, total, len(files))
    return {"wall_s": wall, "samples_per_s": total / wall, "node_lost_at_s": lost_at,
            "summary": next((line for line in out.splitlines() if " ok, " in line), "")}


def markdown(r: dict) -> str:
    lines = ["# A job on a multi-node Ray cluster (one machine)", "",
             f"{r['samples']} samples ({r['tokens']:,} tokens), a tiny Llama; head 1 CPU + worker nodes of 3 CPUs, "
             f"one extraction worker (2 CPUs) per node; {os.cpu_count()} cores shared by all nodes.", "",
             "| run | wall s | samples/s | node removed at |", "|---|---:|---:|---:|"]
    for name in ("one node", "two nodes", "node lost"):
        m = r[name]
        at = f"{m['node_lost_at_s']:.1f} s" if m["node_lost_at_s"] is not None else ""
        lines.append(f"| {name} | {m['wall_s']:.1f} | {m['samples_per_s']:.1f} | {at} |")
    cost = r["node lost"]["wall_s"] - r["two nodes"]["wall_s"]
    lines += ["", f"Losing a node at {r['lose_at']:.0%} of the samples cost {cost:+.1f} s against the two-node run "
                  f"({r['node lost']['wall_s'] / r['two nodes']['wall_s']:.2f}x its time); every run ended with one ok "
                  "row and one file per sample.", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--lose-at", type=float, default=0.3, help="fraction of samples committed when a node is removed")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="hsx-bench-multinode-")
    try:
        model = build_tiny_model("llama", os.path.join(work, "model"))
        corpus, _ = word_corpus(Path(work), args.samples)
        results = {"samples": args.samples, "lose_at": args.lose_at}
        for name, nodes, lose in (("one node", 1, None), ("two nodes", 2, None), ("node lost", 2, args.lose_at)):
            with MultiNodeCluster(head_cpus=1) as cluster:
                cluster.workers_nodes = [cluster.add_node(cpus=3) for _ in range(nodes)]
                results[name] = run(cluster, model, corpus, os.path.join(work, name.replace(" ", "-")), nodes,
                                    lose, args.samples)
                print(name, results[name], flush=True)
        results["tokens"] = int(pc.sum(ok_rows(os.path.join(work, "one-node"))["num_tokens"]).as_py())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_results(args.out, "results-multinode", results, markdown(results))


if __name__ == "__main__":
    main()
