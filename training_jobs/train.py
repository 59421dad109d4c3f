"""`hsx train-drafter`: the one train_drafter, which picks where a training session runs, and the data-parallel
replicas on Ray Train.

    train_drafter(config) -> report   a TrainDrafterConfig, or a TrainJobConfig (training_jobs.config) that trains
                                      in this process: training.trainer.Trainer over a StoredRun; with --online:
                                      training_jobs.live.train_online; with --online --fanout: training_jobs.fanout.train_fanout;
                                      with --workers N or --address: train_on_ray
    train_on_ray(config) -> report    the same session, its steps on N replicas (RayTrain: TorchTrainer, DDP over
                                      gloo on CPU, NCCL on GPU)

The driver does what one process does before training (checks --out, --checkpoint-dir, --log-dir and the run,
initialises and prepares the drafter from --seed, takes their leases, reads a checkpoint to resume), then starts the
replicas. Each replica
opens the run itself (a local folder on one machine, s3:// or gs:// across nodes), takes the prepared drafter and
the target head from Ray's object store (the target folder need not exist on other nodes) and runs
training.loop.Loop with training.replicas.TorchDistributed: its share of each global batch (--workers x
--batch-tokens), gradients averaged by DDP and weighted by loss tokens, the same optimizer and schedule as one
process.

Checkpoints: replica 0 hands each one to a keeper actor pinned to the driver's node, which writes it to
OUT/checkpoint with the one-process trainer's atomic, durable write (so --out is local to the driver, as with one
process) while the driver holds --out's lease; a lost lease makes the next save fail. A replica that dies (a killed
process, a lost node) restarts the group (up to --max-failures times), and every replica continues from the last
checkpoint the keeper wrote; a killed driver is resumed by running the same command again, like one process.
A replica's deterministic error (bad data, a diverged loss, a lost lease) is recorded by the keeper and ends the
training without restarts, with its message.
"""

from __future__ import annotations

import logging
import random
import shutil
import threading
import uuid
from typing import Any

import torch

from cluster.session import check_fits, first_line, gpus_default, ray_cluster
from connectors.lease import LeaseLost
from jobs.worker import own_temp_folder
from training.checkpoint import Checkpoints, read_checkpoint, run_identity
from training.checks import open_dataset
from training.feed import TrainingStopped
from training.loop import Loop
from training.replicas import TorchDistributed
from training.train_config import TrainDrafterConfig, checkpoint_folder
from training.trainer import StoredRun, Trainer
from training_jobs.config import TrainJobConfig
from training_jobs.fanout import train_fanout
from training_jobs.live import train_online

logger = logging.getLogger(__name__)


class ReplicasFailed(RuntimeError):
    """The replicas kept dying (more than --max-failures restarts); the message says the last reason."""


_FATAL = {"TrainingStopped": TrainingStopped, "LeaseLost": LeaseLost, "ValueError": ValueError}
"""A replica's errors that a restart cannot mend: the training ends with the same error in the driver."""


def train_drafter(config: TrainDrafterConfig) -> dict[str, Any]:
    """Train `config.kind`: in this process on a stored run, or (a TrainJobConfig's --online, --fanout, --workers,
    --address) on Ray. The report (training.trainer's; on Ray Train plus "worker_restarts", --online plus "online";
    --fanout: training_jobs.fanout.train_fanout's), also in OUT/report.json."""
    if isinstance(config, TrainJobConfig):
        if config.online and config.fanout:
            return train_fanout(config)
        if config.online:
            return train_online(config)
        if config.distributed():
            return train_on_ray(config)
    return Trainer(config, StoredRun(config)).run()


def train_on_ray(config: TrainJobConfig) -> dict[str, Any]:
    """The training session with its steps on --workers replicas on Ray Train (see the module docstring)."""
    replicas = RayTrain(config)
    trainer = Trainer(config, StoredRun(config), replicas)  # every check before Ray starts
    with ray_cluster(config.address) as local:
        replicas.check_fits(local)
        return trainer.run()


STORAGE_PREFIX = "hsx-train-"
"""Ray Train's run records of a driver: <tmp>/hsx-train-<host>-<pid>-XXXX (jobs.worker.own_temp_folder), removed at its end,
and by the next driver on the machine when it was killed before."""


class RayTrain:
    """Where a session's steps run on Ray Train (a training.trainer.Replicas): --workers replicas (TorchTrainer),
    checkpoints written by a keeper actor on the driver's node."""

    def __init__(self, config: TrainJobConfig) -> None:
        self.config = config
        self.gpus = 0.0

    def check_fits(self, local: bool) -> None:
        """The GPUs each replica takes, and whether the cluster has room for the replicas (raises when a local one
        has not)."""
        self.gpus = _gpus(self.config)
        _check_fits(self.config, self.gpus, local)

    def train(self, session: Trainer, state: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        config = self.config
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        keeper = ray.remote(num_cpus=0, max_restarts=0)(_Keeper).options(scheduling_strategy=here).remote(
            config, (state or {}).get("sample_log_bytes", 0))
        storage = own_temp_folder(STORAGE_PREFIX)  # Ray Train's records; our checkpoints: OUT
        done = threading.Event()
        threading.Thread(target=_watch_lease, args=(session.out, keeper, done), daemon=True).start()
        try:
            restarts = self._fit(session, keeper, storage)
        finally:
            done.set()
            shutil.rmtree(storage, ignore_errors=True)
        return read_checkpoint(checkpoint_folder(config), config.storage_options), {"worker_restarts": restarts}

    def _fit(self, session: Trainer, keeper, storage: str) -> int:
        """Run the replicas to the end; the restarts they took. The error a replica recorded, else ReplicasFailed."""
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        config, gpus = self.config, self.gpus
        trainer = TorchTrainer(
            _replica, train_loop_config={
                "config": config, "keeper": keeper, "identity": session.identity, "gpus": gpus,
                "drafter": ray.put(session.drafter.cpu()), "target": ray.put(session.target)},
            scaling_config=ScalingConfig(num_workers=config.workers, use_gpu=gpus > 0,
                                         resources_per_worker={"CPU": 1, **({"GPU": gpus} if gpus else {})}),
            run_config=RunConfig(name=f"hsx-train-{uuid.uuid4().hex[:8]}", storage_path=storage,
                                 failure_config=FailureConfig(max_failures=config.max_failures)))
        try:
            trainer.fit()
        except Exception as e:  # Ray Train's TrainingFailedError and the like: say what the replicas said
            stopped = ray.get(keeper.stopped.remote())
            if stopped is not None:
                raise _FATAL[stopped[0]](stopped[1]) from None
            raise ReplicasFailed(f"the {config.workers} training replicas failed (restarted up to "
                                 f"--max-failures {config.max_failures} times): {first_line(e)}") from e
        return ray.get(keeper.starts.remote()) - 1


def _gpus(config: TrainJobConfig) -> float:
    gpus = config.gpus_per_worker
    if gpus is None:
        gpus = 0.0 if config.device == "cpu" else gpus_default()
    if config.device == "cuda" and not gpus:
        raise ValueError(f"--device cuda with --workers {config.workers}: the Ray cluster has no GPU for the replicas "
                         "(or --gpus-per-worker is 0); drop --device cuda to train on CPUs")
    if config.device == "cpu" and gpus:
        raise ValueError("--device cpu and --gpus-per-worker > 0 contradict each other; drop one")
    return float(gpus)


def _check_fits(config: TrainJobConfig, gpus: float, local: bool) -> None:
    import ray

    have = ray.cluster_resources()
    problems = []
    if config.workers > have.get("CPU", 0):
        problems.append(f"--workers {config.workers} needs {config.workers} CPUs, the cluster has "
                        f"{have.get('CPU', 0):g}")
    if gpus and config.workers * gpus > have.get("GPU", 0):
        problems.append(f"--workers {config.workers} x --gpus-per-worker {gpus:g} needs {config.workers * gpus:g} "
                        f"GPUs, the cluster has {have.get('GPU', 0):g}")
    check_fits(problems, local=local, fix="lower --workers or --gpus-per-worker",
               waiting="waiting: an autoscaling cluster may add nodes")


def _watch_lease(out, keeper, done: threading.Event) -> None:
    """Tell the keeper when --out's lease is lost, so that no further checkpoint is written."""
    while not done.wait(0.5):
        try:
            out.check_lease()
        except LeaseLost as e:
            keeper.revoke.remote(str(e))
            return


class _Keeper:
    """On the driver's node: the training's checkpoints in OUT (training.checkpoint.Checkpoints), the latest one for
    replicas that (re)start, and the error that ended the training, if a replica met one that restarts cannot
    mend."""

    def __init__(self, config: TrainJobConfig, sample_log_bytes: int) -> None:
        self.config = config
        self.revoked: str | None = None
        self.fatal: tuple[str, str] | None = None
        self.started = 0
        self.checkpoints = Checkpoints(config, self._check_lease, {"sample_log_bytes": sample_log_bytes})

    def _check_lease(self) -> None:
        if self.revoked is not None:
            raise LeaseLost(self.revoked)

    def revoke(self, message: str) -> None:
        self.revoked = message

    def latest(self, rank: int) -> dict[str, Any] | None:
        """The last checkpoint written (None: the training starts afresh); rank 0's calls count the starts."""
        self.started += rank == 0
        return read_checkpoint(checkpoint_folder(self.config), self.config.storage_options)

    def save(self, state: dict[str, Any], logged: list[dict[str, Any]]) -> None:
        self.checkpoints.save(state, logged)

    def stop(self, kind: str, message: str) -> None:
        self.fatal = self.fatal or (kind, message)

    def stopped(self) -> tuple[str, str] | None:
        return self.fatal

    def starts(self) -> int:
        return self.started


def _replica(cfg: dict[str, Any]) -> None:
    """One replica (a Ray Train worker): its share of every step, from the keeper's last checkpoint."""
    import ray

    config: TrainJobConfig = cfg["config"]
    keeper = cfg["keeper"]
    stopped = ray.get(keeper.stopped.remote())
    if stopped is not None:  # a restart after an error that another start would meet again
        raise _FATAL[stopped[0]](stopped[1])
    try:
        replica = TorchDistributed()
        ds = open_dataset(config)
        if run_identity(ds) != cfg["identity"]:
            raise ValueError(f"--run {config.run} changed while the training started (its run.json or committed "
                             "samples differ from what the driver read); run the training again")
        drafter, target = ray.get(cfg["drafter"]), ray.get(cfg["target"])
        state = ray.get(keeper.latest.remote(replica.rank))
        if cfg["gpus"]:
            import ray.train.torch

            device = ray.train.torch.get_device()
        else:
            device = torch.device("cpu")
        torch.manual_seed(config.seed)
        random.seed(config.seed)

        def save(current: dict[str, Any], logged: list[dict[str, Any]]) -> None:
            ray.get(keeper.save.remote(current, logged))

        source = StoredRun.opened(config, ds).batches(replica, None)  # fed as the driver's StoredRun is
        Loop(config, source, drafter, target, cfg["identity"], device, getattr(torch, config.dtype), replica,
             save).run(state)
    except (TrainingStopped, LeaseLost, ValueError) as e:
        cause = getattr(e, "cause", None) or e  # a keeper call's error comes wrapped in Ray's RayTaskError
        kind = next(name for name, cls in _FATAL.items() if isinstance(cause, cls))
        ray.get(keeper.stop.remote(kind, str(cause)))
        raise
