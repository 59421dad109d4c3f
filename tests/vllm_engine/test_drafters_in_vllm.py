"""hsx-trained drafters loaded by real vLLM (issue 50 item 3): vLLM decodes with the head losslessly (greedy tokens
equal a plain transformers greedy generate). Needs vLLM (docs/engines.md); skipped without it."""

from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: these tests run in the venv docs/engines.md builds")

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    """A 4-layer Llama of head_dim 32 (vLLM's CPU attention has no kernel for 16) and its tokenizer."""
    return tiny_model_factory("llama", num_attention_heads=2, num_key_value_heads=2)


def _eagle3_head(model: str, layers: tuple[int, ...], out: str) -> str:
    """An EAGLE-3 head trained a few steps on a run of `model` holding `layers` (the aux layers and N), saved."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from connectors import HiddenStatesSpec
    from drafters.base import TargetHead
    from drafters.registry import drafter_class
    from jobs.tiny_models import sample_text
    from tests.drafters.helpers import packed_batch, train_steps
    from tests.training.runs import oracle_samples, write_run
    from training import HiddenStatesDataset

    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    spec = HiddenStatesSpec(layer_ids=layers, num_hidden_layers=ref.config.num_hidden_layers,
                            hidden_size=ref.config.hidden_size, dtype="float32", model=model)
    run = os.path.join(out, "run")
    write_run(run, oracle_samples(ref, sample_text(6, seed=7, min_words=4, max_words=30),
                                  AutoTokenizer.from_pretrained(model), layers), spec)
    ds = HiddenStatesDataset(run)
    head = TargetHead.from_model_dir(model)
    torch.manual_seed(0)
    drafter = drafter_class("eagle3").for_run(ds.run_info, head, 3)
    drafter.prepare(ds)
    train_steps(drafter, head, packed_batch(ds, [0, 1, 2], max_tokens=256), 3)
    folder = os.path.join(out, "head")
    drafter.eval().save_pretrained(folder, verifier=model)
    return folder


@pytest.mark.parametrize("layers", [(1, 2, 3, 4), (1, 2, 4)], ids=["three aux layers", "two aux layers"])
def test_vllm_decodes_with_an_hsx_eagle3_head_losslessly(target, layers, tmp_path):
    """A head of any aux-layer count loads in vLLM (a two-aux-layer head once failed its load: vLLM assumed three)
    and vLLM's greedy tokens with it equal transformers' greedy generate."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    head = _eagle3_head(target, layers, str(tmp_path))
    prompts = ["the quick brown fox jumps over", "def main(): return 1 and other words here", "import os"]
    llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=4,
              speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3})
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    finally:
        del llm
    ref = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target)
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert list(out.prompt_token_ids) == ids[0].tolist()
        want = ref.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, ids.shape[1]:].tolist()
        assert list(out.outputs[0].token_ids) == want, prompt
