"""The fault-injection matrix: one `hsx run --address` on a multi-node Ray cluster on this machine (a head with no
room for a worker, two worker nodes of 3 CPUs: one extraction worker each) meets one fault mid-job, and ends — by
itself, or resumed by the same command — with every sample exactly once: one "ok" row, one complete file, no other.

    worker killed       kill -9 of an extraction worker: Ray restarts it, its blocks are re-run
    node lost           a worker node's raylet and every process on it gone at once, no replacement
    storage outage      every request to the output's S3 store answered 503 for 30 s (a loopback proxy in front of
                        moto): writes, read-backs and manifest commits wait it out (--storage-retry-seconds)
    driver killed       kill -9 of `hsx run` itself: the re-run skips what was committed and does the rest

The cluster lives for the module (harness/multinode.py); each case gets (at least) two live worker nodes. Last, a
node added mid-job gets a worker of a growing pool (--max-workers) and does part of the work: what an autoscaling
cluster relies on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from connectors.manifest import read_manifest
from harness.corpora import word_corpus
from harness.http_proxy import LoopbackProxy
from harness.multinode import MultiNodeCluster
from tests.jobs.test_job import assert_exactly_once

pytestmark = [pytest.mark.ray, pytest.mark.slow]

WORKER = "ray::MapWorker(MapBatches(ExtractionWorker))"
OUTAGE_S = 30.0
FAULTS = ["worker killed", "node lost", "storage outage", "driver killed"]


@pytest.fixture(scope="module")
def cluster(s3_server):  # s3_server first: its credentials are in the environment the nodes' workers inherit
    with MultiNodeCluster(head_cpus=1) as c:
        c.workers_nodes = []
        yield c


def two_worker_nodes(cluster) -> None:
    while len(cluster.workers_nodes) < 2:
        cluster.workers_nodes.append(cluster.add_node(cpus=3))


def nodes_with_workers(cluster) -> list[str]:
    return [n for n in cluster.workers_nodes if cluster.worker_pids(n, WORKER)]


def start_job(cluster, tiny_llama, corpus, output, *extra) -> subprocess.Popen:
    args = ["--model", tiny_llama, "--corpus", corpus, "--output", output, "--workers", "2", "--cpus-per-worker", "2",
            "--tokens-per-task", "64", "--manifest-flush-rows", "8", "--no-progress", *extra]
    return subprocess.Popen([sys.executable, "-m", "cli", "run", *args, "--address", cluster.address],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def committed(output, options) -> int:
    table = read_manifest(output, ["status"], storage_options=options)
    return table.num_rows


def wait_for(proc, until, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended before {what}: exit {proc.returncode}\n{proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def finish(proc, timeout: float = 400) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-2000:]}\n{err[-4000:]}"
    return out


@pytest.mark.parametrize("fault", FAULTS)
def test_a_job_that_meets_a_fault_ends_with_every_sample_exactly_once(fault, cluster, tiny_llama, s3_bucket,
                                                                       tmp_path):
    two_worker_nodes(cluster)
    corpus, ids = word_corpus(tmp_path, 160)
    output, options, direct, extra, proxy = str(tmp_path / "out"), None, None, [], None
    if fault == "storage outage":
        url, direct = s3_bucket  # `direct` reaches moto itself, not through the proxy
        proxy = LoopbackProxy(direct["client_kwargs"]["endpoint_url"]).__enter__()
        proxy.targets = lambda method, path: True  # every request: reads, writes, listings
        options = {"client_kwargs": {"endpoint_url": proxy.endpoint}, "skip_instance_cache": True}
        output, extra = f"{url}/run", ["--storage-options", json.dumps(options)]
    try:
        proc = start_job(cluster, tiny_llama, corpus, output, *extra)
        wait_for(proc, lambda: len(nodes_with_workers(cluster)) == 2 and committed(output, direct) >= 8,
                 "a worker on each of two nodes and committed rows")
        a = nodes_with_workers(cluster)[0]
        if fault == "worker killed":
            os.kill(cluster.worker_pids(a, WORKER)[0], signal.SIGKILL)
        elif fault == "node lost":
            cluster.remove_node(a)
            cluster.workers_nodes.remove(a)
        elif fault == "storage outage":
            proxy.fail_next = -1
            threading.Timer(OUTAGE_S, lambda: setattr(proxy, "fail_next", 0)).start()
        elif fault == "driver killed":
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        at_fault, started = committed(output, direct), time.monotonic()
        assert at_fault < len(ids), "the fault landed after the job's work was done"
        if fault == "driver killed":
            proc.stdout.close()
            proc.stderr.close()
            proc = start_job(cluster, tiny_llama, corpus, output, *extra)  # the same command, again
        out = finish(proc)
        if fault == "storage outage":
            assert time.monotonic() - started >= OUTAGE_S * 0.9 and proxy.injected_failures > 0
        assert " 0 failed" in out, out
    finally:
        if proxy is not None:
            proxy.__exit__(None, None, None)
    if direct is not None:  # one client for the checks (a fresh one per call costs ~0.5 s here)
        direct = {k: v for k, v in direct.items() if k != "skip_instance_cache"}
    assert_exactly_once(output, ids, direct)
    statuses = read_manifest(output, ["status"], storage_options=direct).column("status").to_pylist()
    assert set(statuses) == {"ok"}  # nothing failed on the way: the fault cost time, not samples


def test_a_node_added_mid_job_gets_a_worker_of_a_growing_pool(cluster, tiny_llama, tmp_path):
    two_worker_nodes(cluster)
    cluster.remove_node(cluster.workers_nodes.pop())  # room for one worker: the pool starts at --workers 1
    corpus, ids = word_corpus(tmp_path, 320)
    output = str(tmp_path / "out")
    proc = start_job(cluster, tiny_llama, corpus, output, "--workers", "1", "--max-workers", "2")
    wait_for(proc, lambda: nodes_with_workers(cluster) and committed(output, None) >= 8, "the first worker's rows")
    # The first worker is paused (SIGSTOP) while the node is added, so the job cannot finish before the pool grows
    # (on 2 busy cores it once did), and rows committed while it is paused are the added worker's: work spreads to it.
    # It goes on (SIGCONT) once they are there.
    first = cluster.worker_pids(cluster.workers_nodes[0], WORKER)[0]
    os.kill(first, signal.SIGSTOP)
    try:
        at_pause = committed(output, None)
        added = cluster.add_node(cpus=3)
        cluster.workers_nodes.append(added)
        wait_for(proc, lambda: cluster.worker_pids(added, WORKER), "a worker on the added node")
        # a margin over what the driver may still hold of the paused worker's output (flushes of 8 rows, blocks of
        # 64 tokens)
        wait_for(proc, lambda: committed(output, None) >= at_pause + 40, "rows from the added node's worker")
    finally:
        os.kill(first, signal.SIGCONT)
    out = finish(proc)
    assert " 0 failed" in out, out
    assert_exactly_once(output, ids)
