"""Packed prefill (extractor.packing): prompt-only batches run end to end in one row, attention kept within each
prompt — stored states equal a plain transformers forward of each prompt alone; targets where packing would not be
exact are padded (auto) or refused (on); the batch plan fills the budget."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from connectors import load_hidden_states
from extractor import LLM, EngineConfig, SamplingParams
from extractor.batching import plan_batches, plan_packed
from extractor.packing import Packer
from harness.specs import spec_config
from reference.tiny_models import build_tiny_model
from tests.extractor.oracle import load_reference, reference_states

LAYERS = [0, 1, 4]


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


def _extract(model_dir: str, rows: list[list[int]], kv_config, out: str, **engine):
    """(the engine, each prompt's stored states, the `packed` flag of every prefill it ran)."""
    llm = LLM(model=model_dir, speculative_config=spec_config(LAYERS), dtype="float32",
              kv_transfer_config=kv_config(shared_storage_path=out), **engine)
    seen: list[bool] = []
    prefill = llm.runner.prefill

    def recording(*args, **kwargs):
        seen.append(kwargs.get("packed", False))
        return prefill(*args, **kwargs)

    llm.runner.prefill = recording
    outs = llm.generate([{"prompt_token_ids": r} for r in rows], SamplingParams(max_tokens=0))
    assert [o.error for o in outs] == [None] * len(rows)
    states = [load_hidden_states(o.kv_transfer_params["hidden_states_path"])["hidden_states"] for o in outs]
    return llm, states, seen


# windows (8 tokens, shorter than the prompts: the window is crossed inside the packed row), soft-capping and
# attention sinks (eager variants of the model's own module), multi-head latent attention, a plain decoder on eager
CASES = [("llama", {}), ("gemma2", {}), ("gpt_oss", {}), ("deepseek_v3", {}), ("llama", {"attn_implementation": "eager"})]


@pytest.mark.parametrize("family,engine", CASES, ids=[f"{f}-{e.get('attn_implementation', 'default')}" for f, e in CASES])
def test_packed_prompts_store_what_a_plain_forward_of_each_prompt_alone_gives(family, engine, tiny_model_factory,
                                                                           kv_config, tmp_path):
    model_dir = tiny_model_factory(family)
    ref = load_reference(model_dir)
    rows = _prompts(ref[0].config.vocab_size, [23, 5, 17, 1, 11, 40])  # 40: over the budget, alone and chunked
    llm, states, seen = _extract(model_dir, rows, kv_config, str(tmp_path / "out"), max_num_batched_tokens=32,
                                 **engine)
    assert llm.runner.packing_refusal is None and llm.runner.packer is not None
    assert True in seen and False in seen, seen  # packed batches, and the long prompt alone
    for ids, got in zip(rows, states):
        torch.testing.assert_close(got, reference_states(ref, ids, LAYERS), rtol=1e-4, atol=1e-4)


def test_packing_off_pads_and_stores_the_same_states(tiny_llama, kv_config, tmp_path):
    rows = _prompts(500, [9, 30, 4, 16])
    _, packed, seen_on = _extract(tiny_llama, rows, kv_config, str(tmp_path / "on"))
    llm, padded, seen_off = _extract(tiny_llama, rows, kv_config, str(tmp_path / "off"), packing="off")
    assert seen_on == [True] and seen_off == [False]
    assert llm.runner.packer is None and llm.runner.packing_refusal == "packing is off"
    for a, b in zip(packed, padded):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # the oracle tests' tolerance


def test_packed_top_k_target_and_fp8_files_equal_padded_ones(tiny_llama, kv_config, tmp_path):
    rows = _prompts(500, [12, 7, 25])

    def run(packing: str) -> list[dict]:
        llm = LLM(model=tiny_llama, speculative_config=spec_config([1, 4]), dtype="float32", target="top_k:8",
                  packing=packing, kv_transfer_config=kv_config(shared_storage_path=str(tmp_path / packing),
                                                                storage_dtype="fp8"))
        outs = llm.generate([{"prompt_token_ids": r} for r in rows], SamplingParams(max_tokens=0))
        return [load_hidden_states(o.kv_transfer_params["hidden_states_path"]) for o in outs]

    for on, off in zip(run("auto"), run("off")):
        assert on["token_ids"].tolist() == off["token_ids"].tolist()
        torch.testing.assert_close(on["hidden_states"], off["hidden_states"], rtol=0.07, atol=1e-3)  # fp8 steps
        assert torch.equal(on["target_topk_ids"], off["target_topk_ids"])
        torch.testing.assert_close(on["target_topk_logprobs"], off["target_topk_logprobs"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family,why", [("qwen3_next", "LinearAttentionLayer layers, which carry state along a row"),
                                        ("llama4_text", "chunked_attention layers")])
def test_targets_packing_would_change_are_padded_under_auto_and_refused_under_on(family, why, tiny_model_factory,
                                                                               kv_config, tmp_path):
    model_dir = tiny_model_factory(family)
    rows = _prompts(200, [14, 6, 9])
    llm, states, seen = _extract(model_dir, rows, kv_config, str(tmp_path / "out"))
    assert llm.runner.packer is None and why in llm.runner.packing_refusal
    assert seen == [False]
    if family == "qwen3_next":  # (the oracle's final-norm lookup does not know Llama-4's)
        ref = load_reference(model_dir)
        for ids, got in zip(rows, states):
            torch.testing.assert_close(got, reference_states(ref, ids, LAYERS), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=f"packing='on' but .* cannot pack prompts: .*{why}.*use packing='auto'"):
        LLM(model=model_dir, speculative_config=spec_config(LAYERS), packing="on")


@pytest.mark.parametrize("family", ["qwen3_next", "llama4_text"])
def test_packing_on_for_a_target_that_cannot_pack_is_refused_when_the_job_is_planned(family, tiny_model_factory,
                                                                                    tmp_path, capsys):
    """`hsx run --packing on` was refused only in the worker (exit 1 after 38 s, run.json left behind): the plan reads
    the refusal from the config, before Ray starts or anything is written."""
    from cli.main import main

    model_dir = tiny_model_factory(family)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "prompt": "x y z"}\n')
    with pytest.raises(SystemExit) as e:
        main(["run", "--model", model_dir, "--corpus", str(corpus), "--output", str(tmp_path / "out"), "--packing",
              "on"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--packing on but" in err and "cannot pack prompts" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_the_probe_catches_attention_leaking_across_prompts_and_unrestarted_positions(tiny_llama, tiny_model_factory):
    runner = LLM(model=tiny_llama, dtype="float32").runner

    class Leaking(Packer):  # the whole row as one prompt: later prompts attend to earlier ones
        @contextlib.contextmanager
        def active(self, starts, lengths):
            with super().active([0], [sum(lengths)]) as segments:
                yield segments

    class Counting(Packer):  # positions run on across prompts instead of restarting
        @staticmethod
        def inputs(rows, device):
            ids, positions, starts = Packer.inputs(rows, device)
            return ids, torch.arange(ids.shape[1], device=device)[None], starts

    args = (runner.pad, runner.device, runner.vocab_size, runner.dtype, None)
    assert Packer(runner.model, runner.base, "sdpa").probe(*args) is None
    leak = Leaking(runner.model, runner.base, "sdpa").probe(*args)
    assert leak is not None and "prompt 1 changed with the tokens of prompt 0" in leak
    # rotary positions are relative: per-prompt attention makes Llama's states independent of where positions start;
    # GPT-2's learned absolute positions are not
    assert Counting(runner.model, runner.base, "sdpa").probe(*args) is None
    gpt2 = LLM(model=tiny_model_factory("gpt2"), dtype="float32").runner
    assert gpt2.packer is not None
    args = (gpt2.pad, gpt2.device, gpt2.vocab_size, gpt2.dtype, None)
    assert Packer(gpt2.model, gpt2.base, "sdpa").probe(*args) is None
    assert "differ from the padded ones" in Counting(gpt2.model, gpt2.base, "sdpa").probe(*args)


def test_longrope_prompts_past_the_original_length_run_alone_so_short_ones_keep_their_short_factors(
        kv_config, tmp_path):
    """Longrope picks long or short factors from the forward's largest position: a 30-token prompt (past the original
    24) packed beside short ones would switch them to long factors; it runs alone, they pack, all equal the oracle."""
    model_dir = build_tiny_model("phi3", str(tmp_path / "phi3"), original_max_position_embeddings=24, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
        "long_factor": [3.0 + i for i in range(8)]})
    ref = load_reference(model_dir)
    rows = _prompts(500, [30, 9, 6, 7])
    llm, states, seen = _extract(model_dir, rows, kv_config, str(tmp_path / "out"), max_num_batched_tokens=256)
    assert llm.runner.packer.max_prompt_tokens == 24
    assert sorted(seen) == [False, True]  # the long prompt alone, the short ones packed
    for ids, got in zip(rows, states):
        torch.testing.assert_close(got, reference_states(ref, ids, LAYERS), rtol=1e-4, atol=1e-4)


def test_the_probe_passes_and_catches_leaks_in_bfloat16(tiny_model_factory):
    runner = LLM(model=tiny_model_factory("qwen3_moe"), dtype="bfloat16").runner
    assert runner.packer is not None, runner.packing_refusal

    class Leaking(Packer):
        @contextlib.contextmanager
        def active(self, starts, lengths):
            with super().active([0], [sum(lengths)]) as segments:
                yield segments

    leak = Leaking(runner.model, runner.base, "sdpa").probe(runner.pad, runner.device, runner.vocab_size,
                                                            runner.dtype, None)
    assert leak is not None and "changed with the tokens of prompt 0" in leak


def test_packing_setting_is_checked_by_name():
    with pytest.raises(ValueError, match="packing must be one of auto, on, off, got 'yes'"):
        EngineConfig(model="m", packing="yes")


def test_plan_packed_fills_the_budget_once_per_prompt_and_runs_long_prompts_alone():
    rng = random.Random(0)
    lengths = [rng.choice([1, 3, 17, 60, 200, 511, 512, 900]) for _ in range(300)]
    items = list(range(len(lengths)))
    batches = plan_packed(items, lambda i: lengths[i], max_num_batched_tokens=512, max_num_seqs=16)
    assert sorted(i for b in batches for i in b.items) == items
    for b in batches:
        total = sum(lengths[i] for i in b.items)
        if b.packed:
            assert len(b.items) > 1 and total <= 512 and len(b.items) <= 16 and b.chunk_size == total
            assert b.padded_tokens(lambda i: lengths[i]) == 0
        elif lengths[b.items[0]] >= 512:
            assert len(b.items) == 1 and b.chunk_size == 512
        else:
            assert len(b.items) == 1 and b.chunk_size == lengths[b.items[0]]
    padded = plan_batches(items, lambda i: lengths[i], max_num_batched_tokens=512, max_num_seqs=16)
    assert len(batches) < len(padded)  # padding's plan runs more forwards for the same prompts
    assert sum(b.padded_tokens(lambda i: lengths[i]) for b in padded) > 0
    small = plan_packed(items, lambda i: lengths[i], max_num_batched_tokens=512, max_num_seqs=16, forward_tokens=128)
    assert sorted(i for b in small for i in b.items) == items
    assert all(sum(lengths[i] for i in b.items) <= 128 for b in small if b.packed)
    assert all(b.chunk_size == min(lengths[b.items[0]], 512) for b in small if not b.packed)
    assert plan_packed([], len, 8, 2) == []
    (only,) = plan_packed([[1, 2]], len, 8, 2)
    assert not only.packed
