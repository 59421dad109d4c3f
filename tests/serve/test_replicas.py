"""Two engine replicas on the server's local Ray (the shared server of tests/serve): both serve; killing one
replica's process mid-load loses no acknowledged file (requests in flight on it fail with 5xx, none answers a path
to a missing file); SIGTERM drains the requests in flight (their files durable, their answers sent), refuses new
ones, and exits 0. The SIGTERM test stops the shared server: it is the package's last test."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import requests

from connectors import load_hidden_states

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def engine_pids(server) -> list[int]:
    procs = psutil.Process(server.proc.pid).children(recursive=True)
    return [p.pid for p in procs if any("ServeReplica:hsx:Engine" in part for part in _cmdline(p))]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def busy_replicas(server) -> list[str]:
    """Replicas that have run batches (hsx_serve_batches_total{replica=...} > 0)."""
    return [k for k, v in server.metrics().items() if k.startswith("hsx_serve_batches_total") and v > 0]


def completion(server, i: int, **fields) -> dict:
    return {"model": server.model, "prompt": [4 + i % 300, 8, 15, 16 + i % 7], "max_tokens": 4, "temperature": 0,
            "return_token_ids": True, "kv_transfer_params": {"include_output_tokens": True}, **fields}


def test_killing_one_replica_mid_load_loses_no_acknowledged_file(server):
    pids = engine_pids(server)
    assert len(pids) == 2, pids
    results: list[tuple[float, int, dict]] = []
    stop = threading.Event()
    counter = iter(range(10**6))
    lock = threading.Lock()

    def load():
        while not stop.is_set():
            with lock:
                i = next(counter)
            body = completion(server, i)
            try:
                r = server.post("/v1/completions", body, timeout=60)
                results.append((time.monotonic(), r.status_code, r.json()))
            except requests.RequestException as e:  # a dropped connection acknowledges nothing either
                results.append((time.monotonic(), -1, {"error": str(e)}))

    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # both replicas serving (the second may still be loading at first)
            if sum(1 for _, s, _ in results if s == 200) >= 24 and len(busy_replicas(server)) >= 2:
                break
            time.sleep(0.2)
        assert len(busy_replicas(server)) == 2, server.metrics()
        killed_at = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        while sum(1 for t, s, _ in results if s == 200 and t > killed_at + 1) < 24 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(120)

    ok = [body for _, s, body in results if s == 200]
    failed = [(s, body) for _, s, body in results if s != 200]
    assert all(s >= 500 or s == -1 for s, _ in failed), failed[:3]
    assert any(t > killed_at + 1 and s == 200 for t, s, _ in results), "the surviving replica served nothing"
    for body in ok:  # every acknowledged file is there, complete, and holds its own request's tokens
        choice = body["choices"][0]
        obj = load_hidden_states(body["kv_transfer_params"]["hidden_states_path"], verify=True)
        assert obj["token_ids"].tolist() == choice["prompt_token_ids"] + choice["token_ids"][:-1]
    lost = [body for s, body in failed if s == 503]
    assert all(b["error"]["code"] in ("replica_lost", "queue_full") for b in lost), lost[:3]


def test_sigterm_drains_requests_in_flight_then_exits(server):
    answers: list[requests.Response] = []

    def long_request(i: int) -> None:
        answers.append(server.post("/v1/completions", completion(server, i, max_tokens=400, ignore_eos=True),
                                       timeout=120))

    threads = [threading.Thread(target=long_request, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while server.metrics().get("hsx_serve_queue_depth", 0) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metrics()["hsx_serve_queue_depth"] == 6
    server.proc.send_signal(signal.SIGTERM)

    refused = None
    while refused is None and any(t.is_alive() for t in threads):
        try:
            r = server.get("/health", key=None, timeout=5)
        except requests.RequestException:
            break
        if r.status_code == 503:
            refused = server.post("/v1/completions", completion(server, 999))
        time.sleep(0.05)
    for t in threads:
        t.join(120)
    assert server.proc.wait(90) == 0
    assert [a.status_code for a in answers] == [200] * 6
    for a in answers:
        body = a.json()
        path = body["kv_transfer_params"]["hidden_states_path"]
        assert not os.path.exists(path + ".lock")
        assert load_hidden_states(path, verify=True)["token_ids"].numel() == 4 + 400 - 1
    assert refused is not None, "the server never reported draining while requests were in flight"
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert refused.headers["Retry-After"] == "1"
