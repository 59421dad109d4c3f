"""What each extraction worker reserves from Ray, and that a CPU worker uses it: its torch threads follow the
reservation (Ray's default of one CPU per actor would leave a CPU worker on one thread)."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

from harness.corpora import write_jsonl
from jobs.config import JobConfig
from jobs.pipeline import READ_TASK_CPUS, TOKENIZER_CPUS, resolve_resources, run_job
from tests.jobs.conftest import RAY_TEST_CPUS


def config(**kw) -> JobConfig:
    kw.setdefault("gpus_per_worker", 0)  # the test cluster may have GPUs on a GPU machine; these are CPU workers
    return JobConfig(model="m", corpus=("c.jsonl",), output="o", **kw)


def test_cpu_workers_share_the_cpus_the_readers_and_tokenizers_leave(ray_cluster):
    left = RAY_TEST_CPUS - TOKENIZER_CPUS - READ_TASK_CPUS
    assert resolve_resources(config(), local=True) == (0, float(int(left)))
    assert int(left) > 1
    assert resolve_resources(config(workers=2), local=True) == (0, float(int(left // 2)))
    fewer = RAY_TEST_CPUS - 3 * TOKENIZER_CPUS - READ_TASK_CPUS
    assert resolve_resources(config(workers=2, tokenizer_workers=3), local=True) == (0, float(int(fewer // 2)))
    assert resolve_resources(config(cpus_per_worker=1.5), local=True) == (0, 1.5)  # explicit wins


def test_more_cpus_than_the_cluster_has_is_refused_naming_the_flags(ray_cluster):
    with pytest.raises(ValueError, match=r"--workers 2 x --cpus-per-worker 4 plus tokenizers needs 8\.75 CPUs, the "
                                         rf"cluster has {RAY_TEST_CPUS}; lower --workers"):
        resolve_resources(config(workers=2, cpus_per_worker=4), local=True)
    with pytest.raises(ValueError, match="--workers 12 x --cpus-per-worker 1 "):  # the share never drops below 1
        resolve_resources(config(workers=12), local=True)


def test_gpu_workers_reserve_one_cpu_and_another_cluster_only_warns(ray_cluster, caplog):
    gpus = torch.cuda.device_count()
    with caplog.at_level(logging.WARNING, logger="jobs.pipeline"):
        assert resolve_resources(config(gpus_per_worker=1, workers=gpus + 1), local=False) == (1, 1.0)
    assert f"needs {gpus + 1} GPUs" in caplog.text and "autoscaling" in caplog.text


def test_a_cpu_worker_runs_as_many_torch_threads_as_it_reserved_at_most_its_cores(tiny_llama, tmp_path):
    from connectors import HiddenStatesSpec
    from connectors.run import RunSpec
    from connectors.safetensors_connector import HiddenStatesConnectorConfig
    from extractor import EngineConfig, SamplingParams
    from jobs.worker import ExtractionWorker, WorkerSettings

    saved = torch.get_num_threads()
    try:
        for reserved, expected in ((1, 1), (10_000, len(os.sched_getaffinity(0)))):
            worker = ExtractionWorker(WorkerSettings(
                engine=EngineConfig(model=tiny_llama, layer_ids=(1, 4), dtype="float32", max_model_len=64,
                                    device="cpu"),
                sampling=SamplingParams(max_tokens=0),
                connector=HiddenStatesConnectorConfig(shared_storage_path=str(tmp_path), allow_custom_save_path=True),
                run=RunSpec(HiddenStatesSpec(layer_ids=(1, 4), num_hidden_layers=4, hidden_size=64, dtype="float32",
                                             model=tiny_llama)),
                cpu_threads=reserved))
            assert worker.llm is None  # loading in the background; taken with the first work
            # Ray Data runs a map actor's __init__ and its calls on different threads, and OpenMP's thread count is
            # per thread: it must be set on the thread that takes the engine (and runs the forwards)
            seen = []

            def first_work(worker, seen):
                worker._engine()
                seen.append(torch.get_num_threads())

            call = threading.Thread(target=first_work, args=(worker, seen))
            call.start()
            call.join()
            assert seen == [expected]
            worker.llm.shutdown()
    finally:
        torch.set_num_threads(saved)


def test_the_job_reports_what_its_workers_reserved(ray_cluster, tiny_llama, tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": f"s{i}", "prompt": f"sample number {i}"} for i in range(3)])
    result = run_job(JobConfig(model=tiny_llama, corpus=(corpus,), output=str(tmp_path / "out"), gpus_per_worker=0,
                               progress=False))
    assert (result.ok, result.failed) == (3, 0)
    share = float(int(RAY_TEST_CPUS - TOKENIZER_CPUS - READ_TASK_CPUS))
    assert (result.gpus_per_worker, result.cpus_per_worker) == (0, share)
    assert f"  workers:  on CPU, {share:g} CPU(s) each" in result.lines()


def test_a_vllm_worker_reserves_a_device_per_rank_and_fewer_is_refused_naming_the_flag(ray_cluster):
    """--engine vllm --tensor-parallel-size 2: a worker is a gang of 2 ranks, a core each on CPU (the default share
    never drops below that) and 2 GPUs each on GPU; a reservation below that is refused, whatever the cluster."""
    assert resolve_resources(config(engine="vllm", tensor_parallel_size=2, workers=3), local=False)[1] >= 2
    with pytest.raises(ValueError, match=r"= 2 vLLM ranks need 2 cores per worker, --cpus-per-worker 1; raise it"):
        resolve_resources(config(engine="vllm", tensor_parallel_size=2, cpus_per_worker=1), local=True)
    with pytest.raises(ValueError, match=r"= 4 vLLM ranks need 4 GPUs per worker, --gpus-per-worker 2"):
        resolve_resources(config(engine="vllm", tensor_parallel_size=4, gpus_per_worker=2), local=False)
    with pytest.raises(ValueError, match=r"--gpus-per-worker 1.5: each vLLM rank takes a whole GPU"):
        resolve_resources(config(engine="vllm", gpus_per_worker=1.5), local=False)
    # more GPUs than any node has: a worker's reservation never spans nodes (refused on a local cluster)
    with pytest.raises(ValueError, match=r"--gpus-per-worker 64 fits no node \(the largest has \d+ GPUs\)"):
        resolve_resources(config(engine="vllm", tensor_parallel_size=64, gpus_per_worker=64), local=True)
