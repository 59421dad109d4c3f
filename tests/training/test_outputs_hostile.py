"""Hostile outputs of `hsx train-drafter` (issue 49): --checkpoint-dir and --log-dir are guarded like --out (never the
model, the run, inside either, a file, a symlink into one), checked before any training step and leased with the
training; a run that a live `hsx run` writes is refused unless --snapshot, which the report then records. Each test
plants the input a hostile user would and checks what the command leaves behind."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from cli.args import EXIT_USAGE
from connectors.lease import LeaseHeld, WriterLease
from connectors.run import RunDir
from harness.runs import small_train_config, tree_digest
from training.loop import Loop
from training_jobs.train import train_drafter


@pytest.fixture
def model_copy(tiny_llama, tmp_path):
    """A copy of the tiny Llama that a test may see damaged (the session's stays intact)."""
    dest = tmp_path / "model"
    shutil.copytree(tiny_llama, dest)
    return dest


@pytest.fixture
def run_copy(oracle_run, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(oracle_run[0], dest)
    return dest


@pytest.fixture
def steps_taken(monkeypatch):
    """Calls of the training loop (the real one runs): a refused training must make none."""
    calls = []
    run = Loop.run

    def counting_run(self, *args, **kwargs):
        calls.append(1)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(Loop, "run", counting_run)
    return calls


HOSTILE = {  # flag, where it points, what the one line must say
    "checkpoint-dir-is-the-model": ("--checkpoint-dir", "model", "is the --model folder"),
    "checkpoint-dir-inside-the-run": ("--checkpoint-dir", "run/data/ckpt", "lies inside the --run folder"),
    "checkpoint-dir-is-a-regular-file": ("--checkpoint-dir", "afile", "is a file, not a folder"),
    "checkpoint-dir-is-a-symlink-to-the-model": ("--checkpoint-dir", "model-link", "is the --model folder"),
    "log-dir-is-the-run": ("--log-dir", "run", "is the --run folder"),
    "log-dir-inside-the-runs-data": ("--log-dir", "run/data", "lies inside the --run folder"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_checkpoint_or_log_dir_on_an_input_exits_2_before_any_step_and_writes_nothing(case, model_copy, run_copy,
                                                                                        tmp_path, capsys,
                                                                                        steps_taken):
    from cli.main import main

    flag, where, said = HOSTILE[case]
    (tmp_path / "afile").write_text("mine")
    os.symlink(model_copy, tmp_path / "model-link")
    before = tree_digest(tmp_path)
    started = time.monotonic()
    with pytest.raises(SystemExit) as e:
        main(["train-drafter", "--run", str(run_copy), "--model", str(model_copy), "--out", str(tmp_path / "out"),
              "--steps", "2", "--checkpoint-every", "1", "--batch-tokens", "64", "--draft-vocab-size", "48",
              "--device", "cpu", "--no-progress", flag, str(tmp_path / where)])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert e.value.code == EXIT_USAGE and len(lines) == 1 and said in lines[0] and flag in lines[0], err
    assert "Traceback" not in err
    assert not steps_taken and elapsed < 30  # refused up front, not at the first checkpoint
    assert tree_digest(tmp_path) == before  # no state.pt, no event file, no --out: nothing written anywhere


def test_checkpoint_and_log_dirs_of_their_own_are_leased_for_the_training(oracle_run, tiny_llama, tmp_path,
                                                                         steps_taken):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    config = small_train_config(oracle_run[0], tiny_llama, tmp_path / "out", checkpoint_dir=str(ckpt), log_dir=str(logs))
    other = small_train_config(oracle_run[0], tiny_llama, tmp_path / "other-out", checkpoint_dir=str(ckpt))
    with other.output_folder().open():  # another training writes that --checkpoint-dir now
        with pytest.raises(LeaseHeld, match=f"{ckpt} is being written by another hsx train-drafter --checkpoint-dir"):
            train_drafter(config)
        assert not steps_taken and not (ckpt / "state.pt").exists() and not (tmp_path / "out").exists()
    report = train_drafter(config)  # free again: trains, checkpoints there, curves there, and gives both back
    assert report["steps"] == 2 and (ckpt / "state.pt").exists()
    assert [n for n in os.listdir(logs) if n.startswith("events.out.tfevents.")]
    assert not (tmp_path / "out" / "checkpoint").exists() and not (tmp_path / "out" / "tensorboard").exists()
    assert not [p for p in (ckpt, logs, tmp_path / "out") if (p / "writer.lease").exists()]
    resumed = train_drafter(small_train_config(oracle_run[0], tiny_llama, tmp_path / "out", steps=3, checkpoint_dir=str(ckpt),
                                    log_dir=str(logs)))
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == 3  # its own folders, taken again


def test_fanout_trainers_sharing_one_checkpoint_dir_are_refused(tiny_llama, tmp_path):
    from training_jobs.config import TrainJobConfig
    from training_jobs.fanout import fanout_configs

    (tmp_path / "corpus.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    (tmp_path / "fanout.json").write_text(json.dumps([{"out": str(tmp_path / "a")}, {"out": str(tmp_path / "b")}]))
    config = TrainJobConfig(model=str(tiny_llama), out=str(tmp_path / "a"), online=True,
                            corpus=(str(tmp_path / "corpus.jsonl"),), fanout=str(tmp_path / "fanout.json"),
                            checkpoint_dir=str(tmp_path / "shared"), draft_vocab_size=48)
    with pytest.raises(ValueError, match=r"trainer 2 writes its checkpoint_dir to .*shared, as an earlier one does"):
        fanout_configs(config)


def test_training_on_a_run_being_written_exits_2_naming_the_writer_and_snapshot_records_it(run_copy, tiny_llama,
                                                                                          tmp_path, capsys,
                                                                                          steps_taken):
    from cli.main import main

    job = WriterLease.acquire(RunDir(str(run_copy)), "hsx-run-live")  # an `hsx run` writing the run now
    try:
        with pytest.raises(SystemExit) as e:
            main(["train-drafter", "--run", str(run_copy), "--model", str(tiny_llama), "--out",
                  str(tmp_path / "out"), "--steps", "1", "--draft-vocab-size", "48", "--device", "cpu",
                  "--no-progress"])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert e.value.code == EXIT_USAGE and len(lines) == 1, err
        assert "attempt hsx-run-live" in lines[0] and "--snapshot" in lines[0]
        assert not steps_taken and not (tmp_path / "out").exists()
        report = train_drafter(small_train_config(run_copy, tiny_llama, tmp_path / "out", snapshot=True))
    finally:
        job.release()
    assert report["snapshot"] is True and "attempt hsx-run-live" in report["snapshot_writer"]
    with open(tmp_path / "out" / "report.json") as f:
        assert json.load(f)["snapshot_writer"] == report["snapshot_writer"]
    done = train_drafter(small_train_config(run_copy, tiny_llama, tmp_path / "done"))  # the writer finished: no snapshot
    assert done["snapshot"] is False and "snapshot_writer" not in done
