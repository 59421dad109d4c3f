"""Damage is a message, never a crash (issue 49, item 5): a damaged manifest part among several, `hsx compact` on a
run a job is writing, a run.json damaged or edited by hand. Each command answers in one line with exit 2, marks
nothing, and a run.json put back by hand is resumed without extracting again what its files already hold."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from cli.args import EXIT_USAGE
from cli.main import main
from connectors.manifest import live_manifest_parts, read_manifest, write_manifest_part
from connectors.run import RunDir

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def finished_run(ray_cluster, tiny_llama, tmp_path_factory):
    """(JobConfig, output) of one finished job of 6 samples; tests work on copies of its output."""
    from harness.corpora import write_jsonl
    from jobs.config import JobConfig
    from jobs.pipeline import run_job

    root = tmp_path_factory.mktemp("damage")
    corpus = write_jsonl(root / "c.jsonl", [{"id": f"s{i}", "prompt": f"sample {i} says " + "word " * (i + 3)}
                                            for i in range(6)])
    config = JobConfig(model=tiny_llama, corpus=(corpus,), output=str(root / "out"), progress=False)
    assert run_job(config).ok == 6
    return config


def _copy(config, tmp_path) -> str:
    out = str(tmp_path / "out")
    shutil.copytree(config.output, out)
    return out


def _hsx(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True, timeout=120)


def test_a_damaged_manifest_part_among_several_is_one_line_and_never_an_abort(finished_run, tmp_path):
    # hostile input: the manifest split over 6 parts (read concurrently), one with a flipped byte; on 6c0b8cf the
    # process printed the right line, then often died in Arrow's thread pool at exit ("terminate called without an
    # active exception", exit 134)
    out = _copy(finished_run, tmp_path)
    run = RunDir(out)
    table = read_manifest(run)
    for name in live_manifest_parts(run):
        os.remove(os.path.join(out, "manifest", name))
    for i in range(table.num_rows):
        write_manifest_part(run, table.slice(i, 1), "split", i)
    damaged = sorted(live_manifest_parts(run))[3]
    path = os.path.join(out, "manifest", damaged)
    blob = bytearray(open(path, "rb").read())
    blob[len(blob) // 2] ^= 0xFF
    open(path, "wb").write(bytes(blob))
    for command in (["status", out], ["status", out], ["verify", out, "--all"], ["report", out, "--out",
                                                                                    str(tmp_path / "r.html")]):
        done = _hsx(*command)
        assert done.returncode == EXIT_USAGE, (command, done.returncode, done.stderr[-2000:])
        assert "terminate called" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert f"{damaged}.damaged" in done.stderr  # the fix, named
    assert not os.path.exists(tmp_path / "r.html")


def test_compact_on_a_run_a_job_is_writing_is_one_line_with_exit_2(finished_run, tmp_path, capsys):
    # hostile input: a live writer lease (this process holds it, as a running `hsx run` would); on 6c0b8cf `hsx
    # compact` raised a LeaseHeld traceback (exit 1) where `hsx run` gives one line (exit 2)
    from connectors.lease import WriterLease

    out = _copy(finished_run, tmp_path)
    parts = sorted(os.listdir(os.path.join(out, "manifest")))
    lease = WriterLease.acquire(RunDir(out), "a-running-job")
    try:
        with pytest.raises(SystemExit) as exit_:
            main(["compact", out])
        assert exit_.value.code == EXIT_USAGE
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is being written by another hsx run" in err and "--break-lease" in err
    finally:
        lease.release()
    assert sorted(os.listdir(os.path.join(out, "manifest"))) == parts


def test_a_run_json_with_bad_fields_names_each_field_and_marks_nothing(finished_run, tmp_path, capsys):
    # hostile input: run.json edited to "dtype": null, "max_tokens": "3", "layer_ids": [2, "x"]; on 6c0b8cf `hsx
    # report` raised a TypeError and `hsx verify` condemned every sample (marked invalid)
    out = _copy(finished_run, tmp_path)
    spec_path = os.path.join(out, "run.json")
    doc = json.load(open(spec_path))
    json.dump({**doc, "dtype": None, "max_tokens": "3", "layer_ids": [2, "x"]}, open(spec_path, "w"))
    parts = sorted(os.listdir(os.path.join(out, "manifest")))
    for command in (["status", out], ["verify", out, "--all"], ["report", out, "--out", str(tmp_path / "r.html")]):
        with pytest.raises(SystemExit) as exit_:
            main(command)
        assert exit_.value.code == EXIT_USAGE, command
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        for field in ("'dtype' is null", "'max_tokens' is \"3\"", "'layer_ids' is [2, \"x\"]"):
            assert field in err, (command, err)
    assert sorted(os.listdir(os.path.join(out, "manifest"))) == parts  # nothing marked
    assert not os.path.exists(tmp_path / "r.html")


def test_a_run_json_fixed_by_hand_resumes_without_extracting_again(finished_run, tmp_path, capsys):
    # hostile input: run.json edited so that it disagrees with every file (hidden_size 64 -> 128): verify blames
    # run.json, not the 6 files (on 6c0b8cf it marked all 6 invalid, so a hand-fixed run.json still cost a full
    # re-extraction); put back by hand (other key order and indentation), the same job resumes and extracts nothing
    import dataclasses

    from connectors.manifest import committed_rows
    from jobs.pipeline import run_job

    out = _copy(finished_run, tmp_path)
    spec_path = os.path.join(out, "run.json")
    doc = json.load(open(spec_path))
    json.dump({**doc, "hidden_size": doc["hidden_size"] * 2}, open(spec_path, "w"))
    with pytest.raises(SystemExit) as exit_:
        main(["verify", out, "--all"])
    assert exit_.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "every one of the 6 checked files disagrees" in err and "hidden_size" in err and "nothing was marked" in err
    with open(spec_path, "w") as f:  # the hand fix
        json.dump(dict(sorted(doc.items())), f, indent=4)
    result = run_job(dataclasses.replace(finished_run, output=out))
    assert (result.ok, result.failed, result.skipped) == (0, 0, 6)
    assert committed_rows(read_manifest(out)).num_rows == 6
    assert main(["verify", out, "--all"]) == 0


def test_a_run_json_nested_past_json_limits_or_a_damaged_verify_report_is_one_line(finished_run, tmp_path, capsys):
    # second hostile pass: run.json of 200,000 nested "[" (json's RecursionError was a traceback); a verify report
    # holding {"failures": 5, "kinds": []} (a TypeError in hsx status)
    out = _copy(finished_run, tmp_path)
    with open(os.path.join(out, "run.json"), "w") as f:
        f.write("[" * 200_000)
    with pytest.raises(SystemExit) as exit_:
        main(["status", out])
    assert exit_.value.code == EXIT_USAGE
    assert "is not valid JSON (nested too deeply)" in capsys.readouterr().err
    shutil.copyfile(os.path.join(finished_run.output, "run.json"), os.path.join(out, "run.json"))
    os.makedirs(os.path.join(out, "verify"), exist_ok=True)
    with open(os.path.join(out, "verify", "report-20990101T000000Z-x.json"), "w") as f:
        json.dump({"failures": 5, "kinds": []}, f)
    assert main(["status", out]) == 0
    assert "verify:" not in capsys.readouterr().out


def test_a_reader_that_leaves_early_ends_hsx_status_quietly_but_not_as_success(finished_run):
    # review finding: `hsx status OUT | head` ended in a BrokenPipeError traceback (6c0b8cf); then, caught too widely,
    # as exit 0 even for a command that had failed. Now: 141 (128 + SIGPIPE) and nothing on stderr
    proc = subprocess.Popen([sys.executable, "-m", "cli", "status", finished_run.output], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before hsx prints its first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err, err
