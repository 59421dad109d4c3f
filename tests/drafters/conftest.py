"""The drafter tests use the whole suite's fixtures (tests/conftest.py: the tiny Llama, the oracle run) and these,
each built once per session: the target's head, the oracle run as a dataset, an engine runner, and one small head
per family trained on the oracle run (family_head), which the contract test (test_contract.py) and the families'
own tests share."""

from __future__ import annotations

import pytest
import torch

FAMILY_OPTIONS = {"eagle3": {"draft_vocab_size": 48}, "peagle": {"draft_vocab_size": 48, "ttt_steps": 4},
                  "dflash": {"block_size": 4}, "dspark": {"block_size": 4, "markov_rank": 16}, "eagle": {},
                  "medusa": {"medusa_num_layers": 2},
                  "mlp_speculator": {"inner_dim": 48}}
"""The options each family's session head is built with (k = 3 drafts for every family)."""


@pytest.fixture(scope="session")
def target_head(tiny_llama):
    """The tiny Llama's TargetHead (read from its folder)."""
    from drafters.base import TargetHead

    return TargetHead.from_model_dir(tiny_llama)


@pytest.fixture(scope="session")
def oracle_dataset(oracle_run):
    """The oracle run as a raw-layout HiddenStatesDataset."""
    from training import HiddenStatesDataset

    return HiddenStatesDataset(oracle_run[0])


@pytest.fixture(scope="session")
def engine_runner(tiny_llama):
    """hsx's engine runner over the tiny Llama (float32, CPU): what a proposer is built for."""
    from extractor.config import EngineConfig
    from extractor.runner import ModelRunner

    return ModelRunner(EngineConfig(model=tiny_llama, dtype="float32", device="cpu"))


@pytest.fixture(scope="session")
def family_head(oracle_dataset, target_head, tiny_llama, tmp_path_factory):
    """head(kind) -> (checkpoint folder, drafter, the last StepResult): family `kind` built for the oracle run from
    seed 0 with FAMILY_OPTIONS[kind] and k = 3, prepared, trained 2 AdamW steps on three packed samples and saved;
    each family's head is trained once per session."""
    from drafters.registry import drafter_class
    from tests.drafters.helpers import packed_batch, train_steps

    heads: dict[str, tuple] = {}

    def head(kind: str):
        if kind not in heads:
            torch.manual_seed(0)
            drafter = drafter_class(kind).for_run(oracle_dataset.run_info, target_head, 3,
                                                    **FAMILY_OPTIONS.get(kind, {}))
            drafter.prepare(oracle_dataset)
            _, result = train_steps(drafter, target_head, packed_batch(oracle_dataset, [0, 1, 2], max_tokens=256), 2)
            folder = str(tmp_path_factory.mktemp(f"{kind}-head"))
            drafter.eval().save_pretrained(folder, verifier=tiny_llama)
            heads[kind] = folder, drafter, result
        return heads[kind]

    return head
