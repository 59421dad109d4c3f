"""Fixtures for the jobs tests: ONE local Ray for the whole session, a head node with a dashboard for the
job-submission test alone, corpus writers, and an independent transformers oracle.

Ray starts once (4-7 s here); every job in these tests runs on it, in-process or as a subprocess driver connected by
address. It has no dashboard: on this 2-core machine the dashboard's agents cost about 1 s of every ~13 s job and
4% of a core while idle. Token auth is off for these test clusters so subprocess drivers and the job API connect
without a token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from harness.corpora import write_jsonl  # noqa: F401 - the fixtures below write corpora

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

RAY_TEST_CPUS = 6


@dataclass(frozen=True)
class RayTestCluster:
    address: str
    """GCS address for `hsx run --address` from a subprocess."""


@pytest.fixture(scope="session")
def ray_cluster() -> RayTestCluster:
    import logging

    import ray

    if ray.is_initialized():
        ray.shutdown()
    ctx = ray.init(num_cpus=RAY_TEST_CPUS, include_dashboard=False, logging_level=logging.WARNING)
    yield RayTestCluster(address=ctx.address_info["gcs_address"])
    ray.shutdown()


_HEAD = """
import sys
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": True,
                                                        "dashboard_host": "127.0.0.1",
                                                        "dashboard_agent_listen_port": int(sys.argv[1])})
print(cluster.head_node.address_info["webui_url"], flush=True)
sys.stdin.read()  # until the test closes it
cluster.shutdown()
"""


@pytest.fixture
def dashboard_url() -> str:
    """http://127.0.0.1:PORT of the job submission API of a head node of its own, started by another process (with
    its own RAY_TMPDIR): the test's process stays joined to the shared cluster, and its address file is not
    touched."""
    import shutil
    import socket
    import subprocess
    import sys
    import tempfile

    with socket.socket() as s:  # the shared cluster's node agent holds Ray's default agent port (52365)
        s.bind(("127.0.0.1", 0))
        agent_port = s.getsockname()[1]
    ray_tmp = tempfile.mkdtemp(prefix="hsx-ray-")  # short: Ray's unix sockets live under it (a 107-byte limit)
    env = {**os.environ, "RAY_TMPDIR": ray_tmp}
    head = subprocess.Popen([sys.executable, "-c", _HEAD, str(agent_port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        url = head.stdout.readline().strip()
        assert url, f"the head node did not start (exit {head.poll()})"
        yield url if url.startswith("http") else f"http://{url}"
    finally:
        head.stdin.close()
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(30)
        shutil.rmtree(ray_tmp, ignore_errors=True)


class Oracle:
    """Hidden states from a plain transformers forward, one sequence at a time: HF's hidden_states[k] for k < N and
    a forward hook on the last decoder layer for id N (HF's own hidden_states[N] is after the final norm)."""

    def __init__(self, model_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.n = self.model.config.num_hidden_layers

    def states(self, token_ids, layer_ids):
        torch = self.torch
        captured = {}
        last = self.model.model.layers[-1]
        handle = last.register_forward_hook(lambda m, a, out: captured.__setitem__(
            "x", out[0] if isinstance(out, tuple) else out))
        try:
            with torch.no_grad():
                hs = self.model(torch.tensor([list(token_ids)]), output_hidden_states=True).hidden_states
        finally:
            handle.remove()
        rows = [captured["x"][0] if i == self.n else hs[i][0] for i in layer_ids]
        return torch.stack(rows, dim=1)  # [T, L, H]


@pytest.fixture(scope="session")
def oracle_factory():
    cache: dict[str, Oracle] = {}

    def get(model_dir: str) -> Oracle:
        if model_dir not in cache:
            cache[model_dir] = Oracle(model_dir)
        return cache[model_dir]

    return get


def wait_for_file(path, proc=None, seconds: float = 240) -> None:
    """Until `path` exists; fails with `proc`'s stderr if it exits first (a subprocess driver), or after `seconds`."""
    import time

    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc is None or proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, f"no {path} within {seconds} s"
        time.sleep(0.05)
