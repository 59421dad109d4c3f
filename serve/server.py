"""Deploy and run `hsx serve`: the Ray Serve application, started on a private local Ray or an existing cluster.

    build_app(config, gpus)   Engine deployment (num_replicas, ray_actor_options num_gpus / num_cpus,
                              max_ongoing_requests = 2 x max_num_seqs: one batch running, one gathering;
                              max_queued_requests + Retry-After at the caller) bound into the Ingress deployment
    check(config)             what can fail before anything starts: settings, model folder, output storage
    run(config, ready)        start Ray (cluster.session.ray_cluster) and Serve, deploy, wait for the replicas (SIGTERM
                              stops the wait), serve until SIGTERM/SIGINT, then drain (Ingress.drain: new requests
                              503, in-flight ones finish and their files become durable) and shut down; returns the
                              exit status. On an existing cluster (--address) only what hsx started is removed
    _check_guest(config)      a Serve already on the cluster: refused when on another host/port or already running an
                              application named --name (two hsx serve on one cluster: different --name and
                              --route-prefix)
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

from cluster.session import check_fits, first_line, gpus_default, ray_cluster
from connectors import storage
from connectors.outputs import check_output_place
from serve.config import ServeConfig

logger = logging.getLogger(__name__)


def build_app(config: ServeConfig, gpus_per_replica: float):
    from ray import serve
    from ray.serve.config import BackpressureConfig

    from serve.app import Ingress  # ray: the CLI's parser must stay cheap
    from serve.engine import Engine  # ray: the CLI's parser must stay cheap

    backpressure = BackpressureConfig(status_code=503, retry_after_s=config.retry_after_s)
    ongoing = 2 * config.max_num_seqs
    engine = serve.deployment(
        Engine, name="Engine", num_replicas=config.replicas, max_ongoing_requests=ongoing,
        max_queued_requests=config.max_queued_requests, backpressure_config=backpressure,
        ray_actor_options={"num_cpus": config.cpus_per_replica, "num_gpus": gpus_per_replica,
                           # torch's CPU threads = the CPUs the replica holds: more would spin against its neighbours
                           "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(max(1, int(config.cpus_per_replica)))}}},
        graceful_shutdown_timeout_s=config.drain_timeout_s, health_check_period_s=2, health_check_timeout_s=30)
    capacity = config.replicas * ongoing + config.max_queued_requests
    ingress = serve.deployment(
        Ingress, name="Ingress", num_replicas=1, max_ongoing_requests=capacity + 64,
        max_queued_requests=capacity + 64, backpressure_config=backpressure, ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=config.drain_timeout_s)
    return ingress.bind(engine.bind(config), config)


def check(config: ServeConfig) -> None:
    """ValueError naming the flag for what would fail only once replicas start: missing model/output, a model folder
    without a config, layer ids the model does not have, an output that cannot be written."""
    import os

    config.check_required()
    config.engine_config()  # the engine's own checks
    if os.path.isdir(config.model) and not os.path.exists(os.path.join(config.model, "config.json")):
        raise ValueError(f"--model {config.model}: the folder has no config.json; point it at a model folder")
    if not os.path.exists(config.model) and config.model.startswith((".", "/", "~")):
        raise ValueError(f"--model {config.model}: no such folder")
    from transformers import AutoConfig

    from extractor.facts import check_runnable, target_facts  # torch: the CLI's parser must stay cheap

    try:
        hf_config = AutoConfig.from_pretrained(config.model, revision=config.revision,
                                               trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {config.model}: cannot read its config ({first_line(e)}); pass a model folder or a "
                         "hub id in the local cache") from e
    check_runnable(hf_config, config.model)
    target_facts(hf_config, model=config.model, layer_ids=config.layers, max_model_len=config.max_model_len,
                 layers_flag="--layers", target=config.engine_target, target_flag="--target")  # layer ids and --max-model-len against the model, before Ray starts
    from extractor.packing import check_packing_mode

    check_packing_mode(hf_config, config.packing, config.model)
    if config.speculative is not None:
        check_draft_source(config.speculative, config.model, hf_config)
    if not config.writes_files:
        return  # a decoding service writes no files

    # files keep landing there: never in or around the model, inside a run or another model
    check_output_place(config.output, flag="--output", inputs={"--model": config.model})
    for root in config.allowed_roots or ():
        check_output_place(root, flag="--allowed-roots", inputs={"--model": config.model})
    try:
        fs, root = storage.open_url(config.output, config.storage_options)
        fs.makedirs(root, exist_ok=True)
    except (OSError, ValueError, ImportError) as e:
        raise ValueError(f"--output {config.output}: cannot use it ({type(e).__name__}: {e})") from e


def check_draft_source(speculative, model: str, hf_config=None) -> None:
    """The draft against the target before Ray starts (a replica would fail after a minute, in 200 lines): a folder
    that declares one for a method whose draft lives in the target's own folder (mtp, 'model' left out); a head's
    recorded sizes and aux layers, and the family's own preflight (MTP: its tensors there, made for this target)."""
    import json
    import os

    from extractor.facts import text_config
    from extractor.methods import family

    found = family(speculative.method)
    if found is None or not os.path.isdir(model):
        return  # ngram / draft_model (the engine checks a draft model's vocabulary); a hub id: read when loaded
    draft = speculative.model or model
    if not speculative.model and getattr(found, "model_optional", False):
        with open(os.path.join(model, "config.json")) as f:
            raw = json.load(f)
        if not found.matches(raw):
            raise ValueError(f"--speculative-config method {speculative.method!r} reads its draft from the target's "
                             f"folder, and {model} is not {found.description} (its config.json declares none); serve "
                             "a target that ships one, or use another method (e.g. eagle3 with a trained head: "
                             "'model': DIR)")
    if hf_config is not None and hasattr(found, "check_against"):
        try:
            found.check_against(draft, model, text_config(hf_config))
        except ValueError as e:
            raise ValueError(f"--speculative-config: {e}") from e


def run(config: ServeConfig, ready: Callable[[str], None] | None = None) -> int:
    """Serve until SIGTERM or SIGINT, then drain and stop. `ready(url)` is called once requests are accepted.

    On a cluster given by --address (or $RAY_ADDRESS) hsx is a guest: it refuses what it would otherwise silently
    get wrong (a Serve already listening elsewhere, an `hsx` application already deployed there), and on exit it
    deletes only its own application, stopping Serve only when it started Serve and nothing else runs on it; the
    cluster itself is never shut down.
    """
    import ray
    from ray import serve

    stop = threading.Event()
    with ray_cluster(config.address) as local:
        gpus = config.gpus_per_replica if config.gpus_per_replica is not None else gpus_default()
        # on a cluster that may autoscale, a warning: hsx waits for the replicas, says every 30 s what they wait
        # for, and SIGTERM stops the wait cleanly
        check_fits(_shortfall(config, gpus, ray.cluster_resources()), local=local,
                   fix="lower --replicas, --cpus-per-replica or --gpus-per-replica"
                       + (", or pass --address for a cluster" if local else ""),
                   waiting="waiting for the cluster to add nodes; SIGTERM stops waiting")
        from ray.serve.context import _get_global_client

        serve_was_running = local or _get_global_client(raise_if_no_controller_running=False) is not None
        serve.start(http_options={"host": config.host, "port": config.port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        if not local:
            _check_guest(config)  # after serve.start: also a Serve another driver started in the meantime
        note = _unreachable_host(config)
        if note:
            logger.warning("%s", note)
        deployed = False
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
            ingress = _deploy(config, gpus)
            deployed = True
            running = _wait_running(stop, config.name)
            if running:
                if ready is not None:
                    ready(config.base_url)
                stop.wait()
            if running or _ingress_up(config.name):  # the proxy routes to the ingress before the whole app is RUNNING
                left = ingress.drain.remote(config.drain_timeout_s).result(timeout_s=config.drain_timeout_s + 30)
                if left:
                    logger.warning("drain timed out with %d requests still running (--drain-timeout-s %s)", left,
                                   config.drain_timeout_s)
            if not running:
                # Ray Serve stops a replica that never started only after its grace period (it asks the pending
                # actor to shut down, then kills it at graceful_shutdown_timeout_s = --drain-timeout-s)
                logger.warning("stopped before the replicas were all running. Removing the application: replicas "
                               "still waiting for resources are stopped after --drain-timeout-s (%g s)",
                               config.drain_timeout_s)
        finally:
            if local:
                serve.shutdown()
            else:
                if deployed:
                    serve.delete(config.name)
                if not serve_was_running and not serve.status().applications:
                    serve.shutdown()  # hsx started Serve on this cluster and nobody else deployed to it since
    return 0


def _check_guest(config: ServeConfig) -> None:
    """ValueError when the cluster's Serve listens on another HTTP address than --host/--port (serve.start keeps
    the running Serve's address and only logs a warning, so hsx would announce a URL nobody serves) or already has
    an `hsx` application (serve.run would replace another service without a word)."""
    from ray import serve
    from ray.serve.context import _get_global_client

    http = _get_global_client().http_config
    if (http.host, http.port) != (config.host, config.port):
        raise ValueError(f"Ray Serve already runs on this cluster with HTTP on {http.host}:{http.port}, and a Serve "
                         f"instance has one HTTP address: pass --host {http.host} --port {http.port} to serve there, "
                         f"or stop that Serve (`serve shutdown` against this cluster) to serve on "
                         f"{config.host}:{config.port}")
    apps = serve.status().applications
    if config.name in apps:
        raise ValueError(f"Ray Serve on this cluster already runs an application named {config.name!r} (another hsx "
                         f"serve, or one that was killed): starting would replace it. Serve beside it with another "
                         f"--name and --route-prefix (e.g. --name {config.name}-2 --route-prefix /{config.name}-2), "
                         f"stop that hsx serve, or remove the leftover with serve.delete({config.name!r}) from a "
                         "driver on this cluster")


def _deploy(config: ServeConfig, gpus: float):
    """Deploy the application without waiting for its replicas (run() waits, and SIGTERM can stop the wait); the
    ingress handle. ValueError when Serve refuses it (e.g. route prefix / taken by another application)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    target = serve.RunTarget(target=build_app(config, gpus), name=config.name, route_prefix=config.route_prefix,
                             logging_config={"log_level": "WARNING", "enable_access_log": False})
    try:
        return serve.run_many([target], wait_for_applications_running=False)[0]
    except RayServeException as e:
        raise ValueError(f"Ray Serve refused the {config.name!r} application: {first_line(e)}") from e


def _wait_running(stop: threading.Event, name: str, report_every_s: float = 30.0) -> bool:
    """Wait for the application to run: True once it does, False when `stop` is set first. ValueError when its
    replicas fail to start (e.g. the model folder is missing on the cluster's nodes)."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    report_at = time.monotonic() + report_every_s
    while not stop.wait(0.25):
        app = serve.status().applications.get(name)
        logger.debug("application %s: %s", name, app.status if app else None)
        if app is None:
            raise ValueError(f"the {name!r} application was deleted from Ray Serve while it was starting")
        if app.status == ApplicationStatus.RUNNING:
            return True
        if app.status == ApplicationStatus.DEPLOY_FAILED:
            raise ValueError(f"the replicas failed to start: {_failure(app)}. Fix that and start again (on a "
                             "cluster, --model and --output must be reachable from every node, and hsx installed "
                             "there)")
        if time.monotonic() >= report_at:
            report_at += report_every_s
            waiting = "; ".join(d.message for d in app.deployments.values() if d.message) or app.message
            logger.warning("still waiting for the replicas to start (%s)", waiting or app.status)
    return False


def _ingress_up(name: str) -> bool:
    """The Ingress deployment is healthy (it may answer requests while the Engine replicas still start)."""
    from ray import serve
    from ray.serve.schema import DeploymentStatus

    app = serve.status().applications.get(name)
    ingress = app.deployments.get("Ingress") if app is not None else None
    return ingress is not None and ingress.status == DeploymentStatus.HEALTHY


def open_server_warning(config: ServeConfig) -> str | None:
    """A warning when the service takes requests from anyone on the network: no API key, and --host not loopback."""
    import ipaddress

    if config.api_key is not None:
        return None
    host = config.host.strip("[]")
    try:
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:  # a host name: it may be reachable from anywhere
        pass
    return (f"no API key, and --host {config.host} listens beyond this machine: anyone who can reach port "
            f"{config.port} can run the model and write files under --output; set --api-key (or $HSX_API_KEY), or "
            "listen on 127.0.0.1")


def _unreachable_host(config: ServeConfig) -> str | None:
    """A warning when --host leaves the service unreachable from here: through Ray Client (a ray:// address) this
    process is not on the cluster, and Serve's HTTP proxy listens on the cluster's head node, where a loopback host
    answers only that node."""
    import ipaddress

    if not (config.address or "").startswith("ray://"):
        return None
    host = config.host.strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: whether it resolves to loopback there is the cluster's business
        return None
    if not loopback:
        return None
    return (f"--host {config.host} with a Ray Client address ({config.address}): Serve's HTTP proxy listens on the "
            f"cluster's head node, on its loopback interface, so only processes on that node can reach "
            f"{config.base_url}; pass --host 0.0.0.0 (with --api-key) and use the head node's "
            "address")


def _failure(app) -> str:
    """What failed, from a DEPLOY_FAILED application's status: each failed deployment's own error (the last line of
    its message, the exception of its constructor's traceback), else the application's message."""
    from ray.serve.schema import DeploymentStatus

    failed = [f"{name}: {_last_line(d.message)}" for name, d in app.deployments.items()
              if d.status in (DeploymentStatus.DEPLOY_FAILED, DeploymentStatus.UNHEALTHY) and d.message]
    return "; ".join(failed) if failed else _last_line(app.message).rstrip(".")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no message from Ray Serve"


def _shortfall(config: ServeConfig, gpus: float, resources: dict) -> list[str]:
    """What the replicas need beyond the cluster's resources now ([] when they fit)."""
    need_cpu, need_gpu = config.replicas * config.cpus_per_replica, config.replicas * gpus
    have_cpu, have_gpu = resources.get("CPU", 0), resources.get("GPU", 0)
    if need_cpu <= have_cpu and need_gpu <= have_gpu:
        return []
    return [f"--replicas {config.replicas} need {need_cpu:g} CPUs and {need_gpu:g} GPUs, but the Ray cluster has "
            f"{have_cpu:g} CPUs and {have_gpu:g} GPUs"]
