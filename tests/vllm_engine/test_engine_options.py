"""`--engine vllm`'s settings, checked without vLLM (vllm_engine/kind.py and options.py, through jobs.config): the flags that only vLLM
takes are refused on hsx's engine, vLLM arguments hsx sets itself are refused in --vllm-args, a top-k target is
refused on vLLM; the CPU thread binding of a gang; the outcomes the plug-in keeps are bounded; and where vLLM is not
installed, `hsx run --engine vllm` says how to install it in one line (exit 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jobs.config import JobConfig
from vllm_engine import outcomes
from vllm_engine.options import INSTALL_HINT, VllmSettings


def job(**kw) -> JobConfig:
    return JobConfig(model="m", corpus=("c.jsonl",), output="o", **kw)


@pytest.mark.parametrize("flags, message", [
    ({"engine": "trt"}, r"--engine 'trt' is not an engine; use hsx \(the default\) or vllm"),
    ({"tensor_parallel_size": 2}, r"--tensor-parallel-size: settings of vLLM's engine; add --engine vllm"),
    ({"pipeline_parallel_size": 2, "enable_expert_parallel": True},
     r"--pipeline-parallel-size, --enable-expert-parallel: settings of vLLM's engine; add --engine vllm"),
    ({"vllm_args": {"gpu_memory_utilization": 0.9}}, r"--vllm-args: settings of vLLM's engine"),
    ({"engine": "vllm", "tensor_parallel_size": 0}, r"--tensor-parallel-size must be an integer >= 1, got 0"),
    ({"engine": "vllm", "vllm_args": {"model": "x", "enable_prefix_caching": True}},
     r"--vllm-args sets enable_prefix_caching \(set by hsx \(a cached prefix is not captured again.*model \(set by "
     r"--model\); drop them"),
    ({"engine": "vllm", "vllm_args": "[1, 2]"}, r"--vllm-args must be a JSON object, got list"),
    ({"engine": "vllm", "pipeline_parallel_size": 2},
     r"--pipeline-parallel-size 2: hsx's plug-in does not run pipeline stages yet .* use --tensor-parallel-size"),
    ({"engine": "vllm", "vllm_args": "{not json"}, r"--vllm-args is not valid JSON"),
    ({"engine": "vllm", "target": "top_k:8"}, r"--target top_k:8 needs the final norm and lm_head .* --engine hsx"),
])
def test_settings_that_do_not_fit_the_engine_are_refused_naming_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        job(**flags)


def test_vllm_settings_carry_the_parallel_sizes_and_the_further_arguments():
    settings = job(engine="vllm", tensor_parallel_size=4, enable_expert_parallel=True,
                   vllm_args='{"gpu_memory_utilization": 0.8, "max_num_seqs": 64}').engine_settings()
    assert settings == VllmSettings(4, 1, True, {"gpu_memory_utilization": 0.8, "max_num_seqs": 64})
    assert settings.devices == 4
    assert job().engine_settings() is None


def test_a_cpu_gang_binds_each_rank_to_its_share_of_the_cores():
    from vllm_engine.engine import thread_binding

    assert thread_binding({1, 0}, 2) == "0|1"
    assert thread_binding(range(8), 2) == "0-3|4-7"
    assert thread_binding([0, 2, 4, 6, 7], 2) == "0,2|4,6"
    with pytest.raises(ValueError, match=r"2 vLLM ranks on CPU need a core each; this worker may run on 1 \(\[3\]\): "
                                         "lower --tensor-parallel-size"):
        thread_binding([3], 2)


def test_outcomes_are_taken_once_and_bounded(monkeypatch):
    monkeypatch.setattr(outcomes, "OUTCOMES_KEPT", 3)
    monkeypatch.setattr(outcomes, "_outcomes", type(outcomes._outcomes)())
    outcomes.record(None, "invalid", "an untagged request is not kept")
    for i in range(5):
        outcomes.record(f"t{i}", None if i % 2 else "bad_states", f"e{i}")
    assert outcomes.take(["t0", "t1", "t2", "t3", "t4"]) == {"t2": ("bad_states", "e2"), "t3": (None, "e3"),
                                                              "t4": ("bad_states", "e4")}
    assert outcomes.take(["t3"]) == {}  # forgotten once read
    assert outcomes.HsxWorkerExtension().hsx_outcomes(["t9"]) == {}


def test_hsx_run_with_engine_vllm_where_vllm_is_missing_says_how_to_install_it(tiny_llama, tmp_path):
    pytest.importorskip("ray")
    if __import__("importlib").util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the message is for machines without it")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "prompt": "x y z"}\n')
    proc = subprocess.run([sys.executable, "-m", "cli", "run", "--model", tiny_llama, "--corpus", str(corpus),
                           "--output", str(tmp_path / "out"), "--engine", "vllm"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--engine vllm: {INSTALL_HINT}" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "run.json").exists()  # refused before anything was written


def test_online_training_with_engine_vllm_where_vllm_is_missing_is_one_line_before_ray(tiny_llama, tmp_path):
    """`train-drafter --online --extract '{"engine": "vllm"}'` without vLLM was 97 lines of tracebacks from a Ray
    worker, exit 1: the live stream's plan checks the engine as `hsx run`'s does."""
    if __import__("importlib").util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the message is for machines without it")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "prompt": "x y z"}\n')
    proc = subprocess.run([sys.executable, "-m", "cli", "train-drafter", "--online", "--kind", "eagle3", "--model",
                           tiny_llama, "--corpus", str(corpus), "--out", str(tmp_path / "head"), "--steps", "2",
                           "--extract", '{"engine": "vllm"}'], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--engine vllm: {INSTALL_HINT}" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_eval_drafter_engine_is_checked_and_vllm_missing_says_how_to_install_it(tmp_path):
    from training.evaluate import EvalDrafterConfig, run_eval

    with pytest.raises(ValueError, match=r"--engine 'sglang' is not an engine; use hsx \(the default\) or vllm"):
        EvalDrafterConfig(engine="sglang")
    if __import__("importlib").util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the message is for machines without it")
    with pytest.raises(ValueError, match=r"--engine vllm: vLLM is not installed here: .*infra/vllm_cpu_venv.sh"):
        run_eval(EvalDrafterConfig(model=str(tmp_path), engine="vllm"))


def test_an_in_process_engine_core_is_refused_before_vllm_starts(monkeypatch, tiny_llama):
    """VLLM_ENABLE_V1_MULTIPROCESSING=0 puts vLLM's engine core in this process, where it steps only inside
    generate(): the last files would never be written and reported (VllmEngine waited 600 s, then failed them)."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from connectors.safetensors_connector import HiddenStatesConnectorConfig
    from extractor.config import EngineConfig
    from vllm_engine.engine import VllmEngine

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(ValueError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0 runs vLLM's engine core inside this process"):
        VllmEngine(EngineConfig(model=tiny_llama), HiddenStatesConnectorConfig(shared_storage_path="/tmp/x"))
