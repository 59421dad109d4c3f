"""Deploy and run `hsx serve`: the Ray Serve application, started on a private local Ray or an existing cluster.

    build_app(config, gpus)   Engine deployment (num_replicas, ray_actor_options num_gpus / num_cpus,
                              max_ongoing_requests = 2 x max_num_seqs: one batch running, one gathering;
                              max_queued_requests + Retry-After at the caller) bound into the Ingress deployment
    check(config)             what can fail before anything starts: settings, model folder, output storage
    run(config, ready)        start Ray (jobs.pipeline.ray_cluster) and Serve, deploy, serve until SIGTERM/SIGINT,
                              then drain (Ingress.drain: new requests 503, in-flight ones finish and their files
                              become durable) and shut down; returns the exit status
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

from serve.config import ServeConfig

logger = logging.getLogger(__name__)

APP_NAME = "hsx"


def build_app(config: ServeConfig, gpus_per_replica: float):
    from ray import serve
    from ray.serve.config import BackpressureConfig

    from serve.app import Ingress
    from serve.engine import Engine

    backpressure = BackpressureConfig(status_code=503, retry_after_s=config.retry_after_s)
    ongoing = 2 * config.max_num_seqs
    queued = config.max_queued_requests or 1  # Ray Serve: -1 (unbounded) or >= 1
    engine = serve.deployment(
        Engine, name="Engine", num_replicas=config.replicas, max_ongoing_requests=ongoing,
        max_queued_requests=queued, backpressure_config=backpressure,
        ray_actor_options={"num_cpus": config.cpus_per_replica, "num_gpus": gpus_per_replica,
                           # torch's CPU threads = the CPUs the replica holds: more would spin against its neighbours
                           "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(max(1, int(config.cpus_per_replica)))}}},
        graceful_shutdown_timeout_s=config.drain_timeout_s, health_check_period_s=2, health_check_timeout_s=30)
    capacity = config.replicas * ongoing + queued
    ingress = serve.deployment(
        Ingress, name="Ingress", num_replicas=1, max_ongoing_requests=capacity + 64,
        max_queued_requests=capacity + 64, backpressure_config=backpressure, ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=config.drain_timeout_s)
    return ingress.bind(engine.bind(config), config)


def check(config: ServeConfig) -> None:
    """ValueError naming the flag for what would fail only once replicas start: missing model/output, a model folder
    without a config, layer ids the model does not have, an output that cannot be written."""
    import os

    from connectors import storage

    config.check_required()
    config.engine_config()  # the engine's own checks
    if os.path.isdir(config.model) and not os.path.exists(os.path.join(config.model, "config.json")):
        raise ValueError(f"--model {config.model}: the folder has no config.json; point it at a model folder")
    if not os.path.exists(config.model) and config.model.startswith((".", "/", "~")):
        raise ValueError(f"--model {config.model}: no such folder")
    if config.layers is not None:
        from transformers import AutoConfig

        from connectors.format import check_layer_ids

        n = AutoConfig.from_pretrained(config.model).num_hidden_layers
        check_layer_ids(config.layers, n, name="--layers")
    try:
        fs, root = storage.open_url(config.output, config.storage_options)
        fs.makedirs(root, exist_ok=True)
    except (OSError, ValueError, ImportError) as e:
        raise ValueError(f"--output {config.output}: cannot use it ({type(e).__name__}: {e})") from e


def run(config: ServeConfig, ready: Callable[[str], None] | None = None) -> int:
    """Serve until SIGTERM or SIGINT, then drain and stop. `ready(url)` is called once requests are accepted."""
    import ray
    from ray import serve

    from jobs.pipeline import ray_cluster

    stop = threading.Event()
    with ray_cluster(config.address) as local:
        gpus = config.gpus_per_replica
        if gpus is None:
            gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
        if local:
            _check_fits(config, gpus, ray.cluster_resources())
        serve.start(http_options={"host": config.host, "port": config.port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        try:
            ingress = serve.run(build_app(config, gpus), name=APP_NAME, route_prefix="/", blocking=False,
                                logging_config={"log_level": "WARNING", "enable_access_log": False})
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
            url = f"http://{config.host}:{config.port}"
            if ready is not None:
                ready(url)
            stop.wait()
            left = ingress.drain.remote(config.drain_timeout_s).result(timeout_s=config.drain_timeout_s + 30)
            if left:
                logger.warning("drain timed out with %d requests still running (--drain-timeout-s %s)", left,
                               config.drain_timeout_s)
        finally:
            if local:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
    return 0


def _check_fits(config: ServeConfig, gpus: float, resources: dict) -> None:
    need_cpu, need_gpu = config.replicas * config.cpus_per_replica, config.replicas * gpus
    have_cpu, have_gpu = resources.get("CPU", 0), resources.get("GPU", 0)
    if need_cpu > have_cpu or need_gpu > have_gpu:
        raise ValueError(f"--replicas {config.replicas} need {need_cpu:g} CPUs and {need_gpu:g} GPUs, but this "
                         f"machine's Ray has {have_cpu:g} CPUs and {have_gpu:g} GPUs; lower --replicas, "
                         "--cpus-per-replica or --gpus-per-replica, or pass --address for a cluster")
