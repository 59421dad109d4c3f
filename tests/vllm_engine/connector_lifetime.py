"""A long-lived engine with hsx's plug-in, run as a script by tests/vllm_engine/test_connector.py in a process of its
own: thousands of requests through ONE vLLM engine, in batches, then aborted requests and failed writes retried.

vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that both halves of the plug-in (the scheduler's and the
worker's) can be read here; a process of its own, so that the in-process engine's thread binding and distributed
state stay out of the test process. Prints one JSON line: the plug-in's per-request state after every batch.

    python tests/vllm_engine/connector_lifetime.py MODEL_DIR OUT_DIR NUM_REQUESTS
"""

from __future__ import annotations

import json
import os
import sys

LAYERS = [1, 2, 4]
REMEMBERED = 50
"""The plug-in's bound on remembered custom paths, lowered so that a few thousand requests pass it."""
BATCH = 200


def kinds(i: int, out: str, outside: str) -> dict:
    """Request i's kv_transfer_params: default paths, remembered custom paths, shared paths overwritten batch after
    batch (one writer of each per batch: a running request's file is refused to another), refusals."""
    k = i % 20
    if k < 10 or k == 16:
        return {}
    if k < 15:
        return {"hidden_states_path": os.path.join(out, "custom", f"{i}.safetensors")}
    if k == 15:
        shared = os.path.join(out, "shared", f"{i // 20 % 10}.safetensors")
        return {"hidden_states_path": shared, "overwrite": True}
    if k == 17:
        return {"hidden_states_path": outside}
    if k == 18:
        return {"hidden_states_path": os.path.join(out, "custom", f"{i}.safetensors"), "overwrite": "yes"}
    return {"include_output_tokens": True}


def sizes(llm) -> dict[str, int]:
    """The plug-in's per-request maps, both sides, and the outcomes kept for tickets."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from vllm_engine import outcomes

    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
    worker = get_kv_transfer_group()
    writer = worker._writer
    return {"located": len(sched._located), "claims": len(sched._claims), "new_files": len(sched._new_files),
            "saves": len(sched._saves), "releases": len(sched._releases), "live": len(sched._owners._live),
            "remembered": sched._owners.num_remembered, "remembered_paths": len(sched._owners._keys),
            "locks": len(worker._locks), "lock_errors": len(worker._lock_errors), "failed": len(worker._failed),
            "writer_requests": len(writer._requests), "writer_futures": len(writer._futures),
            "writer_write_secs": len(writer._write_secs), "writer_live": len(writer._owners._live),
            "writer_remembered": writer._owners.num_remembered, "outcomes": len(outcomes._outcomes)}


def data_files(folder: str) -> list[str]:
    """The data files in `folder` (not their lock files, which stay on local disks as vLLM's connector leaves them)."""
    return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")) if os.path.isdir(folder) else []


def settle(llm) -> None:
    """Step the idle engine until the finished requests' files are written and reported (vLLM's own loop does this
    in a server; in-process, generate() returns before the last step's saves are handed over)."""
    core = llm.llm_engine.engine_core
    for _ in range(20):
        if not core.engine_core.scheduler.has_requests():
            return
        core.get_output()
    raise RuntimeError("the engine did not settle in 20 steps")


def engine(model: str, out: str):
    """ONE in-process vLLM engine with the plug-in (its remembered paths bounded at REMEMBERED)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=64,
               speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}}},
               kv_transfer_config=KVTransferConfig(
                   kv_connector="HsxHiddenStatesConnector", kv_connector_module_path="vllm_engine.connector",
                   kv_role="kv_producer", kv_connector_extra_config={"shared_storage_path": out,
                                                                    "allow_custom_save_path": True,
                                                                    "max_remembered_paths": REMEMBERED}))


def batches(llm, out: str, n: int, report: dict) -> None:
    """n requests of kinds(i), BATCH at a time; the plug-in's state after each batch."""
    from vllm import SamplingParams

    outside = os.path.join(os.path.dirname(out), "outside.safetensors")
    for start in range(0, n, BATCH):
        ids = range(start, min(n, start + BATCH))
        params = [SamplingParams(max_tokens=3 if i % 20 == 19 else 1, ignore_eos=True,
                                 extra_args={"kv_transfer_params": kinds(i, out, outside)}) for i in ids]
        results = llm.generate([f"w{i} the quick brown fox" for i in ids], params, use_tqdm=False)
        settle(llm)
        report["paths"] += sum(r.kv_transfer_params["hidden_states_path"] is not None for r in results)
        report["refused"] += sum(r.kv_transfer_params["hidden_states_path"] is None for r in results)
        report["batches"].append(sizes(llm))


def aborts(llm, out: str, report: dict) -> None:
    """40 requests (half on custom paths) aborted mid-decode: nothing written, every path free again."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    aborted = [f"abort-{k}" for k in range(40)]
    for k, rid in enumerate(aborted):
        extra = {"hidden_states_path": os.path.join(out, "aborted", f"{k}.safetensors")} if k % 2 else {}
        engine.add_request(rid, f"a{k} b c", SamplingParams(max_tokens=60, ignore_eos=True,
                                                             extra_args={"kv_transfer_params": extra}))
    for _ in range(3):
        engine.step()
    engine.abort_request(aborted)
    settle(llm)
    report["aborted"] = sizes(llm)
    report["aborted_files"] = data_files(os.path.join(out, "aborted")) + [
        f for f in data_files(out) if f.startswith("abort-")]


def failures(llm, out: str, report: dict) -> None:
    """10 writes the storage refuses (injected on the worker's writer), then the same custom paths again, without
    overwrite=True."""
    from vllm import SamplingParams

    from connectors import safetensors_connector

    retry = [os.path.join(out, "retry", f"fail-{k}.safetensors") for k in range(10)]
    writer = safetensors_connector.SafetensorsHiddenStatesConnector
    write_file = writer._write_file

    def failing(self, dest, tensors, metadata):
        if "fail-" in dest.path:
            raise OSError(28, "No space left on device (injected)")
        return write_file(self, dest, tensors, metadata)

    one = [SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"hidden_states_path": p}}) for p in retry]
    writer._write_file = failing
    try:
        llm.generate([f"r{k} x y" for k in range(10)], one, use_tqdm=False)
        settle(llm)
    finally:
        writer._write_file = write_file
    report["failed"] = sizes(llm)
    report["failed_files"] = [os.path.exists(p) for p in retry]
    again = llm.generate([f"r{k} x y" for k in range(10)], one, use_tqdm=False)
    settle(llm)
    report["retried"] = sizes(llm)
    report["retried_paths"] = [r.kv_transfer_params["hidden_states_path"] for r in again]
    report["retried_errors"] = [r.kv_transfer_params.get("error") for r in again]
    report["retried_files"] = [os.path.exists(p) for p in retry]
    report["expected_paths"] = retry


def main(model: str, out: str, n: int) -> None:
    llm = engine(model, out)
    report: dict = {"batches": [], "paths": 0, "refused": 0}
    batches(llm, out, n, report)
    aborts(llm, out, report)
    failures(llm, out, report)
    report["custom_files"] = len(data_files(os.path.join(out, "custom")))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
