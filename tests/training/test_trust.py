"""Trust, round 2 (issue 23): `hsx train-drafter --out` and `hsx export DEST` never destroy an input, the training
feed trains on nothing bad, a training resumes only its own run, and exit codes say what happened. Each test plants
the damage a hostile user (or a bad day) would and checks the command refuses or stops, names the fix, and loses
nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from connectors import HiddenStatesSpec
from connectors.manifest import read_manifest
from connectors.run import RunDir
from harness.runs import random_samples, small_train_config, tree_digest, write_manifest, write_run
from training.checkpoint import save_checkpoint
from training.feed import TrainingStopped
from training_jobs.train import train_drafter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))






def _tiny_spec(model: str) -> HiddenStatesSpec:
    return HiddenStatesSpec(layer_ids=(1, 2, 4), num_hidden_layers=4, hidden_size=64, dtype="float32", model=model)


@pytest.fixture
def model_copy(tiny_llama, tmp_path):
    """A copy of the tiny Llama that a test may see destroyed (the session's stays intact whatever happens)."""
    dest = tmp_path / "models" / "target"
    shutil.copytree(tiny_llama, dest)
    return dest


@pytest.fixture
def run_copy(oracle_run, tmp_path):
    dest = tmp_path / "runs" / "good"
    shutil.copytree(oracle_run[0], dest)
    return dest


# -- 0. the run must be the target's ---------------------------------------------------------------------------


@pytest.mark.parametrize("edit, said", [
    ({"num_hidden_layers": 5}, "the run's model has 4 layers, the target 5"),
    ({"hidden_size": 32}, "the run's states are 64 wide, the target's 32"),
    ({"architectures": ["MistralForCausalLM"]}, "the run's model is a LlamaForCausalLM, the target a MistralForCausalLM"),
])
def test_a_run_from_another_model_is_refused_naming_what_differs(edit, said, run_copy, model_copy, tmp_path):
    with open(run_copy / "run.json") as f:
        run = json.load(f)
    with open(run_copy / "run.json", "w") as f:  # what `hsx run` records (the test run's writer leaves it out)
        json.dump({**run, "architecture": "LlamaForCausalLM"}, f)
    with open(model_copy / "config.json") as f:
        config = json.load(f)
    with open(model_copy / "config.json", "w") as f:
        json.dump({**config, **edit}, f)
    with pytest.raises(ValueError, match="is not from the target --model") as e:
        train_drafter(small_train_config(run_copy, model_copy, tmp_path / "out"))
    assert said in str(e.value) and "config.json differs" in str(e.value)
    assert not (tmp_path / "out").exists()


# -- 1. outputs that cannot destroy inputs --------------------------------------------------------------------


@pytest.mark.parametrize("where", ["model", "model/", "./model", "model-symlink", "run", "run/./", "inside-model",
                                   "inside-run", "contains-model", "inside-other-model", "inside-other-run",
                                   "other-run", "foreign-folder"])
def test_an_out_that_is_overlaps_or_lies_in_a_model_or_run_is_refused_before_any_work(where, model_copy, run_copy,
                                                                                      tmp_path, oracle_run,
                                                                                      monkeypatch):
    other_model = tmp_path / "other-model"
    shutil.copytree(model_copy, other_model)
    other_run = tmp_path / "other-run"
    shutil.copytree(run_copy, other_run)
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("mine")
    os.symlink(model_copy, tmp_path / "model-symlink")
    monkeypatch.chdir(model_copy.parent)
    out = {"model": str(model_copy), "model/": "target/", "./model": "./target", "model-symlink":
           str(tmp_path / "model-symlink"), "run": str(run_copy), "run/./": f"{run_copy}/./",
           "inside-model": str(model_copy / "drafter"), "inside-run": str(run_copy / "data" / "drafter"),
           "contains-model": str(tmp_path / "models"), "inside-other-model": str(other_model / "d" / "e"),
           "inside-other-run": str(other_run / "drafter"), "other-run": str(other_run),
           "foreign-folder": str(foreign)}[where]
    before = {p: tree_digest(p) for p in (model_copy, run_copy, other_model, other_run, foreign)}
    with pytest.raises(ValueError, match=r"--out .*(pick another --out|pick a new)"):
        train_drafter(small_train_config(run_copy, model_copy, out))
    assert {p: tree_digest(p) for p in before} == before  # nothing written, nothing replaced
    assert not (model_copy / "drafter").exists() and not (other_model / "d").exists()
    assert not (run_copy / "data" / "drafter").exists() and not (other_run / "drafter").exists()


def test_a_refused_or_stopped_training_leaves_no_out_behind(oracle_run, tiny_llama, tmp_path):
    other = HiddenStatesSpec(layer_ids=(1, 2, 4), num_hidden_layers=4, hidden_size=32, dtype="float32",
                             model="other/model")
    write_run(str(tmp_path / "other"), random_samples(3, other), other)
    out = tmp_path / "new" / "nested" / "out"
    with pytest.raises(ValueError, match="not from the target --model"):
        train_drafter(small_train_config(tmp_path / "other", tiny_llama, out))
    assert not (tmp_path / "new").exists()
    # stopped at its first batch (a NaN sample), before any checkpoint: the folders it made are gone again
    spec = _tiny_spec(tiny_llama)
    samples = random_samples(4, spec, seed=3)
    for s in samples:
        s.hidden_states[0, 0, 0] = float("nan")
    write_run(str(tmp_path / "nan"), samples, spec, check_states=False)
    with pytest.raises(TrainingStopped):
        train_drafter(small_train_config(tmp_path / "nan", tiny_llama, out, kind="medusa", draft_vocab_size=None))
    assert not (tmp_path / "new").exists()


def test_cli_out_that_is_a_file_or_the_model_exits_2_with_one_line(oracle_run, model_copy, tmp_path, capsys):
    from cli.args import EXIT_USAGE
    from cli.main import main

    (tmp_path / "afile").write_text("x")
    before = tree_digest(model_copy)
    for out, message in ((tmp_path / "afile", "is a file, not a folder"),
                         (tmp_path / "afile" / "sub", "is a file, not a folder"),
                         (model_copy, "is the --model folder")):
        with pytest.raises(SystemExit) as e:
            main(["train-drafter", "--run", oracle_run[0], "--model", str(model_copy), "--out", str(out), "--steps",
                  "1", "--device", "cpu", "--no-progress"])
        assert e.value.code == EXIT_USAGE
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
    assert tree_digest(model_copy) == before and (tmp_path / "afile").read_text() == "x"


@pytest.fixture
def read_only_folder(tmp_path):
    """An empty folder that cannot be written: a read-only tmpfs when we are root (root ignores modes), else 0o555."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() == 0:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                              capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs here: {done.stderr.decode().strip()}")
        yield folder
        subprocess.run(["umount", str(folder)], check=False)
    else:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)


def test_a_read_only_out_is_refused_up_front(oracle_run, tiny_llama, read_only_folder):
    with pytest.raises(ValueError, match=r"--out .* cannot be written"):
        train_drafter(small_train_config(oracle_run[0], tiny_llama, read_only_folder))
    with pytest.raises(ValueError, match=r"--out .* cannot be written"):
        train_drafter(small_train_config(oracle_run[0], tiny_llama, read_only_folder / "sub"))
    from training.export import export_run

    with pytest.raises(ValueError, match=r"DEST .* cannot be written"):
        export_run(oracle_run[0], str(read_only_folder / "x"), "speculators")


def test_one_writer_per_out(oracle_run, tiny_llama, tmp_path):
    from connectors.lease import LeaseHeld

    config = small_train_config(oracle_run[0], tiny_llama, tmp_path / "out")
    with config.output_folder().open():  # another training holds --out
        with pytest.raises(LeaseHeld, match="hsx train-drafter"):
            train_drafter(config)
        assert not (tmp_path / "out" / "checkpoint").exists()
    assert train_drafter(config)["steps"] == 2  # once it is gone, the folder is free
    assert not (tmp_path / "out" / "writer.lease").exists()


def test_export_dest_is_guarded_like_out(oracle_run, model_copy, run_copy, tmp_path):
    from training.export import export_run

    before = tree_digest(run_copy), tree_digest(model_copy)
    for dest, message in ((run_copy, "is the OUTPUT folder"), (run_copy / "exp", "lies inside the OUTPUT folder"),
                          (model_copy, "is the --model-dir folder"), (tmp_path / "runs", "contains the OUTPUT folder")):
        with pytest.raises(ValueError, match=message):
            export_run(str(run_copy), str(dest), "speculators", model_dir=str(model_copy))
    assert (tree_digest(run_copy), tree_digest(model_copy)) == before and not (run_copy / "exp").exists()
    # a training's --out is not an export's DEST, nor the other way round
    train_drafter(small_train_config(run_copy, model_copy, tmp_path / "drafter"))
    with pytest.raises(ValueError, match="DEST .* holds a model"):
        export_run(str(run_copy), str(tmp_path / "drafter"), "speculators")
    export_run(str(run_copy), str(tmp_path / "exp"), "speculators")
    with pytest.raises(ValueError, match="not an output of hsx train-drafter"):
        train_drafter(small_train_config(run_copy, model_copy, tmp_path / "exp"))


# -- 2. the training feed trusts nothing ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory, tiny_llama):
    """8 same-length samples of the tiny Llama's shape; 2 hold NaN/Inf states (their checksums are consistent, as an
    fp16 overflow at extraction would give; written by a writer without the commit check, as before it existed)."""
    spec = _tiny_spec(tiny_llama)
    samples = random_samples(8, spec, seed=5, min_len=12, max_len=12)
    samples[2].hidden_states[3, 1, 7] = float("nan")
    samples[5].hidden_states[0, 2, :] = float("inf")
    out = str(tmp_path_factory.mktemp("nan-run"))
    write_run(out, samples, spec, check_states=False)
    return out, samples


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_nan_states_stop_training_naming_the_sample_and_nothing_is_saved(kind, nan_run, tiny_llama, tmp_path):
    out = tmp_path / "out"
    options = {} if kind == "eagle3" else {"draft_vocab_size": None}
    with pytest.raises(TrainingStopped, match=r"sample 's0000[25]'.*NaN/Inf values.*hsx verify.*--skip-bad-samples"):
        train_drafter(small_train_config(nan_run[0], tiny_llama, out, kind=kind, steps=6, batch_tokens=24, checkpoint_every=1,
                              **options))
    assert not (out / "model.safetensors").exists()
    state = out / "checkpoint" / "state.pt"
    if state.exists():  # a checkpoint from before the bad batch: finite, as every saved one
        weights = torch.load(state, weights_only=False)["model"]
        assert all(bool(torch.isfinite(w).all()) for w in weights.values() if w.is_floating_point())


def test_skip_bad_samples_trains_without_them_and_counts_them(nan_run, tiny_llama, tmp_path):
    from safetensors.torch import load_file

    report = train_drafter(small_train_config(nan_run[0], tiny_llama, tmp_path, steps=6, batch_tokens=24,
                                   skip_bad_samples=True))
    assert report["steps"] == 6 and report["skipped_samples"] == 2
    assert sorted(report["skipped"]) == ["s00002", "s00005"] and "NaN/Inf" in report["skipped"]["s00002"]
    weights = load_file(tmp_path / "model.safetensors")
    assert all(bool(torch.isfinite(w).all()) for w in weights.values() if w.is_floating_point())
    assert json.loads((tmp_path / "report.json").read_text())["skipped_samples"] == 2


@pytest.fixture
def same_length_run(tmp_path, tiny_llama):
    """4 samples of the tiny Llama's shape, all 12 tokens long: any one file could stand in for another."""
    spec = _tiny_spec(tiny_llama)
    out = tmp_path / "run"
    rows = write_run(str(out), random_samples(4, spec, seed=9, min_len=12, max_len=12), spec)
    return out, rows


def _damage(run, rows, how: str) -> str:
    """Plant `how` on sample 1 of `run`; the sample id a reader must name."""
    if how == "file-replaced":  # another sample's valid file copied over sample 1's
        shutil.copyfile(run / rows[2]["path"], run / rows[1]["path"])
    elif how == "row-points-elsewhere":
        rows = [dict(r) for r in rows]
        rows[1]["path"], rows[1]["checksum"] = rows[2]["path"], rows[2]["checksum"]
        write_manifest(str(run), rows)
    elif how == "checksum-differs":  # the manifest commits another content than the file's header records
        rows = [dict(r) for r in rows]
        rows[1]["checksum"] = rows[2]["checksum"]
        write_manifest(str(run), rows)
    elif how == "file-missing":
        os.remove(run / rows[1]["path"])
    elif how == "row-leaves-the-run":  # sample 1's own valid file, moved outside the run, the row pointing there
        os.makedirs(run.parent / "elsewhere")
        os.replace(run / rows[1]["path"], run.parent / "elsewhere" / "s1.safetensors")
        rows = [dict(r) for r in rows]
        rows[1]["path"] = "../elsewhere/s1.safetensors"
        write_manifest(str(run), rows)
    return rows[1]["sample_id"]


DAMAGE = {"file-replaced": "holds sample 's00002', not the manifest row's",
          "row-points-elsewhere": "holds sample 's00002', not the manifest row's",
          "checksum-differs": "records checksum xxh3_64:[0-9a-f]+, the manifest row xxh3_64",
          "file-missing": "is missing, though the manifest commits it",
          "row-leaves-the-run": "path '../elsewhere/s1.safetensors' is not a plain relative path inside the run"}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_file_that_is_not_the_manifest_rows_stops_training_and_export(how, same_length_run, tiny_llama, tmp_path):
    from training.dataset import HiddenStatesDataset
    from training.export import export_run

    run, rows = same_length_run
    sid = _damage(run, rows, how)
    ds = HiddenStatesDataset(str(run))
    with pytest.raises((ValueError, OSError), match=f"sample '{sid}'.*{DAMAGE[how]}.*hsx verify"):
        ds[1]
    for kind, options in (("eagle3", {}), ("mlp_speculator", {"draft_vocab_size": None})):
        with pytest.raises(TrainingStopped, match=f"'{sid}'.*{DAMAGE[how]}"):
            train_drafter(small_train_config(run, tiny_llama, tmp_path / kind, kind=kind, steps=4, batch_tokens=24, **options))
        assert not (tmp_path / kind / "model.safetensors").exists()
    with pytest.raises((ValueError, OSError), match=f"'{sid}'.*{DAMAGE[how]}"):
        export_run(str(run), str(tmp_path / "exp"), "speculators")


# -- 3. resume by identity -----------------------------------------------------------------------------------


def test_resume_follows_the_run_not_its_spelling_and_refuses_a_changed_run(run_copy, tiny_llama, tmp_path,
                                                                         monkeypatch):
    out = tmp_path / "out"
    first = train_drafter(small_train_config(run_copy, tiny_llama, out, steps=2))
    assert first["run_identity"]["committed_samples"] == 6
    monkeypatch.chdir(run_copy.parent.parent)
    for spelling in ("./runs/good", "runs/good/", "runs/../runs/good"):  # one run: it resumes
        again = train_drafter(small_train_config(spelling, tiny_llama, out, steps=2))
        assert again["resumed_from_step"] == 2
    rows = read_manifest(RunDir(str(run_copy))).to_pylist()
    write_manifest(str(run_copy), rows[:3])  # the same spelling, half of the manifest gone
    before = tree_digest(out)
    with pytest.raises(ValueError, match=r"committed 6 samples when the training started and commits 3 now"):
        train_drafter(small_train_config(run_copy, tiny_llama, out, steps=4))
    spec = json.loads((run_copy / "run.json").read_text())
    spec["model_fingerprint"] = "sha256:" + "0" * 64
    write_manifest(str(run_copy), rows)
    (run_copy / "run.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="run.json of --run .* differs"):
        train_drafter(small_train_config(run_copy, tiny_llama, out, steps=4))
    assert tree_digest(out) == before  # refused: the checkpoint and drafter are as they were


# -- diverged training, weights never saved non-finite ------------------------------------------------------


def test_a_diverged_training_stops_and_saves_no_non_finite_weights(oracle_run, tiny_llama, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(TrainingStopped, match=r"(non-finite weights|the loss is|gradient norm).*lower --lr"):
        train_drafter(small_train_config(oracle_run[0], tiny_llama, out, kind="mlp_speculator", draft_vocab_size=None,
                              lr=1e30, max_grad_norm=0, steps=20, checkpoint_every=1))
    assert not (out / "model.safetensors").exists()
    state = out / "checkpoint" / "state.pt"
    if state.exists():
        weights = torch.load(state, weights_only=False)["model"]
        assert all(bool(torch.isfinite(w).all()) for w in weights.values() if w.is_floating_point())


def test_a_checkpoint_with_non_finite_weights_is_never_written(tmp_path):
    with pytest.raises(TrainingStopped, match=r"non-finite weights in head.weight \(1\)"):
        save_checkpoint(str(tmp_path), {"step": 3, "model": {"head.weight": torch.tensor([1.0, float("nan")]),
                                                             "ids": torch.tensor([1, 2])}})
    assert os.listdir(tmp_path) == []


def test_every_file_of_a_training_has_the_same_permissions(oracle_run, tiny_llama, tmp_path):
    train_drafter(small_train_config(oracle_run[0], tiny_llama, tmp_path / "out", steps=2, checkpoint_every=1))
    modes = {}
    for d, _, names in os.walk(tmp_path / "out"):
        for name in names:
            modes[os.path.relpath(os.path.join(d, name), tmp_path / "out")] = oct(os.stat(os.path.join(d, name)).st_mode
                                                                                  & 0o777)
    assert "checkpoint/state.pt" in modes and "model.safetensors" in modes
    assert len(set(modes.values())) == 1, modes


def test_cli_stopped_training_exits_1_with_one_line(nan_run, tiny_llama, tmp_path, capsys):
    from cli.args import EXIT_FAILED
    from cli.main import main

    code = main(["train-drafter", "--kind", "medusa", "--run", nan_run[0], "--model", tiny_llama, "--out",
                 str(tmp_path / "out"), "--steps", "6", "--batch-tokens", "24", "--device", "cpu", "--no-progress"])
    assert code == EXIT_FAILED
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("hsx train-drafter: training stopped") and "--skip-bad-samples" in err[0]


# -- 6. exports byte-identical across processes -------------------------------------------------------------


@pytest.mark.slow
def test_exports_are_byte_identical_across_processes(oracle_run, tmp_path):
    """Each format exported by two processes with different hash seeds: every file the same bytes (the marker, which
    records when and where the folder was taken, aside)."""
    script = ("import sys; from training.export import export_run\n"
              "for fmt in ('speculators', 'specforge', 'modelopt'):\n"
              "    export_run(sys.argv[1], f'{sys.argv[2]}/{fmt}', fmt)\n")
    trees = []
    for seed in ("1", "2"):
        dest = tmp_path / f"seed{seed}"
        subprocess.run([sys.executable, "-c", script, oracle_run[0], str(dest)], cwd=REPO, check=True, timeout=600,
                       env={**os.environ, "PYTHONHASHSEED": seed})
        trees.append({p: h for p, h in tree_digest(dest).items() if not p.endswith(".hsx-output.json")})
    assert trees[0] == trees[1]
    assert len(trees[0]) > 3 * len(oracle_run[1])
