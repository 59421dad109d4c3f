"""The connector as an engine drives it: requests are isolated from each other, and a producer faster than storage
is held to `max_bytes_in_flight`."""

from __future__ import annotations

import logging
import os
import threading

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from connectors import PathRejected, RequestInfo, load_hidden_states
from tests.connectors.conftest import make_spec


def rows(num_tokens: int, fill: float, hidden: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((num_tokens,), int(fill)), torch.full((num_tokens, 3, hidden), float(fill))


def test_rejected_path_fails_only_its_own_request(tmp_path, connector_factory):
    connector = connector_factory(str(tmp_path / "run"), make_spec(), allow_custom_save_path=True)
    for i in range(3):
        connector.start_request(RequestInfo(f"good-{i}", 8))
    with pytest.raises(PathRejected):
        connector.start_request(RequestInfo("bad", 8, {"hidden_states_path": str(tmp_path / "x.safetensors")}))
    for chunk in range(2):  # chunks of the good requests interleave, as in a batch
        for i in range(3):
            connector.save_hidden_states(f"good-{i}", *rows(4, fill=10 * i + chunk))
    paths = [connector.request_finished(f"good-{i}")["hidden_states_path"] for i in range(3)]
    assert connector.wait_for_save() == {}

    for i, path in enumerate(paths):
        got = load_hidden_states(path)
        expected = torch.cat([rows(4, 10 * i)[1], rows(4, 10 * i + 1)[1]])
        assert torch.equal(got["hidden_states"], expected)
    assert sorted(os.listdir(tmp_path / "run")) == [f"good-{i}.safetensors" for i in range(3)]


def test_failed_write_is_reported_for_its_request_only_and_leaves_nothing(tmp_path, connector_factory, caplog):
    root = tmp_path / "run"
    root.mkdir()
    connector = connector_factory(str(root), make_spec(), allow_custom_save_path=True, max_write_attempts=3,
                                  write_retry_backoff_s=0.01)
    for rid, params in [("ok-1", {}), ("doomed", {"hidden_states_path": "blocked.safetensors"}), ("ok-2", {})]:
        connector.start_request(RequestInfo(rid, 4, params))
        if rid == "doomed":  # the target name is taken by a directory after the request started (checked then)
            (root / "blocked.safetensors").mkdir()
        connector.save_hidden_states(rid, *rows(4, 1.0))
        connector.request_finished(rid)

    with caplog.at_level(logging.ERROR, logger="connectors.example_hidden_states_connector"):
        failures = connector.wait_for_save()
    assert list(failures) == ["doomed"]
    assert isinstance(failures["doomed"], IsADirectoryError)
    assert any("doomed" in r.getMessage() for r in caplog.records)
    assert connector.wait_for_save() == {}  # reported once
    assert sorted(os.listdir(root)) == ["blocked.safetensors", "ok-1.safetensors", "ok-2.safetensors"]
    assert os.listdir(root / "blocked.safetensors") == []  # no temp file or lock left behind


def test_aborted_request_writes_nothing(tmp_path, connector_factory):
    connector = connector_factory(str(tmp_path), make_spec())
    connector.start_request(RequestInfo("aborted", 4))
    connector.save_hidden_states("aborted", *rows(4, 1.0))
    connector.abort_request("aborted")
    with pytest.raises(KeyError, match="not in flight"):
        connector.request_finished("aborted")
    assert connector.wait_for_save() == {}
    assert os.listdir(tmp_path) == []


def test_request_id_already_in_flight_is_refused(tmp_path, connector_factory):
    connector = connector_factory(str(tmp_path), make_spec())
    connector.start_request(RequestInfo("same", 4))
    with pytest.raises(ValueError, match="already in flight"):
        connector.start_request(RequestInfo("same", 4))


@pytest.mark.parametrize(("token_ids", "states", "match"), [
    (torch.arange(4), torch.zeros(4, 2, 32), r"hidden_states \[t, 3, 32\]"),  # wrong L
    (torch.arange(4), torch.zeros(4, 3, 16), r"hidden_states \[t, 3, 32\]"),  # wrong H
    (torch.arange(3), torch.zeros(4, 3, 32), r"expected token_ids \[t\]"),  # row counts differ
    (torch.arange(4), torch.zeros(4, 3, 32, dtype=torch.bfloat16), "bfloat16.*float32"),
])
def test_rows_that_do_not_match_the_spec_are_refused(tmp_path, connector_factory, token_ids, states, match):
    connector = connector_factory(str(tmp_path), make_spec(torch.float32, hidden_size=32))
    connector.start_request(RequestInfo("r", 4))
    with pytest.raises(ValueError, match=match):
        connector.save_hidden_states("r", token_ids, states)


def test_loss_mask_of_the_wrong_length_is_refused(tmp_path, connector_factory):
    connector = connector_factory(str(tmp_path), make_spec())
    with pytest.raises(ValueError, match=r"loss_mask has shape \[3\], expected \[4\]"):
        connector.start_request(RequestInfo("r", 4, loss_mask=torch.ones(3)))


# -- backpressure ----------------------------------------------------------------------------------------------------
class GatedMemoryFileSystem(MemoryFileSystem):
    """In-memory storage whose data writes wait at a gate the test opens: storage slower than the producer.

    It also counts the files that have *landed* (are readable at their final name), so the test can work out what
    the connector is holding without asking the connector.
    """

    protocol = ("gatedmem",)

    def __init__(self, gate: threading.Event, witness: dict, **kwargs) -> None:
        super().__init__(**kwargs)
        self.gate, self.witness = gate, witness

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("gatedmem://") if isinstance(path, str) else path)

    def pipe_file(self, path, value, **kwargs):
        data_write = not path.endswith(".lock")
        if data_write:
            with self.witness["cond"]:
                self.witness["waiting"] += 1
                self.witness["concurrent"] = max(self.witness["concurrent"], self.witness["waiting"])
                self.witness["cond"].notify_all()
            assert self.gate.wait(30), "the test never opened the gate"
        super().pipe_file(path, value, **kwargs)
        if data_write:
            with self.witness["cond"]:
                self.witness["waiting"] -= 1

    def mv(self, path1, path2, **kwargs):  # the connector's temp-file-and-move path on generic filesystems
        super().mv(path1, path2, **kwargs)
        with self.witness["cond"]:
            self.witness["landed"] += 1


@pytest.fixture
def gated_storage(connector_factory):
    """(gate, witness); depends on connector_factory so that the gate opens before connectors shut down."""
    fsspec.register_implementation("gatedmem", GatedMemoryFileSystem, clobber=True)
    gate = threading.Event()
    witness = {"cond": threading.Condition(), "waiting": 0, "concurrent": 0, "landed": 0}
    yield gate, witness
    gate.set()


def test_producer_faster_than_storage_blocks_within_max_bytes_in_flight(gated_storage, connector_factory):
    gate, witness = gated_storage
    num_tokens, hidden, n = 256, 32, 8
    request_bytes = num_tokens * 8 + num_tokens * 3 * hidden * 4  # token ids + fp32 rows
    bound = int(2.5 * request_bytes)  # two requests fit, the third must wait
    root = f"gatedmem://bp-{os.getpid()}-{id(gate)}/run"
    connector = connector_factory(root, make_spec(torch.float32, hidden_size=hidden), num_writer_threads=8,
                                  max_bytes_in_flight=bound, storage_options={"gate": gate, "witness": witness})
    finished: list[int] = []
    held: list[int] = []  # after each hand-over: bytes handed to the connector and not yet landed
    progressed = threading.Condition()

    def produce() -> None:
        for i in range(n):
            connector.start_request(RequestInfo(f"r{i}", num_tokens))
            connector.save_hidden_states(f"r{i}", *rows(num_tokens, float(i + 1), hidden))
            connector.request_finished(f"r{i}")
            with witness["cond"]:
                held.append((i + 1 - witness["landed"]) * request_bytes)
            with progressed:
                finished.append(i)
                progressed.notify_all()

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    with witness["cond"]:  # the admitted writes reach storage and wait there
        assert witness["cond"].wait_for(lambda: witness["waiting"] >= 2, timeout=30)
    with progressed:
        assert progressed.wait_for(lambda: len(finished) >= 2, timeout=30)
        # storage is stuck: the third hand-over must block rather than buffer
        assert not progressed.wait_for(lambda: len(finished) > 2, timeout=0.5), "request_finished did not block"
    assert witness["waiting"] == 2

    gate.set()
    producer.join(timeout=60)
    assert finished == list(range(n))
    assert connector.wait_for_save() == {}
    assert max(held) <= bound
    assert request_bytes * 2 <= connector.peak_bytes_in_flight <= bound
    assert witness["concurrent"] == 2
    for i in range(n):
        got = load_hidden_states(f"{root}/r{i}.safetensors", storage_options={"gate": gate, "witness": witness})
        assert bool((got["hidden_states"] == i + 1).all())


def test_request_larger_than_the_bound_is_written_alone_without_deadlock(gated_storage, connector_factory):
    gate, witness = gated_storage
    gate.set()  # storage is free; what is limited is the bound
    root = f"gatedmem://big-{os.getpid()}-{id(gate)}/run"
    connector = connector_factory(root, make_spec(torch.float32, hidden_size=32), num_writer_threads=4,
                                  max_bytes_in_flight=1000, storage_options={"gate": gate, "witness": witness})
    for i in range(4):  # each ~50 KB, fifty times the bound
        connector.start_request(RequestInfo(f"r{i}", 128))
        connector.save_hidden_states(f"r{i}", *rows(128, float(i + 1)))
        connector.request_finished(f"r{i}")
    assert connector.wait_for_save(timeout=30) == {}
    assert witness["concurrent"] == 1  # one at a time
    assert connector.peak_bytes_in_flight == 128 * 8 + 128 * 3 * 32 * 4


def batch_rows(batch: int, width: int, length: int, hidden: int, fill: float) -> tuple[torch.Tensor, list[tuple]]:
    """An engine-style batch: one [B, W, 3, H] tensor with each row's first `length` columns real (the rest padding),
    and per request the views it hands over — rows share the batch's buffer, as the engine's do."""
    states = torch.full((batch, width, 3, hidden), -1.0)
    out = []
    for b in range(batch):
        states[b, :length] = fill + b + 1  # never all zeros: the connector refuses to commit a zero layer
        out.append((torch.full((length,), b), states[b, :length]))
    return states, out


def test_rows_of_one_batch_hold_its_whole_buffer_once(gated_storage, connector_factory):
    """The bound is on memory held: a batch's buffer (padding and all rows) counts once, whole, until its last row is
    written. Rows of an admitted batch never wait for each other; the next batch's buffer waits for room."""
    gate, witness = gated_storage
    batch, width, length, hidden = 4, 256, 32, 32
    buffer_bytes = batch * width * 3 * hidden * 4  # the rows themselves are 1/8 of it
    root = f"gatedmem://shared-{os.getpid()}-{id(gate)}/run"
    connector = connector_factory(root, make_spec(torch.float32, hidden_size=hidden), num_writer_threads=16,
                                  max_bytes_in_flight=int(1.5 * buffer_bytes),
                                  storage_options={"gate": gate, "witness": witness})
    handed: list[str] = []
    progressed = threading.Condition()

    def produce() -> None:
        for k in range(3):
            _, views = batch_rows(batch, width, length, hidden, fill=100.0 * k)  # the batch tensor lives on in views
            for b, (ids, states) in enumerate(views):
                rid = f"batch{k}-row{b}"
                connector.start_request(RequestInfo(rid, length))
                connector.save_hidden_states(rid, ids, states)
                connector.request_finished(rid)
                with progressed:
                    handed.append(rid)
                    progressed.notify_all()

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    with witness["cond"]:  # all four rows of batch 0 reach storage together: they share one buffer
        assert witness["cond"].wait_for(lambda: witness["waiting"] == batch, timeout=30)
    with progressed:  # the producer notes a row after request_finished returns, which may be after it is stored
        progressed.wait_for(lambda: len(handed) >= batch, timeout=5)
        assert handed == [f"batch0-row{b}" for b in range(batch)]
        # counting rows alone, batch 1 (another 1/8 of a buffer per batch) would fit many times over; its buffer
        # does not fit beside batch 0's, so its first row waits
        assert not progressed.wait_for(lambda: len(handed) > batch, timeout=0.5), "batch 1 was admitted"
    assert witness["waiting"] == batch

    gate.set()
    producer.join(timeout=60)
    assert len(handed) == 3 * batch
    assert connector.wait_for_save() == {}
    assert witness["concurrent"] == batch  # never two batches' buffers at once
    for k in range(3):
        for b in range(batch):
            got = load_hidden_states(f"{root}/batch{k}-row{b}.safetensors",
                                     storage_options={"gate": gate, "witness": witness})
            assert got["hidden_states"].shape == (length, 3, hidden)
            assert bool((got["hidden_states"] == 100.0 * k + b + 1).all())


def test_batch_buffer_larger_than_the_bound_is_admitted_alone_rows_together(gated_storage, connector_factory):
    gate, witness = gated_storage
    gate.set()
    batch, width, length, hidden = 4, 64, 16, 32
    root = f"gatedmem://bigbatch-{os.getpid()}-{id(gate)}/run"
    connector = connector_factory(root, make_spec(torch.float32, hidden_size=hidden), num_writer_threads=8,
                                  max_bytes_in_flight=1000, storage_options={"gate": gate, "witness": witness})
    for k in range(2):
        _, views = batch_rows(batch, width, length, hidden, fill=10.0 * k)
        for b, (ids, states) in enumerate(views):
            connector.start_request(RequestInfo(f"b{k}-{b}", length))
            connector.save_hidden_states(f"b{k}-{b}", ids, states)
            connector.request_finished(f"b{k}-{b}")
    assert connector.wait_for_save(timeout=30) == {}
    assert len([p for p in fsspec.filesystem("gatedmem", gate=gate, witness=witness).find(root)
                if p.endswith(".safetensors")]) == 2 * batch
