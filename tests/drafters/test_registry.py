"""The drafter registry: the installed families come from the `hsx.drafters` entry points, and a family registered
from the test tree (tests/drafters/toy.py) works everywhere a family is named: `hsx train-drafter --kind`, `hsx
eval-drafter --drafter METHOD:DIR` and `LLM(speculative_config={"method": ...})`, decoding losslessly against
transformers' greedy generate."""

from __future__ import annotations

import json

import pytest
import torch

from cli.args import EXIT_OK
from cli.main import main
from drafters import registry


def test_the_installed_families_come_from_the_entry_points():
    from importlib.metadata import entry_points

    from extractor.methods import ENTRY_POINT_GROUP

    names = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert {"eagle3", "medusa", "mlp_speculator"} <= names  # pyproject.toml's entry points, as installed
    assert {"eagle3", "medusa", "mlp_speculator"} <= set(registry.families())
    assert registry.family("eagle3").options == ("draft_vocab_size", "ttt_steps")


@pytest.fixture
def toy():
    from tests.drafters.toy import FAMILY

    registry.register(FAMILY)
    yield FAMILY
    registry.unregister(FAMILY.name)
    assert "toy" not in registry.families()


def test_a_family_registered_from_the_tests_trains_evaluates_and_decodes(toy, oracle_run, oracle_model, tiny_llama,
                                                                          tmp_path, capsys):
    from extractor import LLM, SamplingParams
    from tests.drafters.toy import ToyDrafter

    out = tmp_path / "toy"
    assert main(["train-drafter", "--kind", "toy", "--run", oracle_run[0], "--model", tiny_llama, "--out", str(out),
                 "--steps", "3", "--batch-tokens", "64", "--num-speculative-tokens", "2", "--device", "cpu",
                 "--no-progress"]) == EXIT_OK
    assert json.loads((out / "report.json").read_text())["kind"] == "toy"
    assert isinstance(registry.drafter_class("toy").from_pretrained(str(out)), ToyDrafter)

    model, tokenizer = oracle_model
    prompts = [tokenizer(t)["input_ids"] for t in ("the quick brown fox", "a b c d e")]
    expected = []
    for p in prompts:
        with torch.no_grad():
            generated = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id)
        expected.append(generated[0, len(p):].tolist())
    llm = LLM(model=tiny_llama, dtype="float32", device="cpu",
              speculative_config={"method": "toy", "model": str(out), "num_speculative_tokens": 2})
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=8))
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert {m.name: m for m in llm.get_metrics()}["vllm:spec_decode_num_drafts"].value > 0

    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(json.dumps({"prompt": "the quick brown fox"}) + "\n")
    capsys.readouterr()
    assert main(["eval-drafter", "--model", tiny_llama, "--prompts", str(prompts_file), "--max-tokens", "4", "-k",
                 "2", "--threads", "1", "--no-ngram", "--drafter", f"toy:{out}"]) == EXIT_OK
    assert "toy (toy) k=2" in capsys.readouterr().out


def test_an_unknown_kind_names_the_registered_families(tiny_llama, tmp_path):
    import re

    from drafters.registry import families
    from training.train_config import TrainDrafterConfig

    assert {"eagle", "eagle3", "medusa", "mlp_speculator", "peagle", "dflash"} <= set(families())
    with pytest.raises(ValueError, match=re.escape(f"--kind 'nope' is not a drafter family; choose one of "
                                                   f"{sorted(families())}")):
        TrainDrafterConfig(run=str(tmp_path), model=tiny_llama, out=str(tmp_path / "o"), kind="nope")


def test_an_uninstalled_source_tree_finds_its_own_families(monkeypatch):
    """Run from PYTHONPATH (benchmarks/gpu_check.sh on a GPU machine) no entry points are installed: the tree's
    pyproject.toml declares them, and the registry reads them from there."""
    from extractor import methods, plugins

    monkeypatch.setattr(plugins, "entry_points", lambda group: [])
    monkeypatch.setattr(methods, "_loaded", False)
    monkeypatch.setattr(methods, "_families", {})
    assert {"eagle3", "medusa", "mlp_speculator"} <= set(methods.families())
    assert methods.family("medusa").proposer_class == "drafters.medusa_proposer:MedusaProposer"


def test_a_family_whose_drafter_declares_other_features_is_refused_naming_both():
    """The trainer's checks read Family.features, the Drafter its own: a plug-in declaring two answers is refused
    when its Drafter is loaded, not trained on layers one of them does not read."""
    import dataclasses

    from drafters.features import Features
    from tests.drafters.toy import FAMILY

    other = dataclasses.replace(FAMILY, name="toy_mismatch", features=Features(aux_layers=3, top_k=True))
    registry.register(other)
    try:
        with pytest.raises(ValueError, match="declares .* but its Drafter ToyDrafter declares"):
            registry.drafter_class("toy_mismatch")
        registry.register(dataclasses.replace(other, features=Features()))
        assert registry.drafter_class("toy_mismatch").__name__ == "ToyDrafter"
    finally:
        registry.unregister("toy_mismatch")
