"""`hsx serve --address` on an existing Ray cluster (a real head node from ray.cluster_utils, started by the test):
the real CLI serves the official openai client there (files checked against a plain transformers forward), and on
SIGTERM exits 0 leaving the cluster as it found it (alive, every CPU free, no `hsx` application, Serve stopped only
because hsx had started it). Clear exit-2 errors, fast: an address where no Ray answers; a second hsx on a cluster
whose Serve listens elsewhere or already runs `hsx`. A cluster too small for the replicas is a warning (it may
autoscale), SIGTERM stops the wait, and a Serve another driver started is left running.

Cluster state is read by other driver processes (`Observer`, `fresh_driver_state`), never by the process under test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import requests
import torch

from cli.main import main
from connectors import load_hidden_states
from harness.serving import LAYERS, ServeProcess, free_port
from tests.extractor.oracle import load_reference, reference_states

CLUSTER_CPUS = 3

_OBSERVER = textwrap.dedent("""
    import json, sys, time
    import ray
    from ray import serve
    from ray.serve import context
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)  # stdout: the answers alone
    print("{}", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        context._disconnect()  # no cached client: ask the cluster whether a Serve controller runs now
        if command == "serve":  # start Serve here, as another user of the cluster would, and leave it running
            serve.start(http_options={"host": "127.0.0.1", "port": int(args[0])})
        deadline = time.monotonic() + (15 if command in ("settled", "quit") else 0)  # ended actors free their CPUs shortly
        while ray.available_resources().get("CPU") != ray.cluster_resources().get("CPU") and time.monotonic() < deadline:
            time.sleep(0.2)
        client = context._get_global_client(raise_if_no_controller_running=False)
        print(json.dumps({"cpus": ray.cluster_resources().get("CPU"), "free_cpus": ray.available_resources().get("CPU"),
                          "apps": sorted(serve.status().applications) if client else None,
                          "http": [client.http_config.host, client.http_config.port] if client else None}), flush=True)
        if command == "quit":
            break
""")


class Observer:
    """Another driver on the cluster, in its own process: state() -> its CPUs (total, free; settled=True waits up to
    15 s for all to be free), Serve's applications (None = no Serve running) and Serve's HTTP [host, port]."""

    def __init__(self, address: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _OBSERVER, address], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "{}", "the observer could not connect"

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the observer died (exit {self.proc.poll()})"
        return json.loads(line)

    def state(self, settled: bool = False) -> dict:
        return self.ask("settled" if settled else "now")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


def fresh_driver_state(address: str) -> dict:
    """The settled state as a brand-new driver process sees it: it connecting at all shows the cluster is alive."""
    r = subprocess.run([sys.executable, "-c", _OBSERVER, address], input="quit\n", capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cluster():
    """A real Ray head node (its own GCS and raylet processes) that hsx did not start: CLUSTER_CPUS logical CPUs."""
    from ray.cluster_utils import Cluster

    # Serve's controller (started on this cluster by the first hsx) tries a failing replica constructor once, not 3
    # times: test_replicas_that_fail_to_start_... waits for it to give up. Set before the raylet starts its workers.
    retries = os.environ.get("RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT")
    os.environ["RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT"] = "1"
    try:
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": CLUSTER_CPUS, "include_dashboard": False})
    finally:
        if retries is None:
            os.environ.pop("RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT")
        else:
            os.environ["RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT"] = retries
    try:
        yield c.address
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def observer(cluster):
    obs = Observer(cluster)
    yield obs
    obs.close()


def hsx_serve(model: str, out, *flags: str) -> subprocess.Popen:
    """The `hsx` console script's entry point (cli.main:main) in its own process."""
    argv = [sys.executable, "-c", "import sys; from cli.main import main; sys.exit(main())", "serve",
            "--model", model, "--output", str(out / "files"),
            "--layers", ",".join(map(str, LAYERS)), *flags]
    log = open(out / "serve.log", "wb")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={k: v for k, v in os.environ.items() if k != "HSX_API_KEY"},
                            start_new_session=True)


def wait_for_log(out, needle: str, proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = (out / "serve.log").read_text(errors="replace")
        if needle in text:
            return text
        assert proc.poll() is None, f"hsx serve exited with {proc.returncode}:\n{text[-4000:]}"
        time.sleep(0.25)
    raise AssertionError(f"{needle!r} not in the log after {timeout_s}s:\n{text[-4000:]}")


def test_address_where_no_ray_answers_exits_2_fast(serve_model, tmp_path, capsys):
    closed = free_port()  # nothing listens there
    with socket.socket() as listener:  # something listens, but it is not Ray (a dashboard port, a web server)
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        for address, needle in ((f"127.0.0.1:{closed}", "cannot connect to a Ray cluster there"),
                                (f"ray://127.0.0.1:{closed}", "cannot connect to a Ray cluster there"),
                                (f"127.0.0.1:{listener.getsockname()[1]}", "something listens there but it is not Ray")):
            start = time.monotonic()
            with pytest.raises(SystemExit) as e:
                main(["serve", "--model", serve_model, "--output", str(tmp_path / "out"), "--address", address])
            err = capsys.readouterr().err
            assert e.value.code == 2, err
            assert f"--address {address}: {needle}" in err and "leave --address out" in err, err
            assert "Traceback" not in err, err
            assert time.monotonic() - start < 15, f"{address}: took {time.monotonic() - start:.1f}s"
    # and when this process is connected to a Ray already (another test's, a notebook's): the dead address is still
    # refused, not silently replaced by the session's Ray (where hsx would serve until killed)
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, logging_level="WARNING")
    try:
        with pytest.raises(SystemExit) as e:
            main(["serve", "--model", serve_model, "--output", str(tmp_path / "out"), "--address",
                  f"127.0.0.1:{closed}"])
        assert e.value.code == 2 and "cannot connect to a Ray cluster there" in capsys.readouterr().err
    finally:
        if started:
            ray.shutdown()


EMPTY = {"cpus": CLUSTER_CPUS, "free_cpus": CLUSTER_CPUS, "apps": None, "http": None}  # no Serve, every CPU free


@pytest.fixture(scope="module")
def hsx_on_cluster(cluster, observer, serve_model, tmp_path_factory):
    """`hsx serve --address CLUSTER` with one replica, on a cluster where Serve does not run yet."""
    assert observer.state(settled=True) == EMPTY
    out = tmp_path_factory.mktemp("on-cluster")
    server = ServeProcess(serve_model, str(out / "files"), str(out / "serve.log"), address=cluster, replicas=1,
                          max_num_seqs=4)
    yield server
    server.kill()


@pytest.mark.ray
@pytest.mark.slow
def test_serves_on_an_existing_cluster(hsx_on_cluster, observer, serve_model):
    server = hsx_on_cluster
    ids = [17, 250, 3, 99, 480, 12, 7]
    r = server.client().completions.create(model=serve_model, prompt=ids, max_tokens=1,
                                           extra_body={"return_token_ids": True})
    path = r.kv_transfer_params["hidden_states_path"]
    assert r.choices[0].prompt_token_ids == ids and path.startswith(server.output), r
    assert os.path.exists(path) and not os.path.exists(path + ".lock")
    obj = load_hidden_states(path, verify=True)
    assert obj["token_ids"].tolist() == ids
    torch.testing.assert_close(obj["hidden_states"], reference_states(load_reference(serve_model), ids, LAYERS),
                               rtol=1e-4, atol=1e-4)
    # the replica runs on that cluster (not on a private Ray), with Serve listening where hsx said
    state = observer.state()
    assert state == {"cpus": CLUSTER_CPUS, "free_cpus": CLUSTER_CPUS - 1, "apps": ["hsx"],
                     "http": ["127.0.0.1", server.port]}, state


@pytest.mark.ray
@pytest.mark.slow
def test_a_second_hsx_is_refused_without_touching_the_first(hsx_on_cluster, cluster, serve_model, tmp_path):
    """Serve keeps its HTTP address (serve.start only logs a warning) and serve.run would replace an app of the
    same name: hsx refuses both, naming the address to use or the application in the way."""
    server = hsx_on_cluster
    other_port = free_port()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    elsewhere = hsx_serve(serve_model, tmp_path / "a", "--address", cluster, "--port", str(other_port))
    same_port = hsx_serve(serve_model, tmp_path / "b", "--address", cluster, "--port", str(server.port))
    assert elsewhere.wait(90) == 2 and same_port.wait(90) == 2
    log = (tmp_path / "a" / "serve.log").read_text()
    assert f"Ray Serve already runs on this cluster with HTTP on 127.0.0.1:{server.port}" in log, log
    assert f"pass --host 127.0.0.1 --port {server.port} to serve there" in log and "Traceback" not in log, log
    log = (tmp_path / "b" / "serve.log").read_text()
    assert "already runs an application named 'hsx'" in log and "Traceback" not in log, log
    assert "--name hsx-2 --route-prefix /hsx-2" in log, log
    r = server.client().completions.create(model=serve_model, prompt=[5, 6, 7], max_tokens=0)  # the first serves on
    assert os.path.exists(r.kv_transfer_params["hidden_states_path"])


@pytest.mark.ray
@pytest.mark.slow
def test_a_second_hsx_with_its_own_name_and_route_prefix_serves_beside_the_first(hsx_on_cluster, cluster, observer,
                                                                                 serve_model, tmp_path):
    """Two targets on one cluster: --name and --route-prefix give the second its own application under /b on the
    same HTTP address; stopping it removes only its own application."""
    server = hsx_on_cluster
    second = ServeProcess(serve_model, str(tmp_path / "files"), str(tmp_path / "serve.log"), port=server.port,
                          address=cluster, name="hsx-b", route_prefix="/b", max_num_seqs=4)
    try:
        assert observer.state()["apps"] == ["hsx", "hsx-b"]
        # /health answers once an engine replica does, a moment before hsx sees the application RUNNING and says so
        wait_for_log(tmp_path, f"on http://127.0.0.1:{server.port}/b (", second.proc, 60)
        ids = [21, 8, 300, 4]
        for s, root in ((second, second.output), (server, server.output)):  # each answers under its own prefix
            r = s.client().completions.create(model=serve_model, prompt=ids, max_tokens=0)
            path = r.kv_transfer_params["hidden_states_path"]
            assert path.startswith(root) and load_hidden_states(path)["token_ids"].tolist() == ids
        assert second.get("/health").status_code == 200 and second.get("/v1/models").status_code == 200
        assert requests.get(f"http://127.0.0.1:{server.port}/b/nothing-here", timeout=10).status_code == 404
        assert second.stop(timeout_s=90) == 0, second.log()
    finally:
        second.kill()
    assert observer.state()["apps"] == ["hsx"]
    r = server.client().completions.create(model=serve_model, prompt=[5, 6], max_tokens=0)  # the first serves on
    assert os.path.exists(r.kv_transfer_params["hidden_states_path"])


@pytest.mark.ray
@pytest.mark.slow
def test_sigterm_leaves_the_cluster_as_found(hsx_on_cluster, cluster, observer):
    server = hsx_on_cluster
    assert server.stop(timeout_s=90) == 0, server.log()
    assert "Traceback" not in server.log(), server.log()
    # hsx started Serve here and nothing else ran on it: its application and Serve are gone, the port is free, and
    # the cluster lives on with every CPU free (a brand-new driver connects)
    assert observer.state(settled=True) == EMPTY
    assert port_is_free(server.port)
    assert fresh_driver_state(cluster) == EMPTY


@pytest.mark.ray
@pytest.mark.slow
def test_replicas_that_fail_to_start_exit_2_naming_the_error_and_leave_the_cluster_as_found(cluster, observer,
                                                                                            serve_model, tmp_path):
    """A model folder that passes the up-front checks but whose weights are damaged: the Engine replica's constructor
    fails, Ray Serve gives up, and hsx serve exits 2 with one line naming the deployment and the constructor's
    error. It had started Serve on the cluster, so it removes Serve too: the cluster is as it was."""
    import shutil

    assert observer.state(settled=True) == EMPTY
    broken = tmp_path / "broken-model"
    shutil.copytree(serve_model, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file" * 64)
    proc = hsx_serve(str(broken), tmp_path, "--address", cluster, "--port", str(free_port()))
    assert proc.wait(180) == 2, (tmp_path / "serve.log").read_text()[-3000:]
    last = (tmp_path / "serve.log").read_text().strip().splitlines()[-1]
    assert last.startswith("hsx serve: error: the replicas failed to start: Engine: "), last
    assert "SafetensorError" in last and "Fix that and start again" in last, last
    assert observer.state(settled=True) == EMPTY


def port_is_free(port: int, timeout_s: float = 10) -> bool:
    """Nothing listens on the port (within timeout_s); SO_REUSEADDR: the closed connections' TIME_WAIT is no owner."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                s.listen(1)
                return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
        time.sleep(0.2)


@pytest.mark.ray
@pytest.mark.slow
def test_cluster_too_small_warns_and_sigterm_stops_the_wait(cluster, observer, serve_model, tmp_path):
    """The replicas do not fit: a warning, not an error (the cluster may autoscale); SIGTERM while hsx waits for
    them removes its application, and leaves alone the Serve that another driver had started there."""
    port = free_port()
    assert observer.ask(f"serve {port}") == {**EMPTY, "apps": [], "http": ["127.0.0.1", port]}
    need = CLUSTER_CPUS + 1  # one replica that no node can hold (none starts: nothing to stop on SIGTERM)
    # --drain-timeout-s: Ray Serve stops a replica that never started after this grace period (default 60 s)
    proc = hsx_serve(serve_model, tmp_path, "--address", cluster, "--port", str(port), "--cpus-per-replica", str(need),
                     "--drain-timeout-s", "2")
    try:
        log = wait_for_log(tmp_path, "waiting for the cluster to add nodes", proc, timeout_s=60)
        assert f"--replicas 1 need {need} CPUs and 0 GPUs, but the Ray cluster has {CLUSTER_CPUS} CPUs" in log, log
        deadline = time.monotonic() + 60  # SIGTERM once the application is deployed, its replicas pending
        while observer.state()["apps"] != ["hsx"] and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    log = (tmp_path / "serve.log").read_text()
    assert "stopped before the replicas were all running" in log and "Traceback" not in log, log
    assert observer.state(settled=True) == {**EMPTY, "apps": [], "http": ["127.0.0.1", port]}
