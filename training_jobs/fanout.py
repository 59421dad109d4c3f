"""`hsx train-drafter --online --fanout FILE`: several drafters trained from one live extraction (the target runs
once per sample and pass for all of them).

    train_fanout(config) -> {"trainers": [...], "online": ...}   one training session per trainer
                                        (training.trainer.Trainer over training_jobs.live.LiveStream), one stream for all
    fanout_configs(config)              the trainers of --fanout FILE, each over the command's settings
    FanoutBatches                       one trainer's share of the hub's stream (training_jobs.live.StreamHub), packed to its
                                        own --batch-tokens
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import fsspec
import numpy as np
import yaml

from cluster.session import first_line, ray_cluster
from corpus.sample_registry import DoneSet, id_keys
from training.feed import CheckedFeed
from training.train_config import checkpoint_folder, log_folder
from training.trainer import Trainer
from training_jobs.config import TrainJobConfig
from training_jobs.live import LiveBatches, LiveStream, StreamHub, extraction_config, plan_stream, run_online

logger = logging.getLogger(__name__)


class FanoutBatches(LiveBatches):
    """One --fanout trainer's batches: its share of the hub's stream, packed to its own --batch-tokens."""

    def __init__(self, config: TrainJobConfig, hub: StreamHub, i: int, feed: CheckedFeed, collate,
                 resumed: dict[str, Any] | None) -> None:
        # the hub's stream checked the items; `feed` is this trainer's own (its samples skipped, its stop)
        super().__init__(config, hub.stream.plan, feed, collate, hub.stream.local, resumed)
        self.hub, self.i = hub, i
        hub.resume(i, self.epoch_of_consumed, np.asarray(self.consumed, dtype=np.uint64))

    def pass_items(self, epoch: int, consumed: DoneSet) -> Iterator[dict[str, Any]]:
        for item in self.hub.items(self.i, epoch):
            sid = item["bad"][0] if "bad" in item else item["sample_id"]
            if not consumed.contains(id_keys([sid]))[0]:
                self.extracted += 1
                yield item


FANOUT_FIXED = ("model", "corpus", "extract", "online", "cache", "fanout", "address", "inflight_mb", "workers",
                "gpus_per_worker", "max_failures", "run")
"""Settings every --fanout trainer shares (the stream's); an entry may set any other, and must set its own out."""


def fanout_configs(config: TrainJobConfig) -> list[TrainJobConfig]:
    """The trainers of --fanout FILE: a YAML or JSON list of settings (or {"trainers": [...]}), each over the
    command's own."""
    try:
        with fsspec.open(config.fanout, "rt", encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--fanout {config.fanout}: cannot be read ({first_line(e)})") from e
    entries = doc.get("trainers") if isinstance(doc, dict) else doc
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"--fanout {config.fanout} must list the trainers: a list of settings (or trainers: [...]), "
                         "each a mapping with its own out")
    fields = {f.name for f in dataclasses.fields(TrainJobConfig)}
    configs, outs = [], set()
    for n, entry in enumerate(entries, 1):
        unknown = sorted(set(entry) - fields)
        fixed = sorted(set(entry) & set(FANOUT_FIXED))
        if unknown or fixed or "out" not in entry:
            why = (f"unknown settings {unknown}" if unknown else f"{fixed} are the stream's, shared by every trainer"
                   if fixed else "no out (each trainer writes its own folder)")
            raise ValueError(f"--fanout {config.fanout}: trainer {n}: {why}")
        c = dataclasses.replace(config, fanout=None, **entry)
        for flag, path in (("out", c.out), ("checkpoint_dir", checkpoint_folder(c)), ("log_dir", log_folder(c))):
            where = path if "://" in path else os.path.realpath(path)
            if where in outs:
                raise ValueError(f"--fanout {config.fanout}: trainer {n} writes its {flag} to {path}, as an earlier "
                                 f"one does; give each trainer its own {flag} (or leave it to the default in its out)")
            outs.add(where)
        configs.append(c)
    if config.cache:
        raise ValueError("--fanout with --cache is not supported yet: train the trainers on the cached run instead")
    return configs


def train_fanout(config: TrainJobConfig) -> dict[str, Any]:
    """Several drafters trained from one live extraction (--fanout): the target runs once per sample and pass for
    all of them. {"trainers": [report or {"out", "error"}], "online": the stream's counts}; a trainer that fails does
    not stop the others."""
    configs = fanout_configs(config)
    plan = plan_stream(extraction_config(config, configs))
    shares = [LiveStream(c, plan) for c in configs]
    trainers = [Trainer(c, share) for c, share in zip(configs, shares)]  # every check before the stream starts
    reports: list[dict[str, Any] | None] = [None] * len(trainers)
    with ray_cluster(config.address) as local:
        stream = LiveBatches(config, plan, CheckedFeed(None, skip=config.skip_bad_samples, spec=plan.spec), None,
                             local, None)
        hub = StreamHub(stream, len(trainers))
        for i, share in enumerate(shares):
            share.make_batches = lambda feed, collate, resumed, i=i: FanoutBatches(configs[i], hub, i, feed,
                                                                                  collate, resumed)

        def work(i: int) -> None:
            try:
                reports[i] = run_online(trainers[i])
            except Exception as e:  # noqa: BLE001 - reported with the trainer's out; the others go on
                logger.error("fan-out trainer %d (%s) failed: %s", i + 1, configs[i].out, first_line(e))
                reports[i] = {"out": configs[i].out, "error": f"{type(e).__name__}: {first_line(e)}"}
            finally:
                hub.finished(i)

        threads = [threading.Thread(target=work, args=(i,), name=f"hsx-fanout-{i + 1}") for i in range(len(configs))]
        for t in threads:
            t.start()
        try:
            hub.run()
        finally:
            for t in threads:  # a stream that failed ends every trainer's wait (hub.error)
                t.join()
    return {"trainers": reports, "online": {"passes": stream.passes, "target_forwards": stream.target_forwards,
                                            "failed": stream.failed, "peak_object_store_bytes": stream.peak_inflight_bytes}}
