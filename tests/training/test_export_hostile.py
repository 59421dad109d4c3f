"""Hostile exports (issue 49): a run being written, a damaged file, an export interrupted midway, a re-extracted sample.
`hsx export` names a live writer (refused unless --snapshot, which hsx_export.json records), exits 1 on damaged
data, writes its completion marker last for every format (listing only files that exist), and resumes keyed on
each sample's checksum."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from cli.args import EXIT_FAILED, EXIT_USAGE
from connectors import HiddenStatesSpec
from connectors.lease import WriterLease
from connectors.run import RunDir
from harness.runs import random_samples, write_run
from training.export import STATE_FILE, export_run

FORMATS = ("speculators", "specforge", "modelopt")
JOURNAL_FILE = "hsx_export.partial.jsonl"  # an export under way: the files written whole so far


def _spec(model: str) -> HiddenStatesSpec:
    """The tiny Llama's shape: layers 1, 2 (aux) and 4 = N, pre-norm (the post-norm formats take its final norm)."""
    return HiddenStatesSpec(layer_ids=(1, 2, 4), num_hidden_layers=4, hidden_size=64, dtype="float32", model=model)


@pytest.fixture
def samples(tiny_llama):
    return random_samples(6, _spec(tiny_llama), seed=4, min_len=4, max_len=12)


def _tree(folder, skip=(".hsx-output.json",)) -> dict[str, str]:
    """relative path -> sha256 of every file under `folder`, but `skip`."""
    out = {}
    for d, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(d, name), folder)
            if rel not in skip:
                with open(os.path.join(d, name), "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


def _marker(dest) -> dict:
    with open(os.path.join(dest, STATE_FILE)) as f:
        return json.load(f)


def _journal(dest) -> list[str]:
    with open(os.path.join(dest, JOURNAL_FILE)) as f:
        return [json.loads(line)[0] for line in f.read().splitlines()[1:]]


def _hsx(argv: list[str]) -> int:
    """`hsx ARGV`'s exit status, as the shell would see it."""
    from cli.main import main

    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_writes_its_completion_marker_last_listing_only_files_that_exist(fmt, samples, tiny_llama,
                                                                                    tmp_path, monkeypatch):
    from connectors import storage

    run, dest = str(tmp_path / "run"), str(tmp_path / fmt)
    write_run(run, samples, _spec(tiny_llama))
    put_atomic, order = storage.put_atomic, []

    def recording_put_atomic(fs, path, content):
        seen = os.path.exists(os.path.join(dest, STATE_FILE))
        order.append((os.path.relpath(path, dest), seen))
        return put_atomic(fs, path, content)

    monkeypatch.setattr(storage, "put_atomic", recording_put_atomic)
    export_run(run, dest, fmt)
    assert order[-1][0] == STATE_FILE and not any(seen for _, seen in order)  # written last, after all the others
    listed = _marker(dest)["files"]
    assert len(listed) == len(samples) and all(os.path.isfile(os.path.join(dest, rel)) for rel in listed)
    assert sorted(sid for sid, _ in listed.values()) == [s.sample_id for s in samples]
    assert not os.path.exists(os.path.join(dest, JOURNAL_FILE))


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_export_interrupted_midway_claims_nothing_and_resumes_to_the_export_of_an_uninterrupted_one(fmt, samples,
                                                                                                      tiny_llama,
                                                                                                      tmp_path):
    run, dest = str(tmp_path / "run"), str(tmp_path / "stopped")
    write_run(run, samples, _spec(tiny_llama))

    def ctrl_c_after_the_third_file(summary):
        if summary.written == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_run(run, dest, fmt, progress=ctrl_c_after_the_third_file)
    assert not os.path.exists(os.path.join(dest, STATE_FILE))  # no marker claims the 6 samples
    assert len(_journal(dest)) == 3 and all(os.path.isfile(os.path.join(dest, rel)) for rel in _journal(dest))
    resumed = export_run(run, dest, fmt)
    assert (resumed.written, resumed.skipped) == (3, 3)
    fresh = str(tmp_path / "fresh")
    export_run(run, fresh, fmt)
    assert _tree(dest) == _tree(fresh) and len(_marker(dest)["files"]) == len(samples)


def test_export_of_a_damaged_file_exits_1_in_one_line_and_resumes_once_it_is_re_extracted(samples, tiny_llama,
                                                                                        tmp_path, capsys):
    run, dest = tmp_path / "run", tmp_path / "dest"
    rows = write_run(str(run), samples, _spec(tiny_llama))
    damaged = run / rows[3]["path"]
    data = bytearray(damaged.read_bytes())
    data[-5] ^= 0x40  # one bit of its states flipped after it was committed
    damaged.write_bytes(bytes(data))
    code = _hsx(["export", "--format", "specforge", str(run), str(dest)])
    line = _one_line(capsys.readouterr().err)
    assert code == EXIT_FAILED and rows[3]["sample_id"] in line and "3 of 6 samples" in line, line
    assert not (dest / STATE_FILE).exists() and len(_journal(dest)) == 3  # nothing claims what is not there
    write_run(str(run), samples, _spec(tiny_llama))  # re-extracted: the same states again
    assert _hsx(["export", "--format", "specforge", str(run), str(dest)]) == 0
    assert "3 written, 3 already done" in capsys.readouterr().out and len(_marker(dest)["files"]) == 6


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_re_extracted_sample_with_a_new_checksum_gets_its_exported_file_rewritten(fmt, samples, tiny_llama,
                                                                                  tmp_path):
    run, dest = str(tmp_path / "run"), str(tmp_path / fmt)
    write_run(run, samples, _spec(tiny_llama))
    export_run(run, dest, fmt)
    samples[2].hidden_states = samples[2].hidden_states * 2  # same tokens, new states: a new checksum
    write_run(run, samples, _spec(tiny_llama))
    again = export_run(run, dest, fmt)
    assert (again.written, again.skipped) == (1, len(samples) - 1)
    fresh = str(tmp_path / "fresh")
    export_run(run, fresh, fmt)
    assert _tree(dest) == _tree(fresh)  # the stale file rewritten, the others and the marker as a fresh export's


def test_export_of_a_run_being_written_exits_2_and_a_snapshot_says_so_then_grows_to_the_whole_run(samples, tiny_llama,
                                                                                                  tmp_path, capsys):
    run, dest = str(tmp_path / "run"), str(tmp_path / "dest")
    part = [samples[i] for i in (0, 2, 4, 5)]  # what the job has committed so far
    write_run(run, part, _spec(tiny_llama))
    job = WriterLease.acquire(RunDir(run), "hsx-run-live")  # the `hsx run` still writing it
    try:
        code = _hsx(["export", "--format", "modelopt", run, dest])
        line = _one_line(capsys.readouterr().err)
        assert code == EXIT_USAGE and "attempt hsx-run-live" in line and "--snapshot" in line
        assert not os.path.exists(dest)
        assert _hsx(["export", "--format", "modelopt", "--snapshot", run, dest]) == 0
        out = capsys.readouterr().out
        assert "snapshot" in out and "attempt hsx-run-live" in out and "exported 4 samples" in out
        marker = _marker(dest)
        assert marker["snapshot"] is True and "attempt hsx-run-live" in marker["snapshot_writer"]
    finally:
        job.release()
    write_run(run, [samples[i] for i in (0, 1, 2, 3, 5)], _spec(tiny_llama))  # finished (sample 4 marked invalid)
    whole = export_run(run, dest, "modelopt")
    assert (whole.written, whole.skipped, whole.removed) == (2, 3, 1)
    fresh = str(tmp_path / "fresh")
    export_run(run, fresh, "modelopt")
    assert _tree(dest) == _tree(fresh) and _marker(dest)["snapshot"] is False
    assert torch.equal(torch.load(os.path.join(dest, "s00001.pt"), weights_only=True)["input_ids"],
                       samples[1].token_ids)
