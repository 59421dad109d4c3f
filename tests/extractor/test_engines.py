"""The engine registry (extractor/engines.py): hsx's two engines come from the `hsx.engines` entry points without
importing vLLM; a third kind, registered by the registry's own function or found through a test-local entry point,
is chosen by name, and a job's checks (its flags, the install hint, run.json's quantization, the worker's engine) go
through its description; an unknown `--engine` is one line listing the engines there are."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint

import pyarrow as pa
import pytest

from extractor import engines, plugins
from extractor.engines import EngineFlags, EngineKind, engine_kind
from jobs.config import JobConfig


@dataclass(frozen=True)
class ToySettings:
    copies: int


@dataclass
class ToyKind:
    """A third engine as the registry sees it: hsx's engine under another name, with settings of its own. The
    thing under test is the registry, so the engine it builds is hsx's (recorded, so a test sees it was built)."""

    name: str = "toy"
    checks_model: bool = True
    images: bool = False
    files_in_process: bool = True
    lock_files: bool = False
    installed: bool = True
    built: list = field(default_factory=list)

    def missing(self) -> str | None:
        return None if self.installed else "toy is not installed here: pip install hsx-toy"

    def settings(self, flags: EngineFlags) -> ToySettings:
        if flags.vllm_args:
            raise ValueError("--vllm-args: settings of vLLM's engine; toy takes --tensor-parallel-size alone")
        return ToySettings(copies=flags.tensor_parallel_size)

    def ranks(self, settings: ToySettings) -> int:
        return settings.copies

    def quantization(self, settings: ToySettings) -> str:
        return f"toy x{settings.copies}"

    def build(self, config, connector, settings: ToySettings):
        self.built.append(settings)
        return engine_kind("hsx").build(config, connector, None)

    def speculative_engine(self) -> type:
        return engine_kind("hsx").speculative_engine()


TOY = ToyKind()
"""The object a test-local entry point names (tests.extractor.test_engines:TOY)."""


@pytest.fixture
def toy():
    kind = ToyKind()
    engines.register(kind)
    yield kind
    engines.unregister(kind.name)


def job(**kw) -> JobConfig:
    return JobConfig(model="m", corpus=("c.jsonl",), output="o", **kw)


def test_hsx_and_vllm_come_from_the_entry_points_and_neither_loads_vllm():
    """In a fresh process: the names are read without loading anything, `hsx` loads no vllm_engine module, and
    `vllm`'s description imports neither vLLM nor torch."""
    code = ("import sys\nfrom extractor.engines import engine_kind, names\n"
            "assert names()[:2] == ['hsx', 'vllm'], names()\n"
            "assert engine_kind('hsx').name == 'hsx'\n"
            "assert not any(m.startswith('vllm') for m in sys.modules), sorted(sys.modules)\n"
            "assert engine_kind('vllm').name == 'vllm' and 'vllm_engine.kind' in sys.modules\n"
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, 'an engine was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_every_kind_has_the_protocols_members():
    for kind in engines.kinds().values():
        assert isinstance(kind, EngineKind), kind


def test_an_unknown_engine_is_one_line_listing_the_registered_engines(toy):
    with pytest.raises(ValueError, match=r"^--engine 'trt' is not an engine; use hsx \(the default\), toy or vllm$"):
        job(engine="trt")
    engines.unregister("toy")
    with pytest.raises(ValueError, match=r"^--engine 'toy' is not an engine; use hsx \(the default\) or vllm$"):
        job(engine="toy")


def test_hsx_run_with_an_unknown_engine_exits_2_with_one_line_listing_the_engines(tmp_path, capsys):
    from cli.args import EXIT_USAGE
    from cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["run", "--model", str(tmp_path / "m"), "--corpus", "c.jsonl", "--output", str(tmp_path / "out"),
              "--engine", "sglang"])
    assert e.value.code == EXIT_USAGE
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("--engine 'sglang' is not an engine; use hsx (the default) or vllm")
    assert not (tmp_path / "out").exists()


def test_a_registered_kind_is_chosen_by_name_and_checks_the_jobs_flags(toy):
    config = job(engine="toy", tensor_parallel_size=3)  # refused by hsx's engine, taken by toy's
    assert config.engine_kind() is toy
    assert config.engine_settings() == ToySettings(copies=3)
    with pytest.raises(ValueError, match=r"^--vllm-args: settings of vLLM's engine; toy takes"):
        job(engine="toy", vllm_args={"max_num_seqs": 4})
    with pytest.raises(ValueError, match=r"--tensor-parallel-size: settings of vLLM's engine; add --engine vllm"):
        job(tensor_parallel_size=3)  # hsx's own rule, unchanged


def test_the_install_hint_and_the_recorded_quantization_come_from_the_kind(toy):
    from jobs.runinfo import engine_quantization

    config = job(engine="toy", tensor_parallel_size=2)
    assert engine_quantization(config) == "toy x2"
    config.check_engine_installed()
    toy.installed = False
    with pytest.raises(ValueError, match=r"^--engine toy: toy is not installed here: pip install hsx-toy$"):
        config.check_engine_installed()


def test_a_kind_found_through_a_test_local_entry_point_is_loaded_when_named(monkeypatch):
    real = plugins.entry_points

    def with_toy(group):
        found = list(real(group=group))
        if group == engines.ENTRY_POINT_GROUP:
            found.append(EntryPoint("toy", "tests.extractor.test_engines:TOY", group))
        return found

    monkeypatch.setattr(plugins, "entry_points", with_toy)
    monkeypatch.setattr(engines, "_kinds", {})
    assert engines.names() == ["hsx", "toy", "vllm"]
    assert engine_kind("toy") is TOY
    assert job(engine="toy", tensor_parallel_size=2).engine_settings() == ToySettings(copies=2)


def test_an_entry_point_that_is_no_engine_kind_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(plugins, "entry_points", lambda group: [
        EntryPoint("bad", "tests.extractor.test_engines:ToySettings", group)])
    monkeypatch.setattr(engines, "_kinds", {})
    with pytest.raises(ValueError, match=r"entry point 'bad' \(tests.extractor.test_engines:ToySettings\) of "
                                         r"'hsx.engines' is no engine kind named 'bad'"):
        engine_kind("bad")


def test_a_worker_builds_the_engine_its_settings_name(toy, tiny_llama, tmp_path):
    from connectors.manifest import read_manifest
    from connectors.manifest_writer import ManifestWriter
    from connectors.run import RunDir
    from corpus.tokenization import SAMPLE_SCHEMA
    from harness.runs import prompt_only_worker

    out = RunDir(str(tmp_path / "run"))
    worker = prompt_only_worker(tiny_llama, out, engine_kind="toy", engine_settings=ToySettings(copies=1))
    samples = pa.Table.from_pylist([
        {"sample_id": "s0", "source": "c.jsonl:0", "prompt_token_ids": [5, 6, 7, 8], "loss_mask": [1] * 4,
         "num_prompt_tokens": 4, "truncated": False, "error": None}], schema=SAMPLE_SCHEMA)
    writer = ManifestWriter(out, "A")
    writer.add(worker(samples))
    writer.flush()
    worker.llm.shutdown()
    assert toy.built == [ToySettings(copies=1)]
    assert read_manifest(out)["status"].to_pylist() == ["ok"]
