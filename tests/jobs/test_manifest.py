"""The manifest, run.json and file-size arithmetic, without Ray: atomic parts, counting by sample, refused resumes,
exact safetensors header sizes."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import safetensors.torch
import torch

from connectors.format import HiddenStatesSpec
from connectors.header import encode_header
from connectors.manifest import RESULT_SCHEMA, committed_ids, read_manifest, settled_ids
from connectors.manifest_writer import ManifestWriter, summarize
from connectors.run import RunDir, RunSpec, Sampling, data_path
from jobs.config import JobConfig
from jobs.runinfo import RunMismatch, ensure_run_spec


def _rows(*rows, retry: bool | None = None):
    """Manifest rows (sample_id, status); failed ones with `retry` (None: as older runs, retried)."""
    cols = {n: [] for n in RESULT_SCHEMA.names}
    for sid, status in rows:
        ok = status == "ok"
        for k, v in dict(sample_id=sid, status=status, path=data_path(sid) if ok else None, num_tokens=10 if ok else 0,
                         num_prompt_tokens=10, bytes=100 if ok else 0, error=None if ok else f"x.jsonl:3: bad {sid}",
                         source="x.jsonl:3", truncated=False, checksum=None,
                         retry=None if ok else retry, offset=None).items():
            cols[k].append(v)
    return pa.Table.from_pydict(cols, schema=RESULT_SCHEMA)


def test_failures_that_repeat_stay_failed_on_a_resume_unless_retry_failed(tmp_path):
    out = RunDir(str(tmp_path))
    w = ManifestWriter(out, "A")
    w.add(_rows(("malformed", "failed"), ("over-length", "failed"), retry=False))  # the record itself: every time
    w.add(_rows(("engine", "failed"), retry=True))  # may pass on a retry
    w.add(_rows(("old", "failed")))  # an older run's row (no retry column value): retried, as it was
    w.add(_rows(("good", "ok")))
    w.flush()
    assert settled_ids(out) == {"good", "malformed", "over-length"}
    assert settled_ids(out, retry_failed=True) == {"good"}
    w = ManifestWriter(out, "B")  # --retry-failed: one record now passes, the other fails transiently
    w.add(_rows(("malformed", "ok")))
    w.add(_rows(("over-length", "failed"), retry=True))
    w.flush()
    assert settled_ids(out) == {"good", "malformed"}
    s = summarize(out)
    assert (s.ok, s.failed, s.failed_for_good) == (2, 3, 0)
    w = ManifestWriter(out, "C")
    w.add(_rows(("over-length", "failed"), retry=False))
    w.flush()
    assert settled_ids(out) == {"good", "malformed", "over-length"}
    assert summarize(out).failed_for_good == 1


def test_parts_appear_whole_and_pyarrow_reads_the_folder_as_the_manifest(tmp_path):
    out = RunDir(str(tmp_path / "run"))
    w = ManifestWriter(out, "A", flush_rows=2, flush_seconds=3600)
    w.add(_rows(("a", "ok")))
    assert not w.maybe_flush() and not os.path.exists(tmp_path / "run" / "manifest")
    w.add(_rows(("b", "failed")))
    assert w.maybe_flush()
    # a temp file left by a writer killed mid-write is invisible to readers
    (tmp_path / "run" / "manifest" / ".part-X-000000.parquet.tmp-dead").write_bytes(b"PAR1 partial")
    w.add(_rows(("b", "ok"), ("c", "failed")))
    w.flush()
    table = pq.read_table(str(tmp_path / "run" / "manifest"))
    assert table.num_rows == 4 and set(table.column_names) >= {"sample_id", "path", "num_tokens",
                                                               "num_prompt_tokens", "status", "error", "bytes"}
    assert read_manifest(out).num_rows == 4
    assert committed_ids(out) == {"a", "b"}


def test_a_commit_that_landed_but_raised_is_replaced_by_its_retry_not_doubled(tmp_path):
    """A put can land and still raise (a timeout after the store took the object, a failed directory fsync); the
    job's failure path flushes again. The retry must put the same part (it replaces the first), not encode the rows
    anew: a part's name carries the checksum of bytes that hold the commit time, so a new encoding is a second part
    and every row in it a duplicate "ok"."""
    import errno

    class LandsThenRaises(RunDir):
        fails = 1

        def put(self, rel, data):
            super().put(rel, data)
            if self.fails:
                self.fails -= 1
                raise OSError(errno.ETIMEDOUT, "timed out waiting for the store's answer")

    out = LandsThenRaises(str(tmp_path / "run"))
    w = ManifestWriter(out, "A", flush_rows=1000, flush_seconds=3600)
    w.add(_rows(("a", "ok"), ("b", "ok")))
    with pytest.raises(OSError, match="timed out"):
        w.flush()
    w.add(_rows(("c", "ok")))  # rows that arrive meanwhile go into the next part
    w.flush()
    assert len(os.listdir(tmp_path / "run" / "manifest")) == 2
    s = summarize(out)
    assert (s.ok, s.rows, s.duplicate_ok_rows) == (3, 3, 0)
    w.flush()  # nothing left: no empty part, no repeat
    assert len(os.listdir(tmp_path / "run" / "manifest")) == 2


def test_summary_counts_samples_with_ok_winning_over_earlier_failures(tmp_path):
    out = RunDir(str(tmp_path))
    w = ManifestWriter(out, "A")
    w.add(_rows(("a", "ok"), ("b", "failed"), ("c", "failed")))
    w.flush()
    w2 = ManifestWriter(out, "B")
    w2.add(_rows(("b", "ok"), ("c", "failed")))
    w2.flush()
    s = summarize(out)
    assert (s.ok, s.failed, s.rows, s.duplicate_ok_rows, s.attempts, s.parts) == (2, 1, 5, 0, 2, 2)
    assert s.tokens == 20 and s.bytes == 200
    assert s.errors == [("c", "x.jsonl:3: bad c")]


def test_skipped_samples_are_settled_for_good_counted_apart_and_undone_only_by_a_later_invalid_mark(tmp_path):
    """"skipped" (--on-nonfinite skip) is a decision like "ok": a later "failed" row (a duplicate record) does not
    undo it, a resume skips it, and it is neither committed (no file) nor failed."""
    out = RunDir(str(tmp_path))
    w = ManifestWriter(out, "A")
    w.add(_rows(("a", "ok"), ("b", "skipped"), ("c", "failed"), ("d", "ok"), ("e", "skipped")))
    w.flush()
    w2 = ManifestWriter(out, "B")
    w2.add(_rows(("b", "failed"), ("d", "invalid"), ("e", "invalid")))  # b: a duplicate; d, e: marked for re-extraction
    w2.flush()
    w3 = ManifestWriter(out, "C")
    w3.add(_rows(("d", "skipped")))  # d re-extracted after the mark: its states are refused this time
    w3.flush()
    assert committed_ids(out) == {"a"}
    assert settled_ids(out) == {"a", "b", "d"}  # c failed (retried), e invalid (re-extracted)
    s = summarize(out)
    assert (s.ok, s.skipped, s.failed, s.invalid, s.duplicate_ok_rows) == (1, 2, 1, 1, 0)
    assert s.skips == [("b", "x.jsonl:3: bad b"), ("d", "x.jsonl:3: bad d")]
    assert s.errors == [("c", "x.jsonl:3: bad c")]


def test_data_paths_spread_over_256_subfolders_with_safe_names():
    paths = {data_path(f"sample-{i}") for i in range(2000)}
    assert len({p.split("/")[1] for p in paths}) == 256
    escape = data_path("../../etc/passwd")
    assert escape.startswith("data/") and escape.count("/") == 2 and "/.." not in escape
    assert data_path("a/b") != data_path("a_b")


def _info(**over):
    files = {"model": "/m", "model_revision": "", "layer_ids": (2, 4), "num_hidden_layers": 4, "hidden_size": 8,
             "dtype": "float32"}
    job = {"model_fingerprint": "f", "chat_template_sha256": "t", "max_tokens": 0, "include_output_tokens": False,
           "sampling": None, "id_field": "id", "corpus": ("a",)}
    files.update({k: v for k, v in over.items() if k in files})
    job.update({k: v for k, v in over.items() if k not in files})
    return RunSpec(HiddenStatesSpec(**files), **job)


def test_resume_into_a_run_made_with_other_settings_is_refused(tmp_path):
    out = RunDir(str(tmp_path))
    assert ensure_run_spec(out, _info()) is True
    assert ensure_run_spec(out, _info(corpus=("a", "b"))) is False  # more corpus: fine
    with pytest.raises(RunMismatch, match=r"layer_ids: run has \[2, 4\], this job has \[1, 4\] \(--layers\)"):
        ensure_run_spec(out, _info(layer_ids=(1, 4)))
    with pytest.raises(RunMismatch, match="--dtype"):
        ensure_run_spec(out, _info(dtype="bfloat16"))
    with pytest.raises(RunMismatch, match="--model"):
        ensure_run_spec(out, _info(model="/other"))
    with pytest.raises(RunMismatch, match="--temperature"):
        ensure_run_spec(out, _info(max_tokens=0, sampling=Sampling(temperature=0.5)))
    assert json.loads((tmp_path / "run.json").read_text())["layer_ids"] == [2, 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 7, 1234])
def test_header_size_matches_safetensors_exactly(dtype, t):
    meta = {"model": "/tmp/é/model", "layer_ids": "[2, 16, 29, 32]", "sample_id": 'quote"d\\id', "n": str(t)}
    tensors = {"token_ids": torch.zeros(t, dtype=torch.int64), "hidden_states": torch.zeros(t, 3, 5, dtype=dtype),
               "loss_mask": torch.zeros(t, dtype=torch.uint8)}
    blob = safetensors.torch.save(tensors, metadata=meta)
    size = torch.finfo(dtype).bits // 8
    # the connector's own header encoding: as long as safetensors' own, non-ASCII metadata included
    header = encode_header({"token_ids": (torch.int64, (t,)), "hidden_states": (dtype, (t, 3, 5)),
                            "loss_mask": (torch.uint8, (t,))}, meta)
    predicted = len(header) + t * 8 + t * 15 * size + t
    assert predicted == len(blob)


def test_job_config_rejects_output_tokens_without_generation():
    with pytest.raises(ValueError, match="--max-tokens"):
        JobConfig(model="m", corpus=("c",), output="o", include_output_tokens=True)
