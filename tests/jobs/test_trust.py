"""Trusting a run's data (issue 11): distinct samples never share a file, one writer per run, a model re-written
in place is noticed on resume."""

from __future__ import annotations

import hashlib
import os

import pytest

from connectors.manifest import read_manifest
from connectors.paths import safe_file_stem
from connectors.run import LEGACY_DATA_LAYOUT, RunDir, data_path

# two ids that the first round's names mapped to one file: the second is the first's sanitised form
COLLIDING = ("col 951", "col_951-" + hashlib.sha1(b"col 951").hexdigest()[:10])


def test_ids_that_sanitise_alike_get_distinct_files():
    assert data_path(COLLIDING[0], LEGACY_DATA_LAYOUT) == data_path(COLLIDING[1], LEGACY_DATA_LAYOUT)  # the old bug
    assert data_path(COLLIDING[0]) != data_path(COLLIDING[1])
    assert safe_file_stem(COLLIDING[0]) != safe_file_stem(COLLIDING[1])
    # ids that differ only in case or in characters a file name cannot hold
    ids = ["a", "A", "a b", "a_b", "a/b", "a\\b", "é", "e\u0301", "", ".", "..", "x" * 300, "\ud800"]
    paths = [data_path(i) for i in ids]
    assert len(set(paths)) == len(ids)
    assert len({p.lower() for p in paths}) == len(ids)  # case-insensitive filesystems too
    assert all(p.startswith("data/") and p.count("/") == 2 and "/.." not in p for p in paths)
    stems = [safe_file_stem(i) for i in ids]
    assert len(set(stems)) == len(ids)
    # a safe id that looks like a hashed stem is hashed too, so it cannot meet one
    hashed = safe_file_stem("a b")
    assert safe_file_stem(hashed) != hashed


@pytest.mark.ray
def test_samples_whose_ids_sanitise_alike_both_survive_a_resume(ray_cluster, tiny_llama, tmp_path):
    from harness.corpora import write_jsonl
    from jobs.config import JobConfig
    from jobs.pipeline import run_job
    from training.dataset import HiddenStatesDataset

    records = [{"id": COLLIDING[0], "prompt": "the first sample is longer than the other one"},
               {"id": COLLIDING[1], "prompt": "the second"}]
    corpus = write_jsonl(tmp_path / "c.jsonl", records[:1])
    config = JobConfig(model=tiny_llama, corpus=(corpus,), output=str(tmp_path / "out"), progress=False)
    assert run_job(config).ok == 1
    write_jsonl(tmp_path / "c.jsonl", records)  # the colliding id arrives on a resume
    assert run_job(config).ok == 1
    table = read_manifest(str(tmp_path / "out"))
    assert sorted(table["sample_id"].to_pylist()) == sorted(COLLIDING)
    assert len(set(table["path"].to_pylist())) == 2
    ds = HiddenStatesDataset(str(tmp_path / "out"))
    lengths = {ds.sample_id(i): len(ds[i]["input_ids"]) for i in range(len(ds))}
    assert lengths[COLLIDING[0]] > lengths[COLLIDING[1]]  # each file still holds its own sample
    assert all(os.path.exists(os.path.join(tmp_path, "out", p)) for p in table["path"].to_pylist())
    assert RunDir(str(tmp_path / "out")).exists("run.json")


# -- the model cannot change under a run ---------------------------------------------------------------------------
@pytest.fixture
def own_model(tmp_path):
    """A tiny model in a folder of its own, so a test may re-write it."""
    from reference.tiny_models import build_tiny_model

    return build_tiny_model("llama", str(tmp_path / "model"), seed=0)


def _config(model: str, tmp_path):
    from jobs.config import JobConfig

    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "prompt": "hello there"}\n')
    return JobConfig(model=model, corpus=(str(corpus),), output=str(tmp_path / "out"), progress=False)


def test_weights_rewritten_in_place_are_refused_on_resume(own_model, tmp_path):
    import shutil

    from jobs.pipeline import prepare_job
    from jobs.runinfo import RunMismatch
    from reference.tiny_models import build_tiny_model

    config = _config(own_model, tmp_path)
    assert prepare_job(config).new_run
    assert not prepare_job(config).new_run  # unchanged: resumes
    other = build_tiny_model("llama", str(tmp_path / "other"), seed=1)  # same shapes, other values
    weights = os.path.join(own_model, "model.safetensors")
    size = os.path.getsize(weights)
    shutil.copyfile(os.path.join(other, "model.safetensors"), weights)
    assert os.path.getsize(weights) == size  # same path, same size, same header: only the contents differ
    with pytest.raises(RunMismatch, match=r"model_fingerprint.*--model \(its weights"):
        prepare_job(config)


def test_a_changed_tokenizer_is_refused_on_resume(own_model, tmp_path):
    import json

    from jobs.pipeline import prepare_job
    from jobs.runinfo import RunMismatch

    config = _config(own_model, tmp_path)
    prepare_job(config)
    path = os.path.join(own_model, "tokenizer_config.json")
    doc = json.load(open(path))
    doc["model_max_length"] = 77
    json.dump(doc, open(path, "w"))
    with pytest.raises(RunMismatch, match="model_fingerprint"):
        prepare_job(config)


def test_a_run_that_recorded_the_first_rounds_fingerprint_still_resumes(own_model, tmp_path):
    import dataclasses

    from transformers import AutoConfig

    from connectors.fingerprint import model_fingerprint
    from connectors.run import read_run_spec, write_run_spec
    from jobs.pipeline import prepare_job

    config = _config(own_model, tmp_path)
    prepare_job(config)
    out = RunDir(config.output)
    old = model_fingerprint(own_model, AutoConfig.from_pretrained(own_model), scheme="")
    write_run_spec(out, dataclasses.replace(read_run_spec(out), model_fingerprint=old))
    assert not prepare_job(config).new_run
    assert read_run_spec(out).model_fingerprint == old  # the run keeps what it recorded


def test_a_run_whose_run_json_was_deleted_is_not_started_again(own_model, tmp_path):
    from connectors.manifest import new_attempt_id, write_manifest_part
    from jobs.pipeline import prepare_job
    from jobs.runinfo import RunMismatch

    config = _config(own_model, tmp_path)
    prepare_job(config)
    write_manifest_part(config.output, [{"sample_id": "a", "status": "ok", "path": data_path("a"), "num_tokens": 2}],
                        new_attempt_id(), 0)
    os.remove(os.path.join(config.output, "run.json"))
    with pytest.raises(RunMismatch, match="has a manifest .* but no run.json.*Restore run.json"):
        prepare_job(config)
    assert not os.path.exists(os.path.join(config.output, "run.json"))


# -- one writer per run ----------------------------------------------------------------------------------------------
def _lease_doc(**over) -> bytes:
    import json
    import socket
    import time

    doc = {"attempt": "20261201T000000Z-other", "host": socket.gethostname(), "pid": os.getpid(),
           "started": time.time(), "renewed": time.time()}
    doc.update(over)
    return json.dumps(doc).encode()


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_lease_refuses_a_second_writer_and_break_lease_takes_it(tmp_path):
    from connectors.lease import LEASE_FILE, LeaseHeld, WriterLease

    run = RunDir(str(tmp_path))
    first = WriterLease.acquire(run, "A")
    with pytest.raises(LeaseHeld, match=r"being written by another hsx run: attempt A on host .* --break-lease"):
        WriterLease.acquire(run, "B")
    (tmp_path / LEASE_FILE).write_bytes(_lease_doc(host="elsewhere", pid=1))  # alive, as far as we can tell
    with pytest.raises(LeaseHeld, match="host elsewhere"):
        WriterLease.acquire(run, "B")
    second = WriterLease.acquire(run, "B", break_lease=True)
    from connectors.lease import LeaseLost

    with pytest.raises(LeaseLost, match="taken over"):
        first.renew()  # the first writer learns it lost the lease before it commits more
    second.renew()
    second.release()
    assert not (tmp_path / LEASE_FILE).exists()


@pytest.mark.parametrize("holder", ["dead process here", "stale elsewhere", "unreadable"])
def test_a_lease_left_by_a_dead_job_is_broken(tmp_path, holder, caplog):
    import time

    from connectors.lease import LEASE_FILE, WriterLease

    body = {"dead process here": _lease_doc(pid=_dead_pid()),
            "stale elsewhere": _lease_doc(host="elsewhere", pid=1, renewed=time.time() - 3600),
            "unreadable": b"{not json"}[holder]
    (tmp_path / LEASE_FILE).write_bytes(body)
    with caplog.at_level("WARNING", logger="connectors.lease"):
        lease = WriterLease.acquire(RunDir(str(tmp_path)), "B")
    assert "breaking the lease" in caplog.text
    lease.release()


def test_the_lease_is_exclusive_on_s3(s3_bucket):
    from connectors import storage
    from connectors.lease import LeaseHeld, WriterLease

    url, options = s3_bucket
    run = RunDir(f"{url}/run", options)
    assert storage.create_exclusive(run.fs, run.path("x"), b"1")
    assert not storage.create_exclusive(run.fs, run.path("x"), b"2")
    assert run.read_bytes("x") == b"1"
    lease = WriterLease.acquire(run, "A")
    with pytest.raises(LeaseHeld):
        WriterLease.acquire(RunDir(f"{url}/run", options), "B")
    lease.release()
    WriterLease.acquire(run, "C").release()


@pytest.mark.ray
@pytest.mark.slow
def test_two_runs_on_one_output_never_duplicate_a_sample(ray_cluster, tiny_llama, tmp_path):
    import subprocess
    import sys
    import time

    from cli.args import EXIT_OK, EXIT_USAGE
    from harness.corpora import write_jsonl

    ids = [f"s{i:04d}" for i in range(300)]
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": i, "prompt": f"sample {i} " * 8} for i in ids])
    output = str(tmp_path / "out")
    args = [sys.executable, "-m", "cli", "run", "--model", tiny_llama, "--corpus", corpus, "--output", output,
            "--tokens-per-task", "64", "--manifest-flush-rows", "5", "--no-progress", "--address", ray_cluster.address]
    first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(output, "writer.lease")):
        assert first.poll() is None and time.monotonic() < deadline, first.stderr.read().decode()[-2000:]
        time.sleep(0.02)
    second = subprocess.run(args, capture_output=True, text=True, timeout=300)
    out, err = first.communicate(timeout=600)
    assert first.returncode == EXIT_OK, err.decode()[-2000:]
    assert second.returncode == EXIT_USAGE and "being written by another hsx run" in second.stderr
    table = read_manifest(output)
    ok = [s for s, st in zip(table["sample_id"].to_pylist(), table["status"].to_pylist()) if st == "ok"]
    assert sorted(ok) == ids  # every sample once: no duplicate rows
    assert not os.path.exists(os.path.join(output, "writer.lease"))  # given back at the end


# -- "invalid" rows: what hsx verify found bad is extracted again --------------------------------------------------
def test_an_invalid_row_uncommits_a_sample_until_it_is_extracted_again(tmp_path):
    from connectors.manifest import committed_ids, new_attempt_id, ok_rows, write_manifest_part
    from connectors.manifest_writer import summarize

    run = RunDir(str(tmp_path))

    def commit(*rows):
        write_manifest_part(run, [{"sample_id": s, "status": st, "path": data_path(s), "num_tokens": 3,
                                   "bytes": 10, "truncated": False} for s, st in rows], new_attempt_id(), 0)

    commit(("a", "ok"), ("b", "ok"), ("c", "ok"), ("d", "failed"))
    commit(("b", "invalid"), ("c", "invalid"))  # hsx verify found b's and c's files bad
    commit(("c", "ok"))  # the re-run extracted c again
    assert committed_ids(run) == {"a", "c"}
    assert ok_rows(run)["sample_id"].to_pylist() == ["a", "c"]
    s = summarize(run)
    assert (s.ok, s.invalid, s.failed, s.duplicate_ok_rows) == (2, 1, 1, 0)
    commit(("a", "ok"))  # a second ok row with nothing in between: exactly-once broke
    assert summarize(run).duplicate_ok_rows == 1


# -- clear failures instead of tracebacks ----------------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
def test_a_ray_address_file_left_behind_does_not_stop_a_local_run(tmp_path):
    """`ray start` (or one that died) leaves its address in <tmp>/ray/ray_current_cluster; `hsx run` without
    --address used to hit Ray's "num_cpus and num_gpus must not be provided" instead of running. Every command
    connects through cluster.session.ray_cluster: in a fresh process (its own RAY_TMPDIR) it starts a private local Ray
    beside the stale file and says how to use the registered cluster instead."""
    import subprocess
    import sys
    import tempfile

    ray_tmp = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    os.makedirs(os.path.join(ray_tmp, "ray"))
    with open(os.path.join(ray_tmp, "ray", "ray_current_cluster"), "w") as f:
        f.write("127.0.0.1:1")
    script = ("import ray\nfrom cluster.session import ray_cluster\n"
              "with ray_cluster(None) as local:\n"
              "    print('local', local, int(ray.cluster_resources()['CPU']), ray.get(ray.put(7)))\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": ray_tmp}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("local True ") and proc.stdout.split()[-1] == "7", proc.stdout
    assert int(proc.stdout.split()[2]) >= 4  # its own CPUs, not the registered cluster's
    assert "--address auto" in proc.stderr  # says which cluster it used and how to use the other


def test_an_unreachable_ray_address_is_a_usage_error(tiny_llama, tmp_path, capsys):
    """In this process (connected to a Ray already or not, as other tests leave it): the address given is probed
    first (cluster.session.ray_cluster), so nothing runs on another cluster than the one asked for."""
    import socket
    import time

    from cli.args import EXIT_USAGE
    from cli.main import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "prompt": "hello"}\n')
    argv = ["run", "--model", tiny_llama, "--corpus", str(corpus), "--output", str(tmp_path / "out"), "--no-progress"]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--address", "127.0.0.1:1"])
    assert e.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--address 127.0.0.1:1: cannot connect" in err and len(err.strip().splitlines()) <= 3, err
    # something listens there but it is not Ray (a dashboard or web port): refused in seconds, not minutes of retries
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(SystemExit) as e:
            main([*argv, "--address", address])
    assert e.value.code == EXIT_USAGE
    assert f"--address {address}: something listens there but it is not Ray" in capsys.readouterr().err
    assert time.monotonic() - start < 30


@pytest.mark.s3
def test_an_unreachable_or_missing_output_is_one_line_and_exit_2(s3_server, s3_bucket, tiny_llama, tmp_path, capsys):
    import json

    from cli.args import EXIT_USAGE
    from cli.main import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "prompt": "hello"}\n')
    url, options = s3_bucket
    cases = {"endpoint down": ("s3://some-bucket/run", {"client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}},
                               "cannot reach the storage"),
             "bucket missing": ("s3://no-such-bucket-hsx/run", options, "bucket 'no-such-bucket-hsx' does not exist")}
    for name, (output, opts, expected) in cases.items():
        with pytest.raises(SystemExit) as e:
            main(["run", "--model", tiny_llama, "--corpus", str(corpus), "--output", output, "--storage-options",
                  json.dumps(opts), "--no-progress"])
        err = capsys.readouterr().err
        assert e.value.code == EXIT_USAGE, name
        assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (name, err)


@pytest.mark.ray
@pytest.mark.parametrize("fail_at", ["the last commit", "a commit mid-job"])
def test_storage_failing_at_a_commit_fails_the_job_in_one_line_and_keeps_what_was_committed(
        ray_cluster, tiny_llama, tmp_path, monkeypatch, fail_at):
    import errno
    import re

    from harness.corpora import write_jsonl
    from jobs.config import JobConfig
    from jobs.pipeline import JobFailed, run_job

    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": f"s{i}", "prompt": f"sample {i}"} for i in range(12)])
    real = RunDir.put
    calls = []

    def full_disk(self, rel, data):  # the storage layer fails the way a full disk does, for manifest parts
        if not rel.startswith("manifest/"):
            return real(self, rel, data)
        seq = int(re.search(r"-(\d{6})-xxh3_64_", rel).group(1))
        calls.append(seq)
        if fail_at == "the last commit" or seq >= 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, rel, data)

    monkeypatch.setattr(RunDir, "put", full_disk)
    flush_rows = 10_000 if fail_at == "the last commit" else 1
    config = JobConfig(model=tiny_llama, corpus=(corpus,), output=str(tmp_path / "out"), progress=False,
                       manifest_flush_rows=flush_rows, tokens_per_task=16)
    with pytest.raises(JobFailed, match="No space left on device.*re-run the same command") as e:
        run_job(config)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(RunDir, "put", real)
    committed = len(read_manifest(config.output))
    if fail_at == "the last commit":
        assert committed == 0
    else:
        assert committed >= 1 and calls[:2] == [0, 1]  # the part before the failure stays committed
    assert not os.path.exists(os.path.join(config.output, "writer.lease"))  # given back
    assert run_job(config).ok == 12 - committed  # a re-run resumes: nothing lost, nothing twice


@pytest.mark.ray
def test_a_dead_registry_actor_costs_only_the_counts(ray_cluster, caplog):
    import time

    import ray

    from corpus.sample_registry import DoneSet, id_keys, start_registry
    from jobs.pipeline import registry_stats

    registry = start_registry(DoneSet(id_keys(["a"])), shards=2)
    assert registry_stats(registry) == {"skipped": 0, "duplicates": 0, "claimed": 0}
    ray.kill(registry[1])  # asynchronous: a call right after can still be answered, so wait until the actor is dead
    deadline = time.monotonic() + 60
    while True:
        try:
            ray.get(registry[1].stats.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "ray.kill did not end the actor"
        time.sleep(0.05)
    with caplog.at_level("WARNING", logger="jobs.pipeline"):
        assert registry_stats(registry) == {"skipped": 0, "duplicates": 0}
    assert "the sample registry died" in caplog.text
