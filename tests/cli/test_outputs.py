"""Every output flag of every command through the same hostile cases (issue 49 item 4): the model folder, a path inside
a run, an existing file that is not the command's own, a symlink to the model (or, for a file flag, to a corpus file),
a corpus file. Each is refused before any work with exit 2 in one line, and nothing on disk changes: the one guard is
connectors/outputs.py (OutputFolder / OutputFolders / check_output_file / check_run_output)."""

from __future__ import annotations

import json
import os

import pytest

from cli.args import EXIT_USAGE
from cli.main import main
from harness.runs import tree_digest

pytestmark = [pytest.mark.slow]

CASES = ("the model folder", "inside the run", "a file", "a symlink", "a corpus file")


@pytest.fixture(scope="module")
def world(oracle_run, tiny_llama, tmp_path_factory):
    """A run (RUN), its model, a corpus file and a prompts file, a plain file, and symlinks to the model and corpus."""
    root = tmp_path_factory.mktemp("outputs")
    run = str(root / "run")
    import shutil

    shutil.copytree(oracle_run[0], run)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"words {i} and more"}) + "\n" for i in range(4)))
    notes = root / "notes.txt"
    notes.write_text("a user's own file\n")
    (root / "to-model").symlink_to(tiny_llama, target_is_directory=True)
    (root / "to-corpus").symlink_to(corpus)
    return {"root": str(root), "run": run, "model": tiny_llama, "corpus": str(corpus), "notes": str(notes),
            "to_model": str(root / "to-model"), "to_corpus": str(root / "to-corpus")}


def _target(w, case: str, is_file: bool) -> str:
    return {"the model folder": w["model"],
            "inside the run": os.path.join(w["run"], "data", "x.json" if is_file else "out"),
            "a file": w["notes"],
            "a symlink": w["to_corpus"] if is_file else w["to_model"],
            "a corpus file": w["corpus"]}[case]


def _commands(w, target: str) -> dict[str, list[str]]:
    """flag -> argv writing `target` through that flag (every other output elsewhere, fresh)."""
    fresh = os.path.join(w["root"], "fresh")
    train = ["train-drafter", "--kind", "eagle3", "--run", w["run"], "--model", w["model"], "--steps", "1"]
    return {
        "run --output": ["run", "--model", w["model"], "--corpus", w["corpus"], "--output", target],
        "regenerate --output": ["regenerate", "--server", "http://127.0.0.1:9", "--corpus", w["corpus"],
                                "--output", target, "--max-tokens", "4"],
        "verify --report": ["verify", w["run"], "--report", target],
        "export DEST": ["export", w["run"], target, "--format", "speculators"],
        "train-drafter --out": [*train, "--out", target],
        "train-drafter --checkpoint-dir": [*train, "--out", fresh + "-t1", "--checkpoint-dir", target],
        "train-drafter --log-dir": [*train, "--out", fresh + "-t2", "--log-dir", target],
        "eval-drafter --out": ["eval-drafter", "--model", w["model"], "--prompts", w["corpus"], "--out", target],
        "eval-drafter --json": ["eval-drafter", "--model", w["model"], "--prompts", w["corpus"], "--json", target],
        "report --out": ["report", w["run"], "--out", target],
        "serve --output": ["serve", "--model", w["model"], "--output", target],
        "serve --allowed-roots": ["serve", "--model", w["model"], "--output", fresh + "-s", "--allowed-roots", target],
    }


FILE_FLAGS = ("verify --report", "eval-drafter --json", "report --out")




@pytest.mark.parametrize("case", CASES)
def test_every_output_flag_refuses_the_same_hostile_paths_before_any_work(world, case, capsys):
    before = tree_digest(world["root"], dirs=True), tree_digest(world["model"], dirs=True)
    for flag in _commands(world, "unused"):
        target = _target(world, case, flag in FILE_FLAGS)
        argv = _commands(world, target)[flag]
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == EXIT_USAGE, (flag, case, err)
        assert err.count("\n") == 1 and "Traceback" not in err, (flag, case, err)
        assert (tree_digest(world["root"], dirs=True), tree_digest(world["model"], dirs=True)) == before, (flag, case)


def test_a_file_output_is_never_a_device_or_a_pipe(world, tmp_path, capsys):
    # written through a rename, a --report /dev/null would replace the machine's /dev/null (as root)
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    for argv in (["verify", world["run"], "--report", fifo], ["report", world["run"], "--out", fifo]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == EXIT_USAGE
        assert "is not a regular file (a device, pipe or socket)" in capsys.readouterr().err
    assert os.path.exists(fifo) and not os.path.isfile(fifo)


def test_review_findings_on_legitimate_paths(world, tmp_path, monkeypatch, capsys):
    # an empty file (mktemp's) may take a report; a run's OUTPUT inside its --corpus folder is refused at once (it was
    # accepted, then its resume refused naming its own manifest part); `~` spells the same folder as its expansion
    from connectors.outputs import within_output

    empty = tmp_path / "empty.html"
    empty.touch()
    assert main(["report", world["run"], "--out", str(empty), "--sample", "2"]) == 0
    assert empty.read_bytes().startswith(b"<!DOCTYPE html>")
    data = tmp_path / "data"
    data.mkdir()
    (data / "c.jsonl").write_text('{"prompt": "one two"}\n')
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--model", world["model"], "--corpus", str(data), "--output", str(data / "run1")])
    assert exit_.value.code == EXIT_USAGE and "lies inside the --corpus folder" in capsys.readouterr().err
    monkeypatch.setenv("HOME", str(tmp_path))
    assert within_output("~/rvx/regenerated", str(tmp_path / "rvx")) and within_output("~/rvx/r", "~/rvx")
    assert not within_output("~/rvx", "~/rvx") and not within_output("s3://b/rvx/r", "~/rvx")
