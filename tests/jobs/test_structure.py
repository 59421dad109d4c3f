"""The seams between the packages: durable commits (a host-crash simulation over the real worker and manifest writer),
one validation path (bad flags exit 2 before anything is written), runs written by the previous run.json format,
estimates that match real files, a finished job that re-runs without Ray."""

from __future__ import annotations

import json
import os
import posixpath

import pyarrow as pa
import pytest

from cli.args import EXIT_USAGE
from cli.main import main
from connectors import HiddenStatesSpec
from connectors.manifest import read_manifest
from connectors.run import (
    LEGACY_DATA_LAYOUT,
    RUN_JSON,
    RunDir,
    RunFormatError,
    RunSpec,
    data_path,
    read_run_spec,
)


# -- durability: no "ok" row may point at bytes that were not on disk first ---------------------------------------
def _absolute(name, dir_fd: int | None) -> str:
    """The absolute path a (possibly dir_fd-relative) name stands for, as the kernel resolves it."""
    name = os.fspath(name)
    return name if dir_fd is None else os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), name)


class _SyscallLog:
    """Records fsync (file or directory, by path) and rename calls in order: what a crash could lose."""

    def __init__(self, monkeypatch) -> None:
        self.events: list[tuple] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd):
            path = os.readlink(f"/proc/self/fd/{fd}")
            real_fsync(fd)
            self.events.append(("fsync", path))

        def replace(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
            src_path, dst_path = _absolute(src, src_dir_fd), _absolute(dst, dst_dir_fd)
            self.on_replace(src_path, dst_path)
            real_replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            self.events.append(("replace", src_path, dst_path))

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        self.checked_commits = 0

    def durable(self, path: str) -> bool:
        """`path` names complete bytes after a crash now: its content was fsynced under the temp name before the
        rename, and its directory was fsynced after the rename."""
        renamed = None
        for i, e in enumerate(self.events):
            if e[0] == "replace" and e[2] == path:
                renamed = i
        if renamed is None:
            return False
        src = self.events[renamed][1]
        content = any(e == ("fsync", src) for e in self.events[:renamed])
        directory = any(e == ("fsync", os.path.dirname(path)) for e in self.events[renamed + 1:])
        return content and directory

    def on_replace(self, src: str, dst: str) -> None:
        """A manifest part is about to get its name (it may reach the disk any moment after): every "ok" row in it
        must reference a file that is already durable."""
        if "/manifest/" not in dst:
            return
        import pyarrow.parquet as pq

        rows = pq.read_table(src).to_pylist()
        root = dst.rsplit("/manifest/", 1)[0]
        for row in rows:
            if row["status"] == "ok":
                assert self.durable(posixpath.join(root, row["path"])), f"ok row for {row['path']} before its bytes"
        self.checked_commits += 1


def test_an_ok_row_is_committed_only_after_its_data_file_is_durable(tiny_llama, tmp_path, monkeypatch):
    from connectors.manifest_writer import ManifestWriter
    from corpus.tokenization import SAMPLE_SCHEMA
    from harness.runs import prompt_only_worker

    out = RunDir(str(tmp_path / "run"))
    worker = prompt_only_worker(tiny_llama, out)
    log = _SyscallLog(monkeypatch)
    samples = pa.Table.from_pylist([
        {"sample_id": f"s{i}", "source": f"c.jsonl:{i}", "prompt_token_ids": list(range(5, 9 + i)),
         "loss_mask": [1] * (4 + i), "num_prompt_tokens": 4 + i, "truncated": False, "error": None}
        for i in range(5)], schema=SAMPLE_SCHEMA)
    writer = ManifestWriter(out, "A")
    writer.add(worker(samples))
    writer.flush()
    worker.llm.shutdown()
    assert log.checked_commits == 1
    table = read_manifest(out)
    assert table["status"].to_pylist() == ["ok"] * 5
    for rel in table["path"].to_pylist():
        assert log.durable(out.path(rel))
    assert log.durable(out.path("manifest/" + os.listdir(out.path("manifest"))[0]))


def test_the_durability_check_catches_a_data_file_renamed_before_its_fsync(tmp_path, monkeypatch):
    """The simulation can fail: a writer that renames first and fsyncs never makes its file durable."""
    log = _SyscallLog(monkeypatch)
    path = str(tmp_path / "x.safetensors")
    with open(path + ".tmp", "wb") as f:
        f.write(b"data")
    os.replace(path + ".tmp", path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    assert not log.durable(path)


# -- one validation path: bad flags exit 2 before run.json exists, Ray starts or a model loads ----------------------
@pytest.mark.parametrize("argv, named", [
    (["--top-k", "-5"], "--top-k"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--dtype", "float"], "--dtype"),
    (["--dtype", "int8"], "--dtype"),
    (["--layers", "2,2"], "--layers"),
    (["--layers", "-1,2"], "--layers"),
    (["--layers", "a,b"], "--layers"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
])
def test_bad_flags_exit_2_naming_the_flag_before_anything_is_written(argv, named, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["run", "--model", str(tmp_path / "no-model-needed"), "--corpus", "c.jsonl", "--output", str(out), *argv])
    assert e.value.code == EXIT_USAGE
    assert named in capsys.readouterr().err
    assert not out.exists()


def test_layer_ids_beyond_the_model_exit_2_before_run_json(tiny_llama, tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"prompt": "hello"}\n')
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["run", "--model", tiny_llama, "--corpus", str(corpus), "--output", str(out), "--layers", "2,9"])
    assert e.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--layers" in err and "0..4" in err
    assert not (out / RUN_JSON).exists()


def test_engine_and_job_share_one_dtype_rule_for_a_float64_checkpoint(tiny_model_factory):
    from transformers import AutoConfig

    from extractor.config import resolve_dtype
    from jobs.config import JobConfig
    from jobs.model import ModelFacts

    model = tiny_model_factory("llama", dtype="float64")
    assert ModelFacts.resolve(JobConfig(model=model, corpus=("c",), output="o")).dtype == "float32"
    assert resolve_dtype("auto", AutoConfig.from_pretrained(model)) == "float32"


# -- the previous run.json format still opens; unknown versions are refused -----------------------------------------
V1_RUN_JSON = {
    "format": "hsx.run", "format_version": "1", "file_format": "hsx.hidden_states", "file_format_version": "1",
    "model": "/models/tiny", "model_revision": "", "model_fingerprint": "0123456789abcdef",
    "architecture": "LlamaForCausalLM", "layer_ids": [1, 2, 4], "layer_id_convention": "vllm",
    "last_layer_normalized": False, "num_hidden_layers": 4, "hidden_size": 64, "dtype": "float32",
    "chat_template_source": "tokenizer", "chat_template_sha256": "ab" * 32, "max_model_len": 4096,
    "overlength": "truncate", "max_tokens": 3, "include_output_tokens": True,
    "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None}, "id_field": "id",
    "corpus": {"files": ["/data/a.jsonl"], "fingerprint": "fedcba9876543210"},
    "layout": {"data": "data/<sha1(sample_id)[:2]>/<safe sample id>.safetensors",
               "manifest": "manifest/ (Parquet; authoritative: a file counts only with an 'ok' row)"},
    "versions": {"python": "3.11.7", "hsx": "0.1.0"}, "created_at": "2026-11-20T10:00:00Z",
}


def test_a_run_json_of_the_previous_format_still_opens(tmp_path):
    (tmp_path / RUN_JSON).write_text(json.dumps(V1_RUN_JSON))
    spec = read_run_spec(str(tmp_path))
    assert spec.format_version == "1"
    assert spec.layer_ids == (1, 2, 4) and spec.max_tokens == 3 and spec.sampling.temperature == 0.0
    assert spec.corpus == ("/data/a.jsonl",) and spec.corpus_fingerprint == "fedcba9876543210"
    assert spec.data_path("s-1") == data_path("s-1", LEGACY_DATA_LAYOUT)  # its files keep their names
    assert spec.data_path("s-1").endswith("/s-1.safetensors")
    # written back, it is the current version and reads back equal
    again = RunSpec.from_json(spec.to_json())
    assert again.format_version == "2" and again.to_json() == spec.to_json()


def test_a_job_resumes_a_run_of_the_previous_format_with_the_same_settings(tmp_path):
    from jobs.runinfo import RunMismatch, ensure_run_spec

    (tmp_path / RUN_JSON).write_text(json.dumps(V1_RUN_JSON))
    old = read_run_spec(str(tmp_path))
    assert ensure_run_spec(RunDir(str(tmp_path)), old) is False  # same settings: a resume, nothing rewritten
    with pytest.raises(RunMismatch, match="--max-tokens"):
        ensure_run_spec(RunDir(str(tmp_path)), RunSpec(**{**old.__dict__, "max_tokens": 4}))


@pytest.mark.parametrize("doc, match", [
    ({**V1_RUN_JSON, "format_version": "9"}, r"format_version '9'.*reads versions 1, 2.*upgrade hsx"),
    ({"model": "m", "layer_ids": [1]}, "not an hsx run file"),
    ({k: v for k, v in V1_RUN_JSON.items() if k != "hidden_size"}, r"lacks \['hidden_size'\]"),
    ({**V1_RUN_JSON, "layer_ids": [1, 9]}, "out of range"),
])
def test_unreadable_run_json_is_refused_with_the_reason(tmp_path, doc, match, capsys):
    (tmp_path / RUN_JSON).write_text(json.dumps(doc))
    with pytest.raises(RunFormatError, match=match):
        read_run_spec(str(tmp_path))
    with pytest.raises(SystemExit) as e:
        main(["status", str(tmp_path)])
    assert e.value.code == EXIT_USAGE


def test_a_damaged_manifest_part_is_one_line_naming_it_and_the_fix_and_the_fix_works(tmp_path, capsys):
    from harness.runs import random_samples, write_run

    spec = HiddenStatesSpec(layer_ids=(1, 2), num_hidden_layers=2, hidden_size=8, dtype="float32", model="m")
    out = str(tmp_path / "run")
    write_run(out, random_samples(9, spec), spec, manifest_parts=3)
    parts = sorted(os.listdir(os.path.join(out, "manifest")))
    assert len(parts) == 3
    middle = os.path.join(out, "manifest", parts[1])
    raw = bytearray(open(middle, "rb").read())
    raw[len(raw) // 2:len(raw) // 2 + 32] = bytes(32)  # bytes flipped in storage
    open(middle, "wb").write(bytes(raw))
    with pytest.raises(SystemExit) as e:
        main(["status", out])
    err = capsys.readouterr().err
    assert e.value.code == EXIT_USAGE and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert parts[1] in err and f"rename it to {parts[1]}.damaged" in err and "re-run the same `hsx run`" in err
    os.rename(middle, middle + ".damaged")  # what the message says to do: the run reads again, without those rows
    assert len(read_manifest(out)) == 6
    assert main(["status", out]) == 0 and "6 ok" in capsys.readouterr().out


def test_flipped_bits_anywhere_in_a_manifest_part_are_caught_by_the_checksum_in_its_name(tmp_path):
    """A Parquet part without a whole-file checksum can read back as other data after a flipped bit (in 1000 random
    flips of a 64-row part, about 9% did, in its pages and its footer); the checksum in its name
    catches each of 300 random flips, before pyarrow reads the part."""
    import random

    from connectors.manifest import OK, write_manifest_part

    out = str(tmp_path / "run")
    rows = [{"sample_id": f"s{i:03d}", "status": OK, "path": data_path(f"s{i:03d}"), "num_tokens": 10 + i}
            for i in range(64)]
    name = write_manifest_part(out, rows, "20261201T000000.000000Z-abcdef12", 0)
    assert posixpath.basename(name).startswith("part-20261201T000000.000000Z-abcdef12-000000-xxh3_")
    path = os.path.join(out, name)
    intact = open(path, "rb").read()
    expected = read_manifest(out)
    assert expected["sample_id"].to_pylist() == [r["sample_id"] for r in rows]
    rng = random.Random(0)
    for _ in range(300):
        raw = bytearray(intact)
        at = rng.randrange(len(raw))
        raw[at] ^= 1 << rng.randrange(8)
        open(path, "wb").write(bytes(raw))
        with pytest.raises(RunFormatError, match=r"does not match the xxh3_64 checksum in its name.*rename it to"):
            read_manifest(out)
    open(path, "wb").write(intact)
    assert read_manifest(out).equals(expected)


def test_a_manifest_part_named_without_a_checksum_older_runs_still_reads(tmp_path):
    from connectors.manifest import OK, write_manifest_part

    out = str(tmp_path / "run")
    name = write_manifest_part(out, [{"sample_id": "a", "status": OK, "path": data_path("a"), "num_tokens": 3}],
                               "20261201T000000.000000Z-abcdef12", 0)
    old = os.path.join(out, "manifest", "part-20261201T000000.000000Z-abcdef12-000000.parquet")
    os.rename(os.path.join(out, name), old)  # the first round's name
    assert read_manifest(out)["sample_id"].to_pylist() == ["a"]
    open(old, "wb").write(b"PAR1 not parquet PAR1")  # unchecked, but damage pyarrow sees is still the one line
    with pytest.raises(RunFormatError, match=r"is not readable Parquet.*rename it to part-.*\.parquet\.damaged"):
        read_manifest(out)
    # a checksum this hsx does not know (a newer hsx's) is refused, not read unchecked
    os.rename(old, old.replace(".parquet", "-xxh3_128_" + "0" * 32 + ".parquet"))
    with pytest.raises(RunFormatError, match=r"carries a xxh3_128 checksum, which this hsx does not know"):
        read_manifest(out)


# -- estimate = the writer's own bytes -------------------------------------------------------------------------------
@pytest.mark.ray
def test_estimate_matches_the_files_a_run_writes_with_non_ascii_ids(ray_cluster, tiny_llama, tmp_path):
    from harness.corpora import write_jsonl
    from jobs.config import JobConfig
    from jobs.estimate import estimate
    from jobs.pipeline import run_job

    ids = ["é-1", "日本語", "emoji-🙂", "plain"]
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": i, "prompt": f"text number {n} for {i}"}
                                                for n, i in enumerate(ids)])
    config = JobConfig(model=tiny_llama, corpus=(corpus,), output=str(tmp_path / "out"), layers=(1, 4),
                       progress=False)
    est = estimate(config)
    result = run_job(config)
    assert result.ok == len(ids)
    table = read_manifest(str(tmp_path / "out"))
    written = sum(os.path.getsize(os.path.join(tmp_path, "out", p)) for p in table["path"].to_pylist())
    assert est.bytes == written == sum(table["bytes"].to_pylist())


# -- a finished job re-runs without Ray ---------------------------------------------------------------------------
@pytest.mark.ray
def test_rerunning_a_finished_job_returns_without_starting_ray(ray_cluster, tiny_llama, tmp_path, monkeypatch):
    from harness.corpora import write_jsonl
    from jobs.config import JobConfig
    from jobs.pipeline import execute_job, prepare_job, run_job

    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": f"s{i}", "prompt": f"sample {i}"} for i in range(6)])
    monkeypatch.chdir(tmp_path)  # a relative --model: workers load the folder the driver resolved
    config = JobConfig(model=os.path.relpath(tiny_llama), corpus=(corpus,), output=str(tmp_path / "out"),
                       progress=False)
    assert run_job(config).ok == 6
    plan = prepare_job(config)
    assert plan.nothing_left
    result = execute_job(plan)
    assert (result.ok, result.skipped, result.gpus_per_worker) == (0, 6, None)  # no worker was ever placed
    assert len(read_manifest(str(tmp_path / "out"))) == 6  # and no row was added
    # one new record: there is work again, and only it is extracted
    write_jsonl(tmp_path / "c.jsonl", [{"id": f"s{i}", "prompt": f"sample {i}"} for i in range(7)])
    plan = prepare_job(config)
    assert not plan.nothing_left
    assert execute_job(plan).ok == 1
