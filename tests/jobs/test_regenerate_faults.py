"""`hsx regenerate` through faults, each ending with every input exactly once: one of two servers killed mid-run (its
requests move to the other), the driver killed -9 (a re-run skips what was committed and regenerates the rest, the
uncommitted part it left is removed), and the only server killed and restarted mid-run (requests wait for it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.compute as pc
import pytest

from connectors.manifest import OK, committed_rows, live_manifest_parts, read_manifest, referenced_paths
from connectors.run import RunDir
from harness.serving import API_KEY, ServeProcess

pytestmark = pytest.mark.slow
N = 300


def parts(out) -> int:
    return len(live_manifest_parts(str(out))) if os.path.isdir(os.path.join(out, "manifest")) else 0


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def kill_and_wait_port(server: ServeProcess) -> None:
    """Kill a server; return once nothing listens on its port (its Ray proxy outlives the process group a moment)."""
    import socket

    server.kill()
    free_since = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as s:
            listening = s.connect_ex(("127.0.0.1", server.port)) == 0
        if listening:
            free_since = None
        elif free_since is None:
            free_since = time.monotonic()
        elif time.monotonic() - free_since > 2:
            return
        time.sleep(0.1)
    raise AssertionError(f"port {server.port} still answers after the server was killed")


def driver(out, corpus, log, *servers) -> subprocess.Popen:
    argv = [sys.executable, "-m", "cli", "regenerate", "--corpus", corpus, "--output", str(out), "--max-tokens", "6",
            "--concurrency", "1", "--flush-rows", "8", "--flush-seconds", "1", "--no-progress"]
    for s in servers:
        argv += ["--server", s]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "HSX_REGENERATE_API_KEY": API_KEY})


def test_killed_servers_and_a_killed_driver_leave_every_input_exactly_once(server, serve_model, tmp_path):
    corpus = tmp_path / "prompts.jsonl"
    with open(corpus, "w") as f:
        for i in range(N):
            f.write(json.dumps({"id": f"s{i:04d}", "prompt": f"sample {i}: the quick brown fox jumps over"}) + "\n")
    out = tmp_path / "regenerated"
    log = open(tmp_path / "driver.log", "w+")
    b = ServeProcess(serve_model, str(tmp_path / "b-out"), str(tmp_path / "b.log"), replicas=1)
    port = b.port
    try:
        # two servers; B killed -9 mid-run: A carries on; then the driver killed -9 mid-run
        first = driver(out, str(corpus), log, server.url, b.url)
        wait_for(lambda: parts(out) >= 2, 120, "the first commits")
        kill_and_wait_port(b)
        seen = parts(out)
        wait_for(lambda: parts(out) >= seen + 3, 120, "commits after server B died")
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
        table = read_manifest(str(out))
        done_first = committed_rows(table).num_rows
        assert 0 < done_first < N
        assert table.num_rows == done_first  # nothing failed: B's requests moved to A

        # the same regeneration on B alone (restarted); B killed -9 and restarted mid-run: requests wait for it
        b = ServeProcess(serve_model, str(tmp_path / "b-out"), str(tmp_path / "b.log"), replicas=1, port=port)
        second = driver(out, str(corpus), log, b.url)
        seen = parts(out)
        wait_for(lambda: parts(out) >= seen + 1, 120, "a commit of the second run")
        kill_and_wait_port(b)
        b = ServeProcess(serve_model, str(tmp_path / "b-out"), str(tmp_path / "b.log"), replicas=1, port=port)
        assert second.wait(300) == 0, open(tmp_path / "driver.log").read()[-3000:]
    finally:
        b.kill()
    log.seek(0)
    text = log.read()
    assert f"skipped (already done) of {N} records" in text, text[-3000:]
    summary = [line for line in text.splitlines() if line.startswith("hsx regenerate resumed and finished")][-1]
    ok, failed, skipped = (int(summary.split(": ")[1].split(" ok")[0]), int(summary.split(", ")[1].split(" ")[0]),
                           int(summary.split(", ")[2].split(" ")[0]))
    assert (failed, skipped, ok + skipped) == (0, done_first, N), summary
    table = read_manifest(str(out))
    ids = table.filter(pc.equal(table["status"], OK))["sample_id"].to_pylist()
    assert sorted(ids) == [f"s{i:04d}" for i in range(N)]  # every input exactly once, all ok
    data = sorted(f"data/{n}" for n in os.listdir(out / "data"))
    assert data == sorted(referenced_paths(RunDir(str(out)), "data/"))  # the killed driver's orphan part is gone
    status = subprocess.run([sys.executable, "-m", "cli", "status", str(out)], capture_output=True, text=True)
    assert f"{N} ok, 0 failed ({N} tried)" in status.stdout, status.stdout + status.stderr


def test_run_regenerate_with_killed_then_rerun_ends_with_every_sample_once_in_both(server, serve_model, tmp_path):
    """hsx run --regenerate-with killed -9 mid-run: the same command again finishes both the regeneration and the
    extraction, each input once in each."""
    n = 100
    corpus = tmp_path / "prompts.jsonl"
    with open(corpus, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"r{i:03d}", "prompt": f"record {i}: once upon a time"}) + "\n")
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "cli", "run", "--model", serve_model, "--corpus", str(corpus), "--output", str(out),
            "--layers", "1,4", "--no-progress", "--no-compact", "--manifest-flush-rows", "4", "--tokens-per-task", "48",
            "--manifest-flush-seconds", "1", "--regenerate-with", server.url,
            "--regenerate", json.dumps({"max_tokens": 4, "concurrency": 1, "flush_rows": 4})]
    env = {**os.environ, "HSX_REGENERATE_API_KEY": API_KEY}
    log = open(tmp_path / "run.log", "w+")
    first = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_for(lambda: parts(out) >= 1, 240, "the extraction's first commit")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
    regenerated_first = committed_rows(read_manifest(str(out / "regenerated"))).num_rows
    extracted_first = committed_rows(read_manifest(str(out))).num_rows
    assert 0 < extracted_first <= regenerated_first and extracted_first < n
    second = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    for folder in (out / "regenerated", out):
        table = read_manifest(str(folder))
        ids = table.filter(pc.equal(table["status"], OK))["sample_id"].to_pylist()
        assert sorted(ids) == [f"r{i:03d}" for i in range(n)], folder  # each once, all ok
    assert f"skipped (already done) of {n} records" in second.stdout, second.stdout
