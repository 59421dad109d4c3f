"""Long requests in bounded memory (issue 25, item 5): once a request holds half of max_staged_bytes_per_request,
its rows go piece by piece to a spool on local disk and its file is assembled from it — the same bytes as the
in-memory path, on local disk and object stores; the connector never holds more than the bound; bad states, aborts
and failed uploads leave no file, no spool and no partial object behind."""

from __future__ import annotations

import dataclasses
import os

import pytest
import s3fs
import torch

from connectors import RequestInfo, load_hidden_states
from connectors.format import FP8, TARGET_TOPK_IDS, TARGET_TOPK_LOGPROBS
from connectors.quant import BadStates
from connectors.storage import STREAM_BLOCK_BYTES, put_atomic
from harness.http_proxy import LoopbackProxy
from tests.connectors.conftest import _GS, _S3, _make_backend, make_spec
from tests.connectors.test_storage_contract import HIDDEN, LAYERS, random_request
from tests.connectors.test_storage_faults import fast_failing

CHUNK = 64  # tokens per save_hidden_states call: a prefill chunk
ROW_BYTES = 8 + len(LAYERS) * HIDDEN * 4  # a token's id and float32 states
BOUND = 6 * CHUNK * ROW_BYTES  # pieces of 3 chunks
UNBOUNDED = 1 << 40


@pytest.fixture(params=["local", "memory", _S3, _GS])
def store(request, tmp_path):
    return _make_backend(request.param, request, tmp_path)


def spool_files(directory) -> list[str]:
    """This process's open files in `directory`: spool files have no name (O_TMPFILE, or unlinked at once), so an
    open descriptor is the only trace of one."""
    directory = os.path.realpath(directory)
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(directory + "/"):
            out.append(target)
    return out


def feed(connector, rid: str, token_ids, states, *, extra=None, loss_mask=None, params=None,
         num_prompt_tokens=None, finish: bool = True) -> str | None:
    """One request through the connector in CHUNK-token pieces, as a chunked prefill hands them over."""
    n_prompt = token_ids.shape[0] if num_prompt_tokens is None else num_prompt_tokens
    connector.start_request(RequestInfo(rid, n_prompt, params or {}, loss_mask=loss_mask))
    for lo in range(0, token_ids.shape[0], CHUNK):
        rows = {name: t[lo:lo + CHUNK] for name, t in (extra or {}).items()}
        connector.save_hidden_states(rid, token_ids[lo:lo + CHUNK], states[lo:lo + CHUNK], rows or None)
    return connector.request_finished(rid)["hidden_states_path"] if finish else None


@pytest.mark.parametrize("storage", ["model", FP8])
def test_a_request_past_the_bound_is_spooled_and_its_file_equals_the_in_memory_one_byte_for_byte(
        store, connector_factory, tmp_path, storage):
    num_tokens = 20 * CHUNK + 17  # the last chunk is short; output tokens after the prompt
    token_ids, states = random_request(num_tokens, torch.float32, seed=5)
    loss_mask = (torch.arange(num_tokens - 40) % 3 != 0).to(torch.uint8)
    spool_dir = tmp_path / "spool"
    files, peaks = {}, {}
    for name, bound in (("in-memory", UNBOUNDED), ("spooled", BOUND)):
        connector = connector_factory(store.url(name), make_spec(torch.float32, LAYERS, HIDDEN),
                                      storage_options=store.storage_options, storage_dtype=storage,
                                      max_staged_bytes_per_request=bound, spool_dir=str(spool_dir))
        path = feed(connector, "long", token_ids, states, loss_mask=loss_mask, num_prompt_tokens=num_tokens - 40,
                    params={"include_output_tokens": True})
        assert connector.wait_for_save() == {}
        files[name] = store.fs.cat_file(store.key(path))
        peaks[name] = connector.peak_staged_bytes
        if name == "spooled":
            assert spool_files(spool_dir) == []  # released once the file was written
            got = load_hidden_states(path, storage_options=store.storage_options, verify=True)
            assert torch.equal(got["token_ids"], token_ids) and torch.equal(got["loss_mask"][-40:], torch.ones(40,
                                                                                                     dtype=torch.uint8))

    assert files["spooled"] == files["in-memory"]
    assert peaks["in-memory"] == num_tokens * ROW_BYTES  # the whole sample, held until the request finished
    assert BOUND // 2 <= peaks["spooled"] <= BOUND


def test_any_number_of_per_token_streams_are_spooled_a_top_k_target_too(tmp_path, connector_factory):
    k = 8
    spec = dataclasses.replace(make_spec(torch.float32, LAYERS, HIDDEN), target=f"top_k:{k}")
    num_tokens = 12 * CHUNK
    token_ids, states = random_request(num_tokens, torch.float32, seed=6)
    top = torch.randn(num_tokens, 100, generator=torch.Generator().manual_seed(6)).log_softmax(-1).topk(k)
    extra = {TARGET_TOPK_IDS: top.indices.to(torch.int32), TARGET_TOPK_LOGPROBS: top.values}
    files = {}
    for name, bound in (("in-memory", UNBOUNDED), ("spooled", BOUND)):
        connector = connector_factory(str(tmp_path / name), spec, storage_dtype=FP8,
                                      max_staged_bytes_per_request=bound)
        path = feed(connector, "topk", token_ids, states, extra=extra)
        assert connector.wait_for_save() == {}
        files[name] = open(path, "rb").read()
        if name == "spooled":
            assert connector.peak_staged_bytes <= BOUND
            got = load_hidden_states(path, verify=True)
            assert torch.equal(got[TARGET_TOPK_IDS], extra[TARGET_TOPK_IDS])
    assert files["spooled"] == files["in-memory"]


def test_many_chunks_never_hold_more_than_the_bound(tmp_path, connector_factory):
    connector = connector_factory(str(tmp_path / "run"), make_spec(torch.float32, LAYERS, HIDDEN),
                                  max_staged_bytes_per_request=BOUND)
    token_ids, states = random_request(100 * CHUNK, torch.float32, seed=7)
    path = feed(connector, "many", token_ids, states)
    assert connector.wait_for_save() == {}
    assert BOUND // 2 <= connector.peak_staged_bytes <= BOUND  # against 100 chunks' worth in memory
    assert torch.equal(load_hidden_states(path)["hidden_states"], states)
    # the spool lay beside the files (the root) and left nothing there: the one file is all the folder holds
    assert sorted(os.listdir(tmp_path / "run")) == ["many.safetensors"]


@pytest.mark.parametrize("plant, said", [
    ("nan", "non-finite value (nan) at token 1203, layer 1 (hidden-state id 4)"),  # in a piece long after spooling
    ("zeros", "layer 2 (hidden-state id 6) is all zeros over all 1280 tokens"),  # known only at the end
])
def test_bad_states_in_a_spooled_request_fail_it_with_the_in_memory_message_and_leave_nothing(
        plant, said, tmp_path, connector_factory):
    token_ids, states = random_request(20 * CHUNK, torch.float32, seed=8)
    if plant == "nan":
        states[1203, 1, 7] = float("nan")
    else:
        states[:, 2] = 0.0
    messages = {}
    for name, bound in (("in-memory", UNBOUNDED), ("spooled", BOUND)):
        root = tmp_path / name
        connector = connector_factory(str(root), make_spec(torch.float32, LAYERS, HIDDEN), storage_dtype=FP8,
                                      max_staged_bytes_per_request=bound)
        feed(connector, "bad", token_ids, states)
        failures = connector.wait_for_save()
        assert list(failures) == ["bad"] and isinstance(failures["bad"], BadStates)
        messages[name] = str(failures["bad"])
        assert spool_files(root) == [] and (not root.exists() or os.listdir(root) == [])  # no file, lock, spool
    assert said in messages["spooled"] and messages["spooled"] == messages["in-memory"]


@pytest.mark.parametrize("end", ["abort", "shutdown"])
def test_a_request_aborted_or_never_finished_leaves_no_spool(end, tmp_path, connector_factory):
    spool_dir = tmp_path / "spool"
    connector = connector_factory(str(tmp_path / "run"), make_spec(torch.float32, LAYERS, HIDDEN),
                                  max_staged_bytes_per_request=BOUND, spool_dir=str(spool_dir))
    token_ids, states = random_request(10 * CHUNK, torch.float32, seed=9)
    feed(connector, "gone", token_ids, states, finish=False)
    assert spool_files(spool_dir)  # the request is spooling...
    if end == "abort":
        connector.abort_request("gone")
        assert connector.wait_for_save() == {}
    else:  # started, never finished nor aborted
        connector.shutdown()
    assert spool_files(spool_dir) == [] and os.listdir(spool_dir) == []  # ...and its spool is gone with it
    assert not (tmp_path / "run" / "gone.safetensors").exists()


@pytest.mark.s3
def test_an_upload_that_fails_mid_stream_leaves_no_object_and_no_open_multipart_upload(s3_bucket, connector_factory,
                                                                                       tmp_path):
    url, options = s3_bucket
    bucket = url.removeprefix("s3://")
    hidden = 512  # 6 KiB a token: 4096 tokens make a 24 MiB file, three parts of the streamed upload
    token_ids, states = random_request(4096, torch.float32, seed=10, hidden=hidden)
    with LoopbackProxy(options["client_kwargs"]["endpoint_url"]) as proxy:
        proxy.fail_next = -1  # every upload of the second part fails: the first went through
        proxy.targets = lambda method, path: method == "PUT" and "partNumber=2" in path
        connector = connector_factory(f"{url}/run", make_spec(torch.float32, LAYERS, hidden),
                                      storage_options=fast_failing(proxy.endpoint), max_write_attempts=2,
                                      write_retry_backoff_s=0.01, max_staged_bytes_per_request=4 << 20,
                                      spool_dir=str(tmp_path / "spool"))
        connector.start_request(RequestInfo("cut", 4096))
        for lo in range(0, 4096, 512):
            connector.save_hidden_states("cut", token_ids[lo:lo + 512], states[lo:lo + 512])
        connector.request_finished("cut")
        failures = connector.wait_for_save()
        assert proxy.injected_failures == 2  # both attempts reached the second part

    assert list(failures) == ["cut"]
    fs = s3fs.S3FileSystem(**options)
    assert set(fs.find(bucket)) == set()  # no object, no lock
    uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket)
    assert not uploads.get("Uploads"), uploads  # each attempt's upload was aborted, not left open
    assert spool_files(tmp_path / "spool") == []


def test_a_streamed_write_that_fails_part_way_leaves_nothing_on_any_store(store):
    """put_atomic(stream=True) past its first uploaded part, then the writer fails: no object appears, whole or
    partial, on any backend (object stores abort the upload instead of completing it)."""
    def doomed(f) -> None:
        f.write(b"x" * (STREAM_BLOCK_BYTES + 1024))  # one part is already on its way
        raise OSError("the spool could not be read")

    with pytest.raises(OSError, match="spool could not be read"):
        put_atomic(store.fs, store.key(store.url("doomed.safetensors")), doomed, stream=True)
    put_atomic(store.fs, store.key(store.url("fine.safetensors")), lambda f: f.write(b"y" * 100), stream=True)
    mine = store.key(store.root).rstrip("/") + "/"  # the store is shared with other tests: look at this run only
    assert [os.path.basename(p) for p in store.files() if p.startswith(mine)] == ["fine.safetensors"]
    if store.name == "s3":
        bucket = store.key(store.root).split("/")[0]
        assert not store.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")
