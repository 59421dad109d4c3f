"""The drafter trainer (training/trainer.py and its modules) and `hsx train-drafter`: checks before training, the report,
resume after a kill, exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from connectors import HiddenStatesSpec
from harness.runs import random_samples, write_run
from training.train_config import TrainDrafterConfig
from training_jobs.train import train_drafter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(oracle_run, tiny_llama, out, **kw) -> TrainDrafterConfig:
    defaults = dict(run=oracle_run[0], model=tiny_llama, out=str(out), kind="eagle3", steps=3, lr=3e-3,
                    batch_tokens=64, draft_vocab_size=48, checkpoint_every=2, device="cpu", progress=False)
    return TrainDrafterConfig(**{**defaults, **kw})


def _weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def test_training_writes_the_serving_checkpoint_and_a_report(oracle_run, tiny_llama, tmp_path):
    from drafters.eagle3 import Eagle3Drafter

    report = train_drafter(_config(oracle_run, tiny_llama, tmp_path, steps=4))
    assert report["steps"] == 4 and report["resumed_from_step"] is None and report["tokens"] > 0
    assert len(report["accuracy_per_position"]) == 3 and report["simulated_acceptance_length"] >= 1.0
    assert report["final_loss"] > 0 and report["target"] == tiny_llama and report["layer_ids"] == [1, 2, 4]
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["steps"] == 4 and on_disk["final_loss"] == report["final_loss"]
    assert json.loads((tmp_path / "config.json").read_text())["speculators_model_type"] == "eagle3"
    back = Eagle3Drafter.from_pretrained(str(tmp_path))
    assert back.lm_head.out_features == 48
    # a second call with the same OUT resumes at the end: no further steps, the same weights
    before = _weights(tmp_path)
    again = train_drafter(_config(oracle_run, tiny_llama, tmp_path, steps=4))
    assert again["resumed_from_step"] == 4 and again["steps"] == 4
    after = _weights(tmp_path)
    assert all(torch.equal(before[k], after[k]) for k in before)



@pytest.mark.parametrize("kind", ["medusa", "mlp_speculator"])
def test_every_kind_trains_through_the_same_trainer(kind, oracle_run, tiny_llama, tmp_path):
    from drafters.registry import drafter_class

    report = train_drafter(_config(oracle_run, tiny_llama, tmp_path, kind=kind, steps=2, draft_vocab_size=None,
                                   num_speculative_tokens=2))
    assert report["kind"] == kind and report["steps"] == 2 and len(report["accuracy_per_position"]) == 2
    back = drafter_class(kind).from_pretrained(str(tmp_path))
    assert back.kind == kind

@pytest.mark.parametrize("kind, options", [("eagle", {}), ("peagle", {"draft_vocab_size": 48, "ttt_steps": 3}),
                                           ("dflash", {"family_options": {"block_size": 4}})])
def test_the_new_families_train_resume_and_reload(kind, options, oracle_run, tiny_llama, tmp_path):
    """EAGLE, P-EAGLE, DFlash through the one trainer: a training stopped at its step-2 checkpoint and resumed to
    step 4 ends with the weights of an uninterrupted one (their random anchor / depth draws included), and the
    serving checkpoint reloads."""
    from drafters.registry import drafter_class

    settings = {"kind": kind, "draft_vocab_size": None, "num_speculative_tokens": 3, **options}
    train_drafter(_config(oracle_run, tiny_llama, tmp_path / "resumed", steps=2, **settings))
    resumed = train_drafter(_config(oracle_run, tiny_llama, tmp_path / "resumed", steps=4, **settings))
    straight = train_drafter(_config(oracle_run, tiny_llama, tmp_path / "straight", steps=4, **settings))
    assert resumed["resumed_from_step"] == 2 and resumed["kind"] == kind and len(resumed["accuracy_per_position"]) == 3
    a, b = _weights(tmp_path / "resumed"), _weights(tmp_path / "straight")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert straight["final_loss"] == resumed["final_loss"]
    assert drafter_class(kind).from_pretrained(str(tmp_path / "resumed")).kind == kind


def test_a_checkpoint_of_another_training_is_not_resumed(oracle_run, tiny_llama, tmp_path):
    train_drafter(_config(oracle_run, tiny_llama, tmp_path, steps=2))
    with pytest.raises(ValueError, match=r"another training \(lr: 0.003 in the checkpoint vs 0.01 now"):
        train_drafter(_config(oracle_run, tiny_llama, tmp_path, steps=2, lr=1e-2))
    with pytest.raises(ValueError, match="drop --no-resume"):
        train_drafter(_config(oracle_run, tiny_llama, tmp_path, steps=2, resume=False))


@pytest.mark.slow
def test_a_killed_training_resumes_where_it_stopped_and_ends_with_the_uninterrupted_weights(oracle_run, tiny_llama,
                                                                                          tmp_path):
    killed = tmp_path / "killed"
    settings = dict(run=oracle_run[0], model=tiny_llama, out=str(killed), steps=10**6, lr=3e-3, batch_tokens=64,
                    draft_vocab_size=48, checkpoint_every=2, device="cpu", progress=False)
    argv = ["train-drafter", "--run", settings["run"], "--model", tiny_llama, "--out", str(killed), "--steps",
            str(10**6), "--lr", "3e-3", "--batch-tokens", "64", "--draft-vocab-size", "48", "--checkpoint-every", "2",
            "--device", "cpu", "--no-progress"]  # the same settings through `hsx train-drafter`
    proc = subprocess.Popen([sys.executable, "-m", "cli", *argv], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    step_file = killed / "checkpoint" / "step.json"
    deadline = time.monotonic() + 240
    try:
        while not step_file.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    stopped = torch.load(killed / "checkpoint" / "state.pt", weights_only=False)["step"]
    assert stopped >= 2 and stopped % 2 == 0
    assert not (killed / "model.safetensors").exists()  # it never finished

    end = stopped + 3
    resumed = train_drafter(TrainDrafterConfig(**{**settings, "steps": end}))
    assert resumed["resumed_from_step"] == stopped and resumed["steps"] == end
    straight = train_drafter(_config(oracle_run, tiny_llama, tmp_path / "straight", steps=end))
    assert straight["resumed_from_step"] is None and straight["tokens"] == resumed["tokens"]
    a, b = _weights(killed), _weights(tmp_path / "straight")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # TensorBoard's own reader: the killed and resumed training's curves are one series, each step once, with the
    # uninterrupted training's values (what the killed process logged after its checkpoint is purged)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def curves(folder) -> dict[str, list[tuple[int, float]]]:
        acc = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0})
        acc.Reload()
        return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

    resumed_curves, straight_curves = curves(killed), curves(tmp_path / "straight")
    assert {"train/loss", "train/lr", "train/tokens_per_second", "train/simulated_acceptance_length",
            "train/accuracy/pos_1", "train/accuracy/pos_3"} <= set(resumed_curves) == set(straight_curves)
    for tag in ("train/loss", "train/lr", "train/simulated_acceptance_length", "train/accuracy/pos_1"):
        assert [s for s, _ in resumed_curves[tag]] == list(range(1, end + 1)), tag
        assert [v for _, v in resumed_curves[tag]] == pytest.approx([v for _, v in straight_curves[tag]]), tag



def test_learning_rate_warms_up_then_stays_or_follows_a_cosine_to_a_tenth(oracle_run, tiny_llama, tmp_path):
    constant = _config(oracle_run, tiny_llama, tmp_path, lr=1.0, warmup_steps=2, steps=10)
    assert [constant.lr_at(i, 10) for i in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    cosine = _config(oracle_run, tiny_llama, tmp_path, lr=1.0, warmup_steps=2, steps=10, lr_schedule="cosine")
    lrs = [cosine.lr_at(i, 10) for i in range(10)]
    assert lrs[:3] == [0.5, 1.0, 1.0] and lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))
    assert "steps" in cosine.resume_key() and "steps" not in constant.resume_key()  # cosine pins the length

# -- bad input, refused before training --------------------------------------------------------------------------


def test_an_empty_run_is_refused(oracle_run, tiny_llama, tmp_path):
    spec = HiddenStatesSpec(layer_ids=(1, 2, 4), num_hidden_layers=4, hidden_size=64, dtype="float32",
                            model=tiny_llama)
    write_run(str(tmp_path / "empty"), [], spec)
    with pytest.raises(ValueError, match="has no extracted samples.*hsx run"):
        train_drafter(_config(oracle_run, tiny_llama, tmp_path / "out", run=str(tmp_path / "empty")))


def test_a_run_from_another_model_is_refused(oracle_run, tiny_llama, tmp_path):
    spec = HiddenStatesSpec(layer_ids=(1, 2, 4), num_hidden_layers=4, hidden_size=32, dtype="float32",
                            model="other/model")
    write_run(str(tmp_path / "other"), random_samples(3, spec), spec)
    with pytest.raises(ValueError, match=r"not from the target --model.*32 wide, the target's 64"):
        train_drafter(_config(oracle_run, tiny_llama, tmp_path / "out", run=str(tmp_path / "other")))
    assert not (tmp_path / "out" / "checkpoint").exists()


def test_a_run_whose_model_fingerprint_differs_is_warned_about(oracle_run, tiny_llama, tmp_path, caplog):
    """Same config, other weights (another fine-tune of one base): the config checks pass, the fingerprint the job
    recorded does not match, and the trainer says so before training."""
    import logging

    from transformers import AutoConfig

    from connectors.run import RunSpec
    from jobs.model import model_fingerprint

    out, samples, spec = oracle_run
    fingerprint = model_fingerprint(tiny_llama, AutoConfig.from_pretrained(tiny_llama))
    for name, recorded, warned in (("same", fingerprint, False), ("other", "v2:0123456789abcdef", True)):
        run = tmp_path / name
        write_run(str(run), samples, spec, run_json=RunSpec.from_file_spec(spec, model_fingerprint=recorded))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="training.checks"):
            train_drafter(_config(oracle_run, tiny_llama, tmp_path / f"out-{name}", run=str(run), steps=1))
        assert ("records model fingerprint v2:0123456789abcdef" in caplog.text) is warned, caplog.text
        assert (fingerprint in caplog.text) is warned


def test_a_run_without_the_layers_the_kind_needs_is_refused(oracle_run, tiny_llama, tmp_path):
    for layers, message in (((1, 2), r"needs layers \[4\].*missing \[4\].*--layers 1,2,4"),
                            ((4,), r"stores only layers \[4\].*--layers 1,2,4")):
        spec = HiddenStatesSpec(layer_ids=layers, num_hidden_layers=4, hidden_size=64, dtype="float32",
                                model=tiny_llama)
        run = tmp_path / f"run-{len(layers)}"
        write_run(str(run), random_samples(2, spec), spec)
        with pytest.raises(ValueError, match=message):
            train_drafter(_config(oracle_run, tiny_llama, tmp_path / "out", run=str(run)))


def test_a_run_with_the_last_layer_after_the_norm_is_refused(oracle_run, tiny_llama, tmp_path):
    spec = HiddenStatesSpec(layer_ids=(1, 2, 4), num_hidden_layers=4, hidden_size=64, dtype="float32",
                            model=tiny_llama, last_layer_normalized=True)
    write_run(str(tmp_path / "post"), random_samples(2, spec), spec)
    with pytest.raises(ValueError, match="after the final norm.*pre-norm"):
        train_drafter(_config(oracle_run, tiny_llama, tmp_path / "out", run=str(tmp_path / "post")))


def test_bad_settings_are_refused(oracle_run, tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="not a local model folder"):
        train_drafter(_config(oracle_run, tiny_llama, tmp_path, model=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="cannot open the run"):
        train_drafter(_config(oracle_run, tiny_llama, tmp_path, run=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="--steps or --epochs, not both"):
        _config(oracle_run, tiny_llama, tmp_path, epochs=1.0)
    with pytest.raises(ValueError, match="applies to --kind eagle3 / peagle only"):
        _config(oracle_run, tiny_llama, tmp_path, kind="medusa")
    with pytest.raises(ValueError, match="not a drafter family"):
        _config(oracle_run, tiny_llama, tmp_path, kind="eagle9")
    with pytest.raises(ValueError, match="bad family option"):
        train_drafter(_config(oracle_run, tiny_llama, tmp_path, family_options='{"no_such_option": 1}'))


# -- hsx train-drafter --------------------------------------------------------------------------------------------


def test_cli_trains_and_exits_0(oracle_run, tiny_llama, tmp_path, capsys):
    from cli.main import main

    code = main(["train-drafter", "--kind", "eagle3", "--run", oracle_run[0], "--model", tiny_llama, "--out",
                 str(tmp_path), "--steps", "2", "--batch-tokens", "64", "--draft-vocab-size", "40", "--ttt-steps", "2",
                 "--family-options", '{"num_layers": 2}', "--device", "cpu", "--no-progress"])
    assert code == 0
    assert "trained eagle3 for 2 steps" in capsys.readouterr().out
    doc = json.loads((tmp_path / "config.json").read_text())
    assert doc["draft_vocab_size"] == 40 and doc["transformer_layer_config"]["num_hidden_layers"] == 2
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["steps"] == 2 and len(report["accuracy_per_position"]) == 2


def test_memory_flags_train_the_same_weights(oracle_run, tiny_llama, tmp_path, capsys):
    """--gradient-checkpointing and --ce-chunk-tokens reach the drafter and change no weight of the trained head."""
    from cli.main import main

    plain = train_drafter(_config(oracle_run, tiny_llama, tmp_path / "plain", kind="dflash", draft_vocab_size=None,
                                  family_options={"block_size": 4}))
    code = main(["train-drafter", "--kind", "dflash", "--run", oracle_run[0], "--model", tiny_llama, "--out",
                 str(tmp_path / "lean"), "--steps", "3", "--lr", "3e-3", "--batch-tokens", "64", "--checkpoint-every",
                 "2", "--family-options", '{"block_size": 4}', "--device", "cpu", "--no-progress",
                 "--gradient-checkpointing", "--ce-chunk-tokens", "16"])
    assert code == 0 and plain["steps"] == 3
    report = json.loads((tmp_path / "lean" / "report.json").read_text())
    assert report["memory_options"] == {"gradient_checkpointing": True, "ce_chunk_tokens": 16, "autocast": None}
    lean, want = _weights(tmp_path / "lean"), _weights(tmp_path / "plain")
    assert lean.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(lean[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_cli_bad_input_exits_2_with_one_line_and_no_traceback(oracle_run, tiny_llama, tmp_path):
    spec = HiddenStatesSpec(layer_ids=(1, 2), num_hidden_layers=4, hidden_size=64, dtype="float32", model=tiny_llama)
    write_run(str(tmp_path / "run"), random_samples(2, spec), spec)
    proc = subprocess.run([sys.executable, "-m", "cli", "train-drafter", "--run", str(tmp_path / "run"),
                           "--model", tiny_llama, "--out", str(tmp_path / "out"), "--steps", "1", "--device", "cpu"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("hsx train-drafter: error: --kind eagle3 needs layers [4]") and "--layers 1,2,4" in lines[0]


def test_cli_usage_errors_exit_2(oracle_run, tiny_llama, tmp_path, capsys):
    from cli.main import main

    base = ["train-drafter", "--run", oracle_run[0], "--model", tiny_llama, "--out", str(tmp_path)]
    for extra, message in ((["--steps", "2", "--epochs", "1"], "--steps or --epochs, not both"),
                           (["--kind", "medusa", "--draft-vocab-size", "9"], "applies to --kind eagle3 / peagle only"),
                           (["--family-options", "{nope"], "--family-options is not valid JSON"),
                           (["--ce-chunk-tokens", "-1"], "--ce-chunk-tokens must be >= 0"),
                           (["--autocast", "float16"], "--autocast 'float16': use bfloat16")):
        with pytest.raises(SystemExit) as e:
            main([*base, *extra])
        assert e.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.s3
def test_a_run_on_s3_trains_with_its_storage_options(oracle_run, tiny_llama, s3_bucket, tmp_path):
    url, options = s3_bucket
    _, samples, spec = oracle_run
    write_run(f"{url}/run", samples[:3], spec, storage_options=options)
    report = train_drafter(_config(oracle_run, tiny_llama, tmp_path, run=f"{url}/run", storage_options=options,
                                   steps=1))
    assert report["steps"] == 1 and report["samples"] == 3 and "storage_options" not in report["config"]


@pytest.mark.s3
def test_checkpoints_on_s3_are_written_atomically_and_resumed_from(oracle_run, tiny_llama, s3_bucket, tmp_path):
    """--checkpoint-dir s3://...: the checkpoint goes to the store (one whole put; nothing under OUT/checkpoint), and
    the same command again resumes from it and ends with the weights of an uninterrupted training."""
    import fsspec

    url, options = s3_bucket
    ckpt = f"{url}/checkpoints/eagle3"
    out = tmp_path / "out"
    first = train_drafter(_config(oracle_run, tiny_llama, out, steps=2, checkpoint_dir=ckpt, storage_options=options))
    assert first["steps"] == 2 and not (out / "checkpoint").exists()
    fs = fsspec.filesystem("s3", **options)
    assert json.loads(fs.cat(f"{ckpt}/step.json"))["step"] == 2 and fs.size(f"{ckpt}/state.pt") > 0
    resumed = train_drafter(_config(oracle_run, tiny_llama, out, steps=4, checkpoint_dir=ckpt,
                                    storage_options=options))
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == 4
    train_drafter(_config(oracle_run, tiny_llama, tmp_path / "straight", steps=4))
    a, b = _weights(out), _weights(tmp_path / "straight")
    assert all(torch.equal(a[k], b[k]) for k in a)
