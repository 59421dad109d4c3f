"""A quantized checkpoint (issue 51, item 4): run.json records its quantization_config in short, and a resume with a
model quantized otherwise is refused in one line naming both — never a run mixing two quantizations."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from connectors.fingerprint import model_quantization
from connectors.format import HiddenStatesSpec
from connectors.run import RunDir, RunSpec, read_run_spec
from jobs.runinfo import RunMismatch, ensure_run_spec

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
FP8_SHORT = "fp8 (fmt=e4m3, weight_block_size=[128, 128], activation_scheme=dynamic)"


def _spec(**job) -> RunSpec:
    files = HiddenStatesSpec(layer_ids=(2, 4), num_hidden_layers=4, hidden_size=8, dtype="float32", model="/m",
                             model_revision="")
    return RunSpec(files, **({"model_fingerprint": "f"} | job))


# -- the run-identity comparison ------------------------------------------------------------------------------------
def test_the_quantization_in_short_names_method_and_the_keys_that_change_numerics():
    assert model_quantization({}) == ""
    assert model_quantization({"quantization_config": FP8 | {"modules_to_not_convert": ["lm_head"]}}) == FP8_SHORT
    assert model_quantization({"quantization_config": {"quant_method": "mxfp4"}}) == "mxfp4"
    assert model_quantization({"quantization_config": {"bits": 4}}) == "unknown (bits=4)"
    # a multimodal wrapper: its top-level config first, then its text config's
    assert model_quantization({"text_config": {"quantization_config": {"quant_method": "mxfp4"}}}) == "mxfp4"


def test_a_resume_with_another_quantization_is_refused_naming_both(tmp_path):
    out = RunDir(str(tmp_path))
    assert ensure_run_spec(out, _spec()) is True
    assert "model_quantization" not in json.loads((tmp_path / "run.json").read_text())  # unquantized: as before
    assert ensure_run_spec(out, _spec()) is False
    with pytest.raises(RunMismatch) as e:
        ensure_run_spec(out, _spec(model_quantization=FP8_SHORT, model_fingerprint="g"))
    msg = str(e.value)
    assert "\n" not in msg
    assert f"model_quantization: run has none (not quantized), this job has '{FP8_SHORT}'" in msg
    assert "model_fingerprint" not in msg  # the quantization says how config.json changed
    assert "pick a new --output" in msg


def test_a_quantized_run_records_it_and_refuses_another(tmp_path):
    out = RunDir(str(tmp_path))
    ensure_run_spec(out, _spec(model_quantization=FP8_SHORT))
    assert json.loads((tmp_path / "run.json").read_text())["model_quantization"] == FP8_SHORT
    assert read_run_spec(out).model_quantization == FP8_SHORT
    assert ensure_run_spec(out, _spec(model_quantization=FP8_SHORT)) is False
    with pytest.raises(RunMismatch, match=r"run has 'fp8 \(fmt=e4m3.*\)', this job has 'mxfp4'"):
        ensure_run_spec(out, _spec(model_quantization="mxfp4"))
    with pytest.raises(RunMismatch, match=r"this job has none \(not quantized\)"):
        ensure_run_spec(out, _spec())


def test_vllms_on_the_fly_quantization_is_recorded_and_a_resume_without_it_refused(tmp_path):
    """run.json recorded only the checkpoint's quantization: `--engine vllm --vllm-args '{"quantization": "fp8"}'`
    states came from fp8 weights with nothing saying so, and a resume without it mixed them with bf16 ones."""
    from jobs.config import JobConfig
    from jobs.runinfo import engine_quantization

    on_the_fly = JobConfig(model="/m", engine="vllm", vllm_args={"quantization": "fp8"})
    assert engine_quantization(on_the_fly) == "fp8 (vLLM, on the fly)"
    assert engine_quantization(JobConfig(model="/m", engine="vllm")) == ""
    assert engine_quantization(JobConfig(model="/m")) == ""
    out = RunDir(str(tmp_path))
    ensure_run_spec(out, _spec(engine_quantization="fp8 (vLLM, on the fly)"))
    assert json.loads((tmp_path / "run.json").read_text())["engine_quantization"] == "fp8 (vLLM, on the fly)"
    assert ensure_run_spec(out, _spec(engine_quantization="fp8 (vLLM, on the fly)")) is False
    with pytest.raises(RunMismatch, match=r"engine_quantization: run has 'fp8 \(vLLM, on the fly\)', this job has "
                                          r"none \(not quantized\) \(--vllm-args' quantization"):
        ensure_run_spec(out, _spec())
    assert "engine_quantization" not in _spec().to_json()  # an unquantized run's run.json is as before


def test_a_run_json_without_the_field_reads_as_not_quantized(tmp_path):
    doc = _spec().to_json()
    doc.pop("model_quantization", None)
    (tmp_path / "run.json").write_text(json.dumps(doc))
    assert read_run_spec(str(tmp_path)).model_quantization == ""
    assert ensure_run_spec(RunDir(str(tmp_path)), _spec()) is False  # an old run resumes with an unquantized model
    doc["model_quantization"] = 8
    (tmp_path / "run.json").write_text(json.dumps(doc))
    with pytest.raises(Exception, match="'model_quantization' is 8"):
        read_run_spec(str(tmp_path))


# -- real model folders ---------------------------------------------------------------------------------------------
@pytest.fixture
def models(tmp_path):
    """A tiny llama and a copy of it whose config.json names an fp8 quantization_config (weights untouched)."""
    from reference.tiny_models import build_tiny_model

    plain = build_tiny_model("llama", str(tmp_path / "plain"), seed=0)
    quant = str(tmp_path / "fp8")
    shutil.copytree(plain, quant)
    path = os.path.join(quant, "config.json")
    doc = json.load(open(path))
    doc["quantization_config"] = FP8
    json.dump(doc, open(path, "w"), indent=2)
    return plain, quant


def _config(model: str, tmp_path):
    from jobs.config import JobConfig

    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "prompt": "hello there"}\n')
    return JobConfig(model=model, corpus=(str(corpus),), output=str(tmp_path / "out"), progress=False)


def test_run_json_of_a_quantized_model_records_it(models, tmp_path):
    from jobs.pipeline import prepare_job

    _, quant = models
    assert prepare_job(_config(quant, tmp_path)).new_run
    doc = json.loads((tmp_path / "out" / "run.json").read_text())
    assert doc["model_quantization"] == FP8_SHORT


def test_a_quantized_copy_of_the_runs_model_is_refused_on_resume(models, tmp_path):
    from jobs.pipeline import prepare_job

    plain, quant = models
    config = _config(plain, tmp_path)
    assert prepare_job(config).new_run
    assert not prepare_job(config).new_run
    # the same model path, now holding the quantized copy
    shutil.rmtree(plain)
    shutil.copytree(quant, plain)
    with pytest.raises(RunMismatch, match=r"model_quantization: run has none \(not quantized\), this job has "
                                          r"'fp8 \(fmt=e4m3, weight_block_size=\[128, 128\].*new --output"):
        prepare_job(config)


def test_loading_a_quantized_checkpoint_says_what_transformers_did(models, caplog):
    """transformers 5.25 loads an fp8 checkpoint on CPU dequantized (its warning: no GPU/XPU) when accelerate is
    installed, and refuses without it (ImportError): hsx says either in one line naming the quantization."""
    import importlib.util

    from extractor.config import EngineConfig
    from extractor.runner import ModelRunner

    _, quant = models
    config = EngineConfig(model=quant, device="cpu", dtype="float32")
    if importlib.util.find_spec("accelerate") is None:
        with pytest.raises(ValueError) as e:
            ModelRunner(config)
        msg = str(e.value)
        assert "\n" not in msg and FP8_SHORT in msg and "accelerate" in msg
        return
    with caplog.at_level("WARNING", logger="extractor.runner"):
        ModelRunner(config)
    lines = [r.getMessage() for r in caplog.records if r.name == "extractor.runner" and FP8_SHORT in r.getMessage()]
    assert len(lines) == 1 and "transformers" in lines[0]
