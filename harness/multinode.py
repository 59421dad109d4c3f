"""A multi-node Ray cluster on this machine, for the scale-out tests and benchmarks: Ray's own
`ray.cluster_utils.Cluster` (a head and worker nodes, each a raylet with its own CPUs and object store) owned by a
process of its own (its own RAY_TMPDIR, so the test process stays joined to the session's cluster), which adds and
removes nodes on request:

    with MultiNodeCluster(head_cpus=1) as cluster:
        a = cluster.add_node(cpus=3)          # node id (hex)
        ... hsx run --address cluster.address ...
        cluster.remove_node(a)                # the node's raylet and every worker on it are gone at once
        cluster.worker_pids(a)                # Ray worker processes of that node (by the raylet's children)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

_OWNER = r"""
import json, sys
import psutil
from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": int(sys.argv[1]), "include_dashboard": False})
nodes = {cluster.head_node.node_id: cluster.head_node}

def workers(node):
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    out = []
    for p in raylet.children(recursive=True):
        try:
            title = (p.cmdline() or [""])[0]
        except psutil.Error:
            continue
        if title.startswith("ray::"):
            out.append([p.pid, title])
    return out

print(json.dumps({"address": cluster.address, "head": cluster.head_node.node_id}), flush=True)
for line in sys.stdin:
    op, *args = line.split()
    if op == "add":
        node = cluster.add_node(num_cpus=int(args[0]))
        cluster.wait_for_nodes()
        nodes[node.node_id] = node
        reply = node.node_id
    elif op == "remove":
        cluster.remove_node(nodes.pop(args[0]), allow_graceful=False)
        reply = args[0]
    elif op == "workers":
        reply = workers(nodes[args[0]])
    else:
        reply = f"unknown command {op}"
    print(json.dumps(reply), flush=True)
cluster.shutdown()
"""


class MultiNodeCluster:
    def __init__(self, head_cpus: int = 1) -> None:
        self.head_cpus = head_cpus

    def __enter__(self) -> MultiNodeCluster:
        # short: Ray's unix sockets live under it (a 107-byte limit)
        self._tmp = tempfile.mkdtemp(prefix="hsx-mn-")
        env = {**os.environ, "RAY_TMPDIR": self._tmp, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        self._proc = subprocess.Popen([sys.executable, "-c", _OWNER, str(self.head_cpus)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=env)
        first = self._proc.stdout.readline()
        if not first:
            self.__exit__(None, None, None)
            raise RuntimeError(f"the multi-node cluster did not start (exit {self._proc.poll()})")
        info = json.loads(first)
        self.address, self.head = info["address"], info["head"]
        return self

    def _ask(self, *words) -> object:
        self._proc.stdin.write(" ".join(str(w) for w in words) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the multi-node cluster's owner ended (exit {self._proc.poll()})")
        return json.loads(line)

    def add_node(self, cpus: int) -> str:
        return self._ask("add", cpus)

    def remove_node(self, node_id: str) -> None:
        self._ask("remove", node_id)

    def worker_pids(self, node_id: str, title: str = "") -> list[int]:
        """Ray worker processes on the node whose process title starts with `title`."""
        return [pid for pid, t in self._ask("workers", node_id) if t.startswith(title)]

    def __exit__(self, *exc) -> None:
        try:
            self._proc.stdin.close()
            self._proc.wait(60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(30)
        finally:
            shutil.rmtree(self._tmp, ignore_errors=True)
