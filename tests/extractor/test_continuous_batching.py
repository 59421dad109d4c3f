"""Continuous batching: rows that finish are replaced by waiting requests whose prefill joins the running batch.

The cache operations it rests on (BatchState.merge, BatchState.compact) are checked against plain transformers
forwards; the engine's outputs with a small max_num_seqs against transformers generate, with and without
speculation, and with output-token states written."""

from __future__ import annotations

import pytest
import torch

from connectors import KVTransferConfig, load_hidden_states
from extractor import LLM, SamplingParams
from extractor.batch_state import BatchState
from extractor.config import EngineConfig
from extractor.proposers import NgramProposer
from extractor.runner import ModelRunner
from tests.extractor.oracle import load_reference, reference_states

PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 42], [7] * 11, [100, 3, 250, 61, 62, 63, 64, 8], [12], [99, 98, 97, 96],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [300, 301]]


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def next_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


@pytest.fixture(scope="module")
def runner(tiny_llama):
    r = ModelRunner(EngineConfig(model=tiny_llama, dtype="float32", device="cpu"))
    yield r
    r.close()


def _prefill(runner, rows):
    logits, state = runner.prefill(rows, 64, want_logits=True, keep_cache=True, on_chunk=lambda *a: None)
    return logits, state


def test_merged_groups_decode_as_each_row_alone(runner):
    model = runner.model
    a_rows, b_rows = PROMPTS[:3], PROMPTS[3:5]  # different widths: the narrower group is left-padded
    la, state = _prefill(runner, a_rows)
    # group a decodes two steps before group b joins, so the two caches differ in width and content
    seqs = [list(r) for r in a_rows]
    for _ in range(2):
        toks = la.argmax(-1).tolist()
        for s, t in zip(seqs, toks):
            s.append(t)
        la, _ = runner.decode(state, toks, capture=False)
    lb, other = _prefill(runner, b_rows)
    state.merge(other)
    seqs += [list(r) for r in b_rows]
    logits = torch.cat([la, lb])
    for _ in range(3):
        for s, lg in zip(seqs, logits):
            torch.testing.assert_close(lg, next_logits(model, s), rtol=1e-4, atol=1e-4)
        toks = logits.argmax(-1).tolist()
        for s, t in zip(seqs, toks):
            s.append(t)
        logits, _ = runner.decode(state, toks, capture=False)


def test_compacting_rolled_back_columns_changes_no_logit(runner):
    model = runner.model
    rows = [list(r) for r in PROMPTS[:4]]
    _, state = _prefill(runner, rows)
    # feed every row 4 tokens, keep a different number per row (holes in different columns), as verification does
    fed = [[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18]]
    runner.extend(state, [[r[-1]] + f for r, f in zip(rows, fed)])  # 5 tokens appended after each prompt
    keep = [0, 2, 4, 1]  # drafts kept per row: row b keeps 1 + keep[b] of the 5
    contexts = []
    for b, (r, f, k) in enumerate(zip(rows, fed, keep)):
        state.rollback(b, 5 - (1 + k))
        contexts.append(r + [r[-1]] + f[:k])
    state.select([0, 1, 3])  # a row finished: its columns (the widest prompt's) are padding for the others
    contexts = [contexts[i] for i in (0, 1, 3)]
    width = state.width
    state.compact()
    assert state.width < width and state.width == max(len(c) for c in contexts)
    assert state.waste() == pytest.approx(1 - max(len(c) for c in contexts) / state.width)
    logits, _ = runner.decode(state, [50, 51, 52], capture=False)
    for ctx, t, lg in zip(contexts, [50, 51, 52], logits):
        torch.testing.assert_close(lg, next_logits(model, ctx + [t]), rtol=1e-4, atol=1e-4)


class _Recorder:
    """Counts what the engine did (the real methods run; this only records their arguments)."""

    def __init__(self, monkeypatch):
        self.decode_rows: list[int] = []
        self.merges = 0
        real_decode, real_merge = ModelRunner.decode, BatchState.merge

        def decode(runner, state, tokens, capture, **kwargs):
            self.decode_rows.append(len(tokens))
            return real_decode(runner, state, tokens, capture, **kwargs)

        def merge(state, other):
            self.merges += 1
            return real_merge(state, other)

        monkeypatch.setattr(ModelRunner, "decode", decode)
        monkeypatch.setattr(BatchState, "merge", merge)


def test_waiting_requests_join_the_running_batch_and_outputs_stay_exact(tiny_llama, monkeypatch):
    model, _ = load_reference(tiny_llama)
    lengths = [3, 9, 2, 14, 5, 7, 1, 11]  # rows finish at different steps; their slots go to waiting requests
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    llm = LLM(model=tiny_llama, dtype="float32", max_num_seqs=3)
    seen = _Recorder(monkeypatch)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for out, p, n in zip(outs, PROMPTS, lengths):
        assert out.error is None
        assert out.outputs[0].token_ids == hf_greedy(model, p, n)
    assert seen.merges >= 4, "finished rows' slots were not refilled from the waiting requests"
    assert max(seen.decode_rows) == 3
    # while requests wait, every decode step runs full: total steps ~ total tokens / 3, not sum over waves
    assert sum(seen.decode_rows) == sum(n - 1 for n in lengths)  # every token but each first comes from a decode
    assert len(seen.decode_rows) <= sum(lengths) // 3 + max(lengths)
    llm.shutdown()


def test_a_long_prompt_does_not_pad_the_short_ones_admitted_with_it(tiny_llama, tmp_path, monkeypatch):
    """Generating requests (max_tokens=1, what speculators sends) arrive in random lengths, as an online server
    gathers them: the admitted prefill group is cut where padding to the longest costs more than another forward
    (batching.first_batch_rows), and every output and file still matches the oracle."""
    ref = load_reference(tiny_llama)
    layers = [1, 2, 4]
    prompts = [[(7 * i + j) % 500 + 1 for j in range(n)] for i, n in enumerate([20, 300, 22, 18, 21, 19, 20])]
    llm = LLM(model=tiny_llama, dtype="float32", max_num_seqs=8, speculative_config={
        "method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}},
        kv_transfer_config=KVTransferConfig(kv_connector_extra_config={"shared_storage_path": str(tmp_path)}))
    groups: list[list[int]] = []
    real_prefill = ModelRunner.prefill

    def prefill(runner, rows, *args, **kwargs):
        groups.append(sorted(len(r) for r in rows))
        return real_prefill(runner, rows, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "prefill", prefill)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, temperature=0))
    # one forward of 7 rows x 300 columns would pad 1680 tokens; apart: the long one alone, then the six short ones
    assert groups == [[300], [18, 19, 20, 20, 21, 22]]
    for out, p in zip(outs, prompts):
        assert out.error is None
        assert out.outputs[0].token_ids == hf_greedy(ref[0], p, 1)
        obj = load_hidden_states(out.kv_transfer_params["hidden_states_path"])
        assert obj["token_ids"].tolist() == p
        torch.testing.assert_close(obj["hidden_states"], reference_states(ref, p, layers), rtol=1e-4, atol=1e-4)
    llm.shutdown()


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "draft"])
def test_speculative_rows_join_a_running_batch_losslessly(tiny_llama, tmp_path, monkeypatch, spec):
    from transformers import AutoModelForCausalLM

    model, _ = load_reference(tiny_llama)
    if spec == "draft":
        small = AutoModelForCausalLM.from_pretrained(tiny_llama)
        small.model.layers = small.model.layers[:2]
        small.config.num_hidden_layers = 2
        small.save_pretrained(tmp_path / "draft")
        spec = {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3}
    lengths = [4, 12, 2, 15, 6, 9, 1, 13]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    llm = LLM(model=tiny_llama, dtype="float32", max_num_seqs=3, speculative_config=spec)
    seen = _Recorder(monkeypatch)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for out, p, n in zip(outs, PROMPTS, lengths):
        assert out.error is None
        assert out.outputs[0].token_ids == hf_greedy(model, p, n)
    assert seen.merges >= 3


@pytest.mark.parametrize("block", [None, 2])  # generated rows go to the connector in blocks (2: several per request)
def test_output_token_states_are_right_when_rows_join_mid_batch(block, tiny_llama, tmp_path, monkeypatch):
    if block is not None:
        monkeypatch.setattr("extractor.scheduler.OUTPUT_BLOCK_TOKENS", block)
    ref = load_reference(tiny_llama)
    layers = [1, 2, 4]
    llm = LLM(model=tiny_llama, dtype="float32", max_num_seqs=2, speculative_config={
        "method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}},
        kv_transfer_config=KVTransferConfig(kv_connector_extra_config={"shared_storage_path": str(tmp_path)}))
    lengths = [2, 6, 3, 5, 1]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                             extra_args={"kv_transfer_params": {"include_output_tokens": True}}) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:5]], params)
    for out in outs:
        assert out.error is None
        obj = load_hidden_states(out.kv_transfer_params["hidden_states_path"])
        ids = out.prompt_token_ids + out.outputs[0].token_ids[:-1]
        assert obj["token_ids"].tolist() == ids
        torch.testing.assert_close(obj["hidden_states"], reference_states(ref, ids, layers), rtol=1e-4, atol=1e-4)
    llm.shutdown()


class _StateChecker(NgramProposer):
    """ngram drafts, plus the observe contract checked at every propose: the states handed over so far are, row by
    row, the oracle's states of exactly contexts[b][:-1] (rows joining, finishing and rolling back included)."""

    capture_layer_ids = (1, 4)

    def __init__(self, ref):
        super().__init__(1, 3)
        self.ref, self.rows, self.checked = ref, [], 0

    def start(self, contexts):
        self.rows = [[] for _ in contexts]

    def join(self, contexts):
        self.rows += [[] for _ in contexts]

    def observe(self, states):
        assert len(states) == len(self.rows)
        for row, s in zip(self.rows, states):
            assert s.shape[1:] == (2, 64)
            row.append(s)

    def select(self, keep):
        self.rows = [self.rows[i] for i in keep]

    def propose(self, contexts, ks, params, generators):
        assert len(contexts) == len(self.rows)
        for ctx, row in zip(contexts, self.rows):
            got = torch.cat(row).float().cpu()
            torch.testing.assert_close(got, reference_states(self.ref, ctx[:-1], [1, 4]), rtol=1e-4, atol=1e-4)
            self.checked += 1
        return super().propose(contexts, ks, params, generators)


def test_a_proposer_observes_the_target_states_of_every_verified_token(tiny_llama):
    from extractor.config import SpeculativeConfig

    ref = load_reference(tiny_llama)
    checker = _StateChecker(ref)
    config = EngineConfig(model=tiny_llama, dtype="float32", max_num_seqs=3,
                          speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    llm = LLM.from_config(config, proposer=checker)
    lengths = [4, 10, 2, 12, 6, 9, 1, 8]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths])
    for out, p, n in zip(outs, PROMPTS, lengths):
        assert out.error is None and out.outputs[0].token_ids == hf_greedy(ref[0], p, n)
    assert checker.checked >= 20
    assert 0 < next(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens")
