"""The storage contract: every backend (local disk, memory://, s3:// on moto, gs:// on the GCS emulator) passes it.

Files go in through the connector (start_request -> save_hidden_states in chunks -> request_finished ->
wait_for_save) and come back through the public reader API; checks look at the store directly.
"""

from __future__ import annotations

import os
import re
import threading
import time

import fsspec
import pytest
import safetensors.torch
import torch

from connectors import RequestInfo
from connectors.example_hidden_states_connector import (
    cleanup_hidden_states,
    load_hidden_states,
    read_hidden_states_info,
)
from connectors.header import HEADER_PROBE_BYTES
from harness.http_proxy import LoopbackProxy
from tests.connectors.conftest import LOCK_SUFFIX, make_spec

LAYERS = (2, 4, 6)
HIDDEN = 32


def random_request(num_tokens: int, dtype: torch.dtype, *, seed: int = 0, hidden: int = HIDDEN,
                   layers: int = len(LAYERS)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, 50_000, (num_tokens,), generator=g)
    states = (torch.randn(num_tokens, layers, hidden, generator=g) * 3).to(dtype)  # [T, L, H]
    return token_ids, states


def save_request(connector, request_id: str, token_ids: torch.Tensor, states: torch.Tensor, *, chunks: int = 3,
                 params: dict | None = None, loss_mask: torch.Tensor | None = None, sample_id: str | None = None,
                 num_prompt_tokens: int | None = None) -> str:
    """Feed one request through the connector as an engine does; return the path it reports."""
    n_prompt = token_ids.shape[0] if num_prompt_tokens is None else num_prompt_tokens
    connector.start_request(RequestInfo(request_id, n_prompt, params or {}, sample_id=sample_id, loss_mask=loss_mask))
    for ids, rows in zip(token_ids.tensor_split(chunks), states.tensor_split(chunks)):
        connector.save_hidden_states(request_id, ids, rows)
    return connector.request_finished(request_id)["hidden_states_path"]


@pytest.mark.parametrize("num_tokens", [1, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hidden_states_round_trip_bit_exact(backend, connector_factory, dtype, num_tokens):
    connector = connector_factory(backend.root, make_spec(dtype, LAYERS, HIDDEN),
                                  storage_options=backend.storage_options)
    token_ids, states = random_request(num_tokens, dtype)

    path = save_request(connector, "req-1", token_ids, states, chunks=4)
    assert connector.wait_for_save() == {}

    assert backend.key(path) == backend.key(backend.url("req-1.safetensors"))  # the default name
    got = load_hidden_states(path, storage_options=backend.storage_options)
    assert set(got) == {"token_ids", "hidden_states"}
    assert got["token_ids"].dtype == torch.int64 and torch.equal(got["token_ids"], token_ids)
    assert got["hidden_states"].dtype == dtype and got["hidden_states"].shape == (num_tokens, len(LAYERS), HIDDEN)
    assert torch.equal(got["hidden_states"], states)
    # nothing else left in the store: no temp file, no lock
    stored = {k for k in backend.files() if k.startswith(backend.key(backend.root))}
    assert stored == {backend.key(path)}


def test_written_files_are_plain_safetensors_that_the_safetensors_library_reads(backend, connector_factory):
    """Interchangeable with vLLM's files: the reference library, not our reader, decodes what the connector wrote."""
    connector = connector_factory(backend.root, make_spec(torch.bfloat16, LAYERS, HIDDEN),
                                  storage_options=backend.storage_options)
    token_ids, states = random_request(77, torch.bfloat16, seed=9)
    mask = (torch.arange(77) % 3 == 0).to(torch.uint8)
    path = save_request(connector, "interop", token_ids, states, chunks=5, loss_mask=mask, sample_id="s-1")
    empty = save_request(connector, "empty", token_ids[:0], states[:0], chunks=1)
    assert connector.wait_for_save() == {}

    blob = backend.fs.cat_file(backend.key(path))
    decoded = safetensors.torch.load(blob)
    assert torch.equal(decoded["token_ids"], token_ids) and torch.equal(decoded["hidden_states"], states)
    assert torch.equal(decoded["loss_mask"], mask)
    assert (8 + int.from_bytes(blob[:8], "little")) % 8 == 0  # data starts 8-byte aligned
    if backend.name == "local":
        with safetensors.safe_open(path, framework="pt") as f:
            assert f.metadata()["sample_id"] == "s-1" and f.metadata()["layer_ids"] == "[2, 4, 6]"
            assert torch.equal(f.get_slice("hidden_states")[10:20], states[10:20])
    nothing = safetensors.torch.load(backend.fs.cat_file(backend.key(empty)))
    assert nothing["hidden_states"].shape == (0, len(LAYERS), HIDDEN) and nothing["hidden_states"].dtype == torch.bfloat16


def test_partial_loads_return_exactly_the_rows_and_layers_asked_for(backend, connector_factory):
    connector = connector_factory(backend.root, make_spec(torch.bfloat16, LAYERS, HIDDEN),
                                  storage_options=backend.storage_options)
    token_ids, states = random_request(300, torch.bfloat16, seed=1)
    path = save_request(connector, "partial", token_ids, states)
    assert connector.wait_for_save() == {}
    opts = backend.storage_options

    part = load_hidden_states(path, token_range=(100, 164), storage_options=opts)
    assert torch.equal(part["token_ids"], token_ids[100:164])
    assert torch.equal(part["hidden_states"], states[100:164])

    by_id = load_hidden_states(path, layer_ids=[6, 2], storage_options=opts)  # ids, in the order asked
    assert torch.equal(by_id["hidden_states"], states[:, [2, 0]])
    assert torch.equal(by_id["token_ids"], token_ids)

    by_index = load_hidden_states(path, layer_indices=[1], storage_options=opts)
    assert torch.equal(by_index["hidden_states"], states[:, [1]])

    both = load_hidden_states(path, token_range=(7, 9), layer_ids=[4], storage_options=opts)
    assert torch.equal(both["hidden_states"], states[7:9, [1]])
    assert torch.equal(both["token_ids"], token_ids[7:9])

    clipped = load_hidden_states(path, token_range=(290, 10_000), storage_options=opts)
    assert torch.equal(clipped["hidden_states"], states[290:])
    empty = load_hidden_states(path, token_range=(50, 50), storage_options=opts)
    assert empty["hidden_states"].shape == (0, len(LAYERS), HIDDEN) and empty["token_ids"].shape == (0,)

    with pytest.raises(ValueError, match=r"layer ids \[3\] are not in .*stores \[2, 4, 6\]"):
        load_hidden_states(path, layer_ids=[3], storage_options=opts)
    with pytest.raises(ValueError, match="not both"):
        load_hidden_states(path, layer_ids=[2], layer_indices=[0], storage_options=opts)
    with pytest.raises(ValueError, match=r"layer_indices \[3\] out of range"):
        load_hidden_states(path, token_range=(0, 5), layer_indices=[3], storage_options=opts)


def test_missing_file_raises_file_not_found_naming_it(backend):
    url = backend.url("never-written.safetensors")
    with pytest.raises(FileNotFoundError, match="never-written.safetensors"):
        load_hidden_states(url, storage_options=backend.storage_options, wait_timeout=1)
    with pytest.raises(FileNotFoundError, match="never-written.safetensors"):
        read_hidden_states_info(url, storage_options=backend.storage_options, wait_timeout=1)
    with pytest.raises(FileNotFoundError):
        load_hidden_states(url, token_range=(0, 1), storage_options=backend.storage_options, wait_timeout=1)


def test_cleanup_removes_file_and_lock_and_is_idempotent(backend, connector_factory):
    connector = connector_factory(backend.root, make_spec(), storage_options=backend.storage_options)
    kept = save_request(connector, "kept", *random_request(5, torch.float32))
    gone = save_request(connector, "gone", *random_request(5, torch.float32))
    assert connector.wait_for_save() == {}
    for url in (kept, gone):  # a lock left behind, as vLLM leaves them
        backend.put(url + LOCK_SUFFIX, b"")
    opts = backend.storage_options

    cleanup_hidden_states(kept, keep_hidden_states=True, storage_options=opts)
    assert backend.exists(kept) and not backend.exists(kept + LOCK_SUFFIX)

    cleanup_hidden_states(gone, storage_options=opts)
    assert not backend.exists(gone) and not backend.exists(gone + LOCK_SUFFIX)
    cleanup_hidden_states(gone, storage_options=opts)  # again: nothing to do, no error
    cleanup_hidden_states(backend.url("never-existed.safetensors"), storage_options=opts)
    with pytest.raises(FileNotFoundError):
        load_hidden_states(gone, storage_options=opts, wait_timeout=1)
    assert load_hidden_states(kept, storage_options=opts)["token_ids"].shape == (5,)


def test_metadata_round_trips_through_read_hidden_states_info(backend, connector_factory):
    spec = make_spec(torch.bfloat16, LAYERS, HIDDEN)
    connector = connector_factory(backend.root, spec, storage_options=backend.storage_options)
    token_ids, states = random_request(12, torch.bfloat16, seed=3)
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 1], dtype=torch.uint8)  # 10 prompt tokens, 2 output rows
    path = save_request(connector, "with-meta", token_ids, states, loss_mask=mask, sample_id="corpus/17",
                        num_prompt_tokens=10, params={"include_output_tokens": True})
    assert connector.wait_for_save() == {}

    info = read_hidden_states_info(path, storage_options=backend.storage_options)
    assert info.has_hsx_metadata
    assert (info.num_tokens, info.num_layers, info.hidden_size, info.dtype) == (12, 3, HIDDEN, torch.bfloat16)
    assert info.layer_ids == LAYERS
    meta = info.metadata
    assert meta["layer_id_convention"] == "vllm" and meta["last_layer_normalized"] == "false"
    assert (meta["num_hidden_layers"], meta["hidden_size"], meta["dtype"]) == ("8", str(HIDDEN), "bfloat16")
    assert (meta["model"], meta["model_revision"]) == ("tiny/test-model", "abc123")
    assert (meta["request_id"], meta["sample_id"]) == ("with-meta", "corpus/17")
    assert (meta["num_tokens"], meta["num_prompt_tokens"], meta["include_output_tokens"]) == ("12", "10", "true")
    assert info.size == backend.files()[backend.key(path)]

    got = load_hidden_states(path, storage_options=backend.storage_options)
    assert got["loss_mask"].tolist() == [0, 0, 0] + [1] * 9  # output rows count as 1
    assert torch.equal(got["hidden_states"], states)


def test_vllm_style_file_without_metadata_and_with_leftover_lock_loads(backend):
    token_ids, states = random_request(20, torch.bfloat16, seed=4, layers=4, hidden=16)
    # what vLLM's connector writes: two tensors, no __metadata__, and the .lock it never removes
    data = safetensors.torch.save({"token_ids": token_ids, "hidden_states": states})
    url = backend.url("vllm/req-0.safetensors")
    backend.put(url, data)
    backend.put(url + LOCK_SUFFIX, b"")
    opts = backend.storage_options

    got = load_hidden_states(url, storage_options=opts, wait_timeout=5)
    assert torch.equal(got["token_ids"], token_ids) and torch.equal(got["hidden_states"], states)
    info = read_hidden_states_info(url, storage_options=opts, wait_timeout=5)
    assert info.layer_ids is None and not info.has_hsx_metadata and info.num_layers == 4
    rows = load_hidden_states(url, token_range=(3, 6), layer_indices=[3, 0], storage_options=opts, wait_timeout=5)
    assert torch.equal(rows["hidden_states"], states[3:6, [3, 0]])
    with pytest.raises(ValueError, match="layer_indices"):  # no layer ids recorded: the error says what to use
        load_hidden_states(url, layer_ids=[2], storage_options=opts, wait_timeout=5)


def test_load_waits_for_a_pending_write_then_succeeds(backend):
    token_ids, states = random_request(64, torch.float32, seed=5)
    url = backend.url("pending/req.safetensors")
    result: dict = {}
    finished = threading.Event()

    def load() -> None:
        try:
            result["value"] = load_hidden_states(url, storage_options=backend.storage_options, wait_timeout=30)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            result["error"] = e
        finished.set()

    with backend.writer_holding_lock(url):
        loader = threading.Thread(target=load)
        loader.start()
        # the file does not exist yet: a reader that did not honour the lock would fail at once
        assert not finished.wait(0.5), f"load returned while the write was pending: {result}"
        backend.put(url, safetensors.torch.save({"token_ids": token_ids, "hidden_states": states}))
    assert finished.wait(30)
    loader.join()
    assert "error" not in result, result
    assert torch.equal(result["value"]["hidden_states"], states)


def test_stale_lock_times_out_with_a_message_saying_what_to_do(backend):
    url = backend.url("stale/req.safetensors")
    with backend.writer_holding_lock(url):  # a writer that hangs forever
        start = time.monotonic()
        with pytest.raises(TimeoutError) as excinfo:
            load_hidden_states(url, storage_options=backend.storage_options, wait_timeout=0.5)
        assert time.monotonic() - start >= 0.5
        message = str(excinfo.value)
        assert "stale/req.safetensors" in message and "still being written after 0.5s" in message
        assert "wait_timeout" in message and "cleanup_hidden_states" in message
        with pytest.raises(TimeoutError):
            read_hidden_states_info(url, storage_options=backend.storage_options, wait_timeout=0.2)
        # the remedy the message names works: the reader stops waiting and reports the missing file
        cleanup_hidden_states(url, storage_options=backend.storage_options)
        with pytest.raises(FileNotFoundError):
            load_hidden_states(url, storage_options=backend.storage_options, wait_timeout=5)


@pytest.mark.parametrize("lock", [True, False], ids=["with-lock", "atomic-write-alone"])
def test_concurrent_reader_never_sees_a_partial_or_mixed_file(backend, connector_factory, lock):
    """Versions of one file are written over each other while readers poll it; every read is one whole version.

    Without the lock, readers do not wait at all: what they see is down to the atomic write alone."""
    num_versions, num_tokens = 6, 2048
    spec = make_spec(torch.float32, LAYERS, 64)
    connector = connector_factory(backend.root, spec, storage_options=backend.storage_options,
                                  allow_custom_save_path=True, num_writer_threads=2, use_synchronization_lock=lock)
    url = backend.url("shared/contended.safetensors")
    seen = [threading.Event() for _ in range(num_versions)]
    bad: list[str] = []
    reads = [0]
    stop = threading.Event()

    def read_loop() -> None:
        while not stop.is_set():
            try:
                got = load_hidden_states(url, storage_options=backend.storage_options, wait_timeout=30)
            except FileNotFoundError:
                continue
            except Exception as e:  # noqa: BLE001 - a partial file shows up as a parse error
                bad.append(f"{type(e).__name__}: {e}")
                continue
            states, ids = got["hidden_states"], got["token_ids"]
            version = int(ids[0])
            if (states.shape != (num_tokens, len(LAYERS), 64) or not bool((ids == version).all())
                    or not bool((states == version + 0.5).all())):
                bad.append(f"mixed or partial read: shape {tuple(states.shape)}, ids {ids.unique().tolist()[:5]}")
                continue
            reads[0] += 1
            seen[version].set()

    readers = [threading.Thread(target=read_loop) for _ in range(2)]
    for r in readers:
        r.start()
    try:
        for v in range(num_versions):
            ids = torch.full((num_tokens,), v, dtype=torch.int64)
            states = torch.full((num_tokens, len(LAYERS), 64), v + 0.5)  # never an all-zero layer
            save_request(connector, f"writer-{v}", ids, states, params={"hidden_states_path": url, "overwrite": True})
            # the next version is written while readers are busy reading this one
            assert seen[v].wait(30) or bad, f"readers never saw version {v}"
        assert connector.wait_for_save() == {}
    finally:
        stop.set()
        for r in readers:
            r.join(timeout=60)
    assert bad == []
    assert reads[0] >= num_versions


def test_local_reader_waits_while_a_vllm_style_writer_writes_in_place(tmp_path):
    """vLLM writes straight into the file under an exclusive flock; a half-written file must not be read."""
    import fcntl

    token_ids, states = random_request(256, torch.float32, seed=6)
    data = safetensors.torch.save({"token_ids": token_ids, "hidden_states": states})
    path = tmp_path / "inplace.safetensors"
    fd = open(str(path) + LOCK_SUFFIX, "w")  # noqa: SIM115 - held across the test
    fcntl.flock(fd, fcntl.LOCK_EX)
    path.write_bytes(data[: len(data) // 2])
    result: dict = {}
    finished = threading.Event()

    def load() -> None:
        try:
            result["value"] = load_hidden_states(str(path), wait_timeout=30)
        except BaseException as e:  # noqa: BLE001
            result["error"] = e
        finished.set()

    threading.Thread(target=load).start()
    assert not finished.wait(0.5), f"read a half-written file: {result}"
    path.write_bytes(data)
    fcntl.flock(fd, fcntl.LOCK_UN)
    fd.close()  # vLLM leaves the lock file itself behind
    assert finished.wait(30) and "error" not in result, result
    assert torch.equal(result["value"]["hidden_states"], states)


def test_local_partial_reads_during_replacement_never_mix_versions(tmp_path, connector_factory):
    """A token-range read of a local file that is being replaced sees one version: header and rows alike."""
    num_tokens = 512
    connector = connector_factory(str(tmp_path), make_spec(torch.float32, LAYERS, 64), allow_custom_save_path=True)
    path = str(tmp_path / "replaced.safetensors")
    stop = threading.Event()
    bad: list[str] = []
    reads = [0]

    def read_loop() -> None:
        while not stop.is_set():
            try:
                got = load_hidden_states(path, token_range=(100, 400), wait_timeout=30)
            except FileNotFoundError:
                continue
            version = int(got["token_ids"][0])
            if not bool((got["hidden_states"] == version + 0.5).all()) or not bool((got["token_ids"] == version).all()):
                bad.append(f"read mixes versions: {got['hidden_states'].unique().tolist()[:5]}")
            reads[0] += 1

    readers = [threading.Thread(target=read_loop) for _ in range(2)]
    for reader in readers:
        reader.start()
    try:
        for v in range(200):
            ids = torch.full((num_tokens,), v, dtype=torch.int64)
            states = torch.full((num_tokens, len(LAYERS), 64), v + 0.5)  # never an all-zero layer
            save_request(connector, f"w{v}", ids, states, params={"hidden_states_path": path, "overwrite": True})
        assert connector.wait_for_save() == {}
    finally:
        stop.set()
        for reader in readers:
            reader.join(timeout=60)
    assert bad == [] and reads[0] > 0


_RANGE = re.compile(r"bytes=(\d+)-(\d+)")


def test_remote_token_range_load_fetches_only_the_header_and_the_rows_asked_for(remote_backend, connector_factory):
    num_tokens, hidden, first, last = 4096, 128, 2000, 2100
    connector = connector_factory(remote_backend.root, make_spec(torch.float16, LAYERS, hidden),
                                  storage_options=remote_backend.storage_options)
    token_ids, states = random_request(num_tokens, torch.float16, seed=7, hidden=hidden)
    url = save_request(connector, "big", token_ids, states)
    assert connector.wait_for_save() == {}
    size = remote_backend.files()[remote_backend.key(url)]
    needed = (last - first) * (8 + len(LAYERS) * hidden * 2)  # token ids + rows
    info = read_hidden_states_info(url, storage_options=remote_backend.storage_options)
    hs, ids = info.tensors["hidden_states"], info.tensors["token_ids"]
    wanted_spans = [(ids.start + first * 8, ids.start + last * 8),
                    (hs.start + first * hs.row_bytes, hs.start + last * hs.row_bytes)]

    with LoopbackProxy(remote_backend.endpoint) as proxy:
        options = remote_backend.options_via(proxy.endpoint)
        got = load_hidden_states(url, token_range=(first, last), storage_options=options)
        ranged = proxy.body_bytes_sent
        ranges = [e.range for e in proxy.log if e.method == "GET" and e.range]
        proxy.reset_log()
        load_hidden_states(url, storage_options=options)  # control: the meter does see a whole read
        whole = proxy.body_bytes_sent

    assert torch.equal(got["hidden_states"], states[first:last]) and torch.equal(got["token_ids"], token_ids[first:last])
    assert whole >= size
    # one header probe plus the two row spans; a few KB of slack for JSON object metadata (gcs)
    assert needed <= ranged <= min(size, HEADER_PROBE_BYTES) + needed + 8192, (ranged, needed, size)
    assert ranged < size // 10
    for header in ranges:
        b, e = map(int, _RANGE.fullmatch(header).groups())
        is_probe = b == 0 and e < HEADER_PROBE_BYTES
        in_rows = any(lo <= b and e < hi for lo, hi in wanted_spans)
        assert is_probe or in_rows, f"fetched bytes {b}-{e}, outside the header and the rows asked for"


def test_an_exclusive_create_asks_the_store_to_refuse_an_existing_object(remote_backend):
    # the writer lease's guarantee (one `hsx run` per output) rests on this: the upload carries the store's own
    # create-only precondition, so two writers racing past any existence check cannot both succeed. S3 (moto) enforces
    # If-None-Match; the GCS emulator ignores ifGenerationMatch=0 (real GCS answers 412, which gcsfs raises as
    # FileExistsError), so there what reaches the server is the check
    from connectors import storage

    with LoopbackProxy(remote_backend.endpoint) as proxy:
        fs = fsspec.filesystem(remote_backend.name, **remote_backend.options_via(proxy.endpoint))
        path = remote_backend.key(f"{remote_backend.root}/run/writer.lease")
        assert storage.create_exclusive(fs, path, b"first")
        writes = [e for e in proxy.log if e.method in ("PUT", "POST")]
        if remote_backend.name == "s3":
            assert not storage.create_exclusive(fs, path, b"second")
            assert [e.if_none_match for e in writes] == ["*"]
        else:
            assert writes and all("ifGenerationMatch=0" in e.path for e in writes), [e.path for e in writes]
    assert remote_backend.fs.cat(path) == b"first"


def test_a_sample_reads_by_its_byte_range_of_a_shard_as_it_reads_as_a_file(backend, connector_factory, tmp_path):
    """A shard (connectors.shards) is the samples' own files one after another: every reader, given a sample's
    (offset, length), reads it as it reads the file alone — and never a byte of its neighbours."""
    from connectors.format import HiddenStatesFileError
    from connectors.reader import read_rows, verify_hidden_states
    from connectors.shards import SHARD_ALIGN, write_shard
    from connectors.storage import open_url

    local = tmp_path / "staged"
    connector = connector_factory(str(local), make_spec(torch.bfloat16, LAYERS, HIDDEN))
    requests = [random_request(n, torch.bfloat16, seed=n) for n in (1, 300, 17, 4096)]
    files = [save_request(connector, f"r{i}", ids, states, loss_mask=(torch.arange(len(ids)) % 2).to(torch.uint8),
                          sample_id=f"s{i}") for i, (ids, states) in enumerate(requests)]
    assert connector.wait_for_save() == {}
    fs, path = open_url(backend.url("shards/one.hsxshard"), backend.storage_options)
    spans = write_shard(fs, path, files)
    assert [n for _, n in spans] == [os.path.getsize(f) for f in files]
    assert all(o % SHARD_ALIGN == 0 for o, _ in spans) and backend.files()[backend.key(path)] == sum(spans[-1])
    url, opts = backend.url("shards/one.hsxshard"), backend.storage_options
    for (ids, states), span, file in zip(requests, spans, files):
        whole = load_hidden_states(url, byte_range=span, storage_options=opts, verify=True)
        alone = load_hidden_states(file)
        assert whole.keys() == alone.keys() and all(torch.equal(whole[k], alone[k]) for k in alone)
        assert torch.equal(whole["hidden_states"], states)
        rows = load_hidden_states(url, byte_range=span, storage_options=opts, token_range=(0, 5), layer_ids=[4],
                                  verify=True)
        assert torch.equal(rows["hidden_states"], states[:5, [1]]) and torch.equal(rows["token_ids"], ids[:5])
        info = read_hidden_states_info(url, byte_range=span, storage_options=opts)
        assert info.size == span[1] and info.metadata["sample_id"] == alone_id(file)
        assert verify_hidden_states(url, byte_range=span, storage_options=opts).num_tokens == len(ids)
        got_info, got = read_rows(fs, path, 7, byte_range=span)  # the training feed's read (local: mapped)
        assert torch.equal(got["hidden_states"], states[:7]) and got_info.size == span[1]
    # a range past the object's end, or one that starts inside another sample, is refused naming the problem
    end = spans[-1][0] + spans[-1][1]
    with pytest.raises(HiddenStatesFileError, match=r"are not inside the object, which holds"):
        load_hidden_states(url, byte_range=(spans[-1][0], spans[-1][1] + 1), storage_options=opts)
    with pytest.raises(HiddenStatesFileError, match=r"are not inside the object"):
        read_hidden_states_info(url, byte_range=(end, 8), storage_options=opts)
    with pytest.raises(HiddenStatesFileError):
        load_hidden_states(url, byte_range=(spans[1][0] + 8, spans[1][1] - 8), storage_options=opts)
    # a range one sample too short: its header says more bytes than the range holds
    with pytest.raises(HiddenStatesFileError):
        load_hidden_states(url, byte_range=(spans[1][0], spans[1][1] - 1), storage_options=opts)


def alone_id(file: str) -> str:
    return read_hidden_states_info(file).metadata["sample_id"]
