"""Speculative decoding: lossless against plain greedy decoding and transformers, vLLM's acceptance counters,
rejection sampling keeps the target's distribution, and bad configurations are clear errors."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from extractor import LLM, SamplingParams
from extractor.config import EngineConfig, SpeculativeConfig
from extractor.metrics import Counter, Vector
from extractor.proposers import Draft, NgramProposer, Proposer
from extractor.verification import verify

N_PROMPTS = 16


def _prompts(tokenizer) -> list[list[int]]:
    from reference.tiny_models import sample_text

    texts = sample_text(N_PROMPTS - 2, seed=7, min_words=1, max_words=30)
    texts += ["one two three four five one two three four five one two three", "A"]  # lookups hit; one token
    return [tokenizer(t).input_ids for t in texts]


def hf_greedy(model, ids, max_new_tokens, eos_ids):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos_ids),
                             pad_token_id=3)
    return out[0, len(ids):].tolist()


def metric(llm, name):
    (m,) = [m for m in llm.get_metrics() if m.name == name]
    return m.values if isinstance(m, Vector) else m.value


@pytest.fixture(scope="module")
def models(tiny_model_factory, tmp_path_factory):
    """target (a tiny Llama whose EOS is a token its greedy outputs hit mid-way), a 2-layer draft cut from it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tiny_model_factory("llama")
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    prompts = _prompts(tokenizer)
    free = [hf_greedy(model, p, 24, [-1]) for p in prompts]  # [-1]: no EOS at all
    counts = torch.bincount(torch.tensor([t for g in free for t in g[3:20]]), minlength=model.config.vocab_size)
    eos = int(counts.argmax())
    root = tmp_path_factory.mktemp("spec-models")
    target = str(root / "target")
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    draft = str(root / "draft-2-layers")
    small = AutoModelForCausalLM.from_pretrained(base)
    small.model.layers = small.model.layers[:2]
    small.config.num_hidden_layers = 2
    small.save_pretrained(draft)
    return {"target": target, "draft": draft, "model": model, "tokenizer": tokenizer, "prompts": prompts,
            "free": free, "eos": eos}


def _params(models) -> list[SamplingParams]:
    """Mixed endings per prompt: max_tokens, EOS, a stop token a few tokens in, a stop token with EOS ignored."""
    out = []
    for i, free in enumerate(models["free"]):
        n = 16 + i % 7
        kind = i % 4
        if kind == 0:
            out.append(SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        elif kind == 1:
            out.append(SamplingParams(max_tokens=n, temperature=0))
        else:
            out.append(SamplingParams(max_tokens=n, temperature=0, stop_token_ids=[free[2 + i % 5]],
                                      ignore_eos=kind == 3))
    return out


@pytest.fixture(scope="module")
def oracle(models, tiny_model_factory, tmp_path_factory):
    """Plain hsx greedy outputs (no speculation) and transformers generate(do_sample=False), per prompt."""
    from connectors import KVTransferConfig

    params = _params(models)
    plain = LLM(model=models["target"], kv_transfer_config=KVTransferConfig(
        kv_connector_extra_config={"shared_storage_path": str(tmp_path_factory.mktemp("plain-hs"))}))
    outs = plain.generate([{"prompt_token_ids": p} for p in models["prompts"]], params)
    plain.shutdown()
    hf = []
    for ids, p in zip(models["prompts"], params):
        eos = [] if p.ignore_eos else [models["eos"], 0]  # 0: the tokenizer's EOS, which hsx also stops on
        hf.append(hf_greedy(models["model"], ids, p.max_tokens, eos + p.stop_token_ids or [-1]))
    return params, outs, hf


def _spec_llm(models, method, k):
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
    else:
        draft = models["draft"] if method == "draft_model" else models["target"]  # identical: every draft accepted
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    return LLM(model=models["target"], speculative_config=spec)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "identical_draft"])
def test_greedy_speculation_equals_plain_decoding_and_transformers_token_for_token(models, oracle, method, k):
    params, plain, hf = oracle
    assert any(o.outputs[0].finish_reason == "stop" for o in plain) and any(
        o.outputs[0].finish_reason == "length" for o in plain), "the batch should end both ways"
    llm = _spec_llm(models, method, k)
    outs = llm.generate([{"prompt_token_ids": p} for p in models["prompts"]], params)
    for out, ref, want in zip(outs, plain, hf):
        assert out.error is None
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids == want
        assert out.outputs[0].finish_reason == ref.outputs[0].finish_reason
        assert out.outputs[0].text == ref.outputs[0].text
    drafts, drafted = metric(llm, "vllm:spec_decode_num_drafts"), metric(llm, "vllm:spec_decode_num_draft_tokens")
    accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens")
    assert drafts > 0
    if method == "identical_draft":
        assert accepted == drafted  # so the stop tokens a few tokens in fell inside accepted drafts
    if method == "draft_model" and k > 1:
        assert 0 < accepted < drafted  # rows of one batch accepted different numbers: per-row rollback ran
    assert metric(llm, "vllm:generation_tokens") == sum(len(o.outputs[0].token_ids) for o in outs)


def test_a_draft_model_prefills_a_prompt_over_the_token_budget_in_chunks_and_stays_lossless(models):
    # the draft's prefill honours max_num_batched_tokens as the target's does: no forward of the draft over more
    # than 16 tokens (a forward hook on the draft records the widths), and greedy output stays transformers' own
    budget = 16
    long = [t for p in models["prompts"] for t in p][:53]  # 53 prompt tokens: four chunks of the budget
    prompts = [long, models["prompts"][0], models["prompts"][1]]
    llm = LLM(model=models["target"], max_num_batched_tokens=budget,
              speculative_config={"method": "draft_model", "model": models["draft"], "num_speculative_tokens": 3})
    widths = []
    llm.proposer.model.register_forward_pre_hook(lambda _, args, kw: widths.append(kw["input_ids"].shape),
                                                with_kwargs=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for out, p in zip(outs, prompts):
        assert out.error is None and out.outputs[0].token_ids == hf_greedy(models["model"], p, 12, [-1])
    assert max(rows * cols for rows, cols in widths) <= budget
    assert sum(1 for rows, cols in widths if rows == 1 and cols == budget) >= 3  # the long prompt went in chunks


class _AlwaysWrong(Proposer):
    """Drafts k copies of a token the target will not choose (its argmax + 1), from a plain transformers forward."""

    def __init__(self, model):
        self.model = model

    def propose(self, contexts, ks, params, generators):
        drafts = []
        for ctx, k in zip(contexts, ks):
            with torch.no_grad():
                best = int(self.model(torch.tensor([ctx])).logits[0, -1].argmax())
            drafts.append(Draft([(best + 1) % self.model.config.vocab_size] * k))
        return drafts


def test_an_identical_draft_model_accepts_every_token_and_a_wrong_proposer_none(models):
    k, steps, prompts = 3, 5, models["prompts"][:4]
    sp = SamplingParams(max_tokens=1 + steps * (k + 1), temperature=0, ignore_eos=True)  # 1 from the prefill
    same = LLM(model=models["target"], speculative_config={"method": "draft_model", "model": models["target"],
                                                           "num_speculative_tokens": k})
    same.generate([{"prompt_token_ids": p} for p in prompts], sp)
    assert metric(same, "vllm:spec_decode_num_drafts") == steps * len(prompts)
    assert metric(same, "vllm:spec_decode_num_draft_tokens") == steps * len(prompts) * k
    assert metric(same, "vllm:spec_decode_num_accepted_tokens") == steps * len(prompts) * k
    assert metric(same, "vllm:spec_decode_num_accepted_tokens_per_pos") == [steps * len(prompts)] * k
    assert 1 + metric(same, "vllm:spec_decode_num_accepted_tokens") / metric(same, "vllm:spec_decode_num_drafts") \
        == k + 1

    m = 8
    config = EngineConfig(model=models["target"], speculative=SpeculativeConfig("ngram", k))
    wrong = LLM.from_config(config, proposer=_AlwaysWrong(models["model"]))
    outs = wrong.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
    # after the prefill's token, one token per step; a step drafts min(k, room - 1) tokens, none when room is 1
    per_request = [min(k, room - 1) for room in range(m - 1, 0, -1) if room > 1]
    assert metric(wrong, "vllm:spec_decode_num_drafts") == len(per_request) * len(prompts)
    assert metric(wrong, "vllm:spec_decode_num_draft_tokens") == sum(per_request) * len(prompts)
    assert metric(wrong, "vllm:spec_decode_num_accepted_tokens") == 0
    assert metric(wrong, "vllm:spec_decode_num_accepted_tokens_per_pos") == [0] * k
    for out, p in zip(outs, prompts):  # and still lossless
        assert out.outputs[0].token_ids == hf_greedy(models["model"], p, m, [-1])


def test_metrics_have_vllm_reader_shapes(models):
    llm = _spec_llm(models, "ngram", 2)
    names = {m.name: m for m in llm.get_metrics()}
    assert isinstance(names["vllm:spec_decode_num_drafts"], Counter)
    assert isinstance(names["vllm:spec_decode_num_accepted_tokens_per_pos"], Vector)
    assert names["vllm:spec_decode_num_accepted_tokens_per_pos"].values == [0, 0]
    assert {"vllm:prompt_tokens", "vllm:generation_tokens", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens"} <= set(names)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_each_requests_own_counts_sum_to_the_engines_metrics(models, method, tmp_path):
    """RequestOutput.spec_decode is each request's share of get_metrics(): over two generate() calls of requests
    that end differently (EOS, stop tokens, max_tokens) plus one refused request, the shares sum to the engine's
    counters; a plain engine's outputs carry none."""
    llm = _spec_llm(models, method, 3)
    prompts = [{"prompt_token_ids": p} for p in models["prompts"]]
    params = _params(models)
    outs = llm.generate(prompts, params) + llm.generate([*prompts[:5], {"prompt_token_ids": []}],
                                                        [*params[:5], params[0]])
    assert outs[-1].error and outs[-1].spec_decode.num_drafts == 0  # the empty prompt never ran
    # vLLM's counters (hsx's drafter time and steps are the engine's, per batch step, not any request's)
    engine = {m.name: m.values if isinstance(m, Vector) else m.value for m in llm.get_metrics()
              if m.name.startswith("vllm:")}
    summed: dict = {}
    for out in outs:
        for m in (m for m in out.spec_decode.metrics() if m.name.startswith("vllm:")):
            if isinstance(m, Vector):
                summed[m.name] = [a + b for a, b in zip(summed.get(m.name, [0] * len(m.values)), m.values)]
            else:
                summed[m.name] = summed.get(m.name, 0) + m.value
    assert engine["vllm:spec_decode_num_drafts"] > 0  # something to add up (ngram drafts rarely here)
    assert method == "ngram" or engine["vllm:spec_decode_num_accepted_tokens"] > 0
    assert summed == engine
    for out in outs[:-1]:  # a request's accepted drafts and its drafted steps fit in the tokens it generated
        c = out.spec_decode
        assert c.generation_tokens == len(out.outputs[0].token_ids)
        assert 1 + c.num_accepted_tokens + c.num_drafts <= c.generation_tokens + 1
    from connectors import KVTransferConfig

    extraction = LLM(model=models["target"], kv_transfer_config=KVTransferConfig(
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)}))
    assert extraction.generate(prompts[:1], params[0])[0].spec_decode is None
    extraction.shutdown()


def test_an_identical_drafts_per_request_counts_are_its_steps(models):
    """An independent oracle per request: with the target as its own draft every token is accepted, so a request of
    max_tokens = 1 + s (k + 1) drafts exactly s times, k tokens each, all accepted."""
    k, prompts = 3, models["prompts"][:4]
    same = LLM(model=models["target"], speculative_config={"method": "draft_model", "model": models["target"],
                                                           "num_speculative_tokens": k})
    steps = [1, 2, 3, 4]
    outs = same.generate([{"prompt_token_ids": p} for p in prompts],
                         [SamplingParams(max_tokens=1 + s * (k + 1), temperature=0, ignore_eos=True) for s in steps])
    for out, s in zip(outs, steps):
        c = out.spec_decode
        assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.accepted_per_pos) == (s, s * k, s * k,
                                                                                               [s] * k)


def test_ngram_proposes_what_followed_the_longest_earlier_match():
    ngram = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=3)
    ctx = [1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 1, 2, 3]
    # suffix 3-gram [1, 2, 3] occurs at 0 -> [9, 9]; a 2-gram [2, 3] would have matched later (-> [7, 8])
    assert ngram.propose([ctx], [2], [SamplingParams()], [None])[0].token_ids == [9, 9]
    assert ngram.propose([[4, 5, 6, 4, 5]], [3], [SamplingParams()], [None])[0].token_ids == [6, 4, 5]
    assert ngram.propose([[1, 2, 3, 4]], [3], [SamplingParams()], [None])[0].token_ids == []  # no match
    assert ngram.propose([ctx], [0], [SamplingParams()], [None])[0].token_ids == []


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=p.numel()).float() / samples.numel()
    return 0.5 * float((freq - p).abs().sum())


def test_ngram_lookup_bounds_default_as_vllms_do():
    """vLLM's SpeculativeConfig: neither bound given -> both 5; one given -> the other equals it."""
    from extractor.config import SpeculativeConfig

    def bounds(**kw):
        c = SpeculativeConfig("ngram", 3, **kw)
        return c.prompt_lookup_min, c.prompt_lookup_max

    assert bounds() == (5, 5)
    assert bounds(prompt_lookup_max=3) == (3, 3)
    assert bounds(prompt_lookup_min=4) == (4, 4)
    assert bounds(prompt_lookup_min=2, prompt_lookup_max=5) == (2, 5)
    # and the engine's proposer looks up exactly those: the 3-gram repeat drafts only when 3 is within the bounds
    from extractor.proposers import make_proposer

    ctx = [[7, 8, 9, 4, 7, 8, 9]]
    drafted = {}
    for kw in ({}, {"prompt_lookup_min": 3}):
        proposer = make_proposer(SpeculativeConfig("ngram", 2, **kw), None)
        drafted[bool(kw)] = list(proposer.propose(ctx, [2], [SamplingParams()], [None])[0].token_ids)
    assert drafted == {False: [], True: [4, 7]}


def test_rejection_sampling_keeps_the_target_distribution_and_skipping_the_residual_does_not():
    trials = 20000
    gen = torch.Generator().manual_seed(0)
    target_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    q = torch.tensor([0.05, 0.05, 0.4, 0.3, 0.1, 0.1])  # a draft far from the target
    params = SamplingParams(temperature=1.0)
    p = target_logits.softmax(-1)
    logits = torch.stack([target_logits, target_logits])  # [n + 1, V] for one draft token
    first, broken = [], []
    for _ in range(trials):
        x = int(torch.multinomial(q, 1, generator=gen))
        tokens, a = verify(logits, Draft([x], q[None]), params, gen)
        first.append(tokens[0])
        # the same step without the residual: on rejection resample from p itself (a common mistake)
        u = float(torch.rand((), generator=gen))
        broken.append(x if u < min(1.0, float(p[x] / q[x])) else int(torch.multinomial(p, 1, generator=gen)))
    bound = 0.02  # sampling noise at 20000 draws is ~0.01
    assert _tv(torch.tensor(first), p) < bound
    assert _tv(torch.tensor(broken), p) > bound
    # a deterministic proposer (q one-hot) too
    one_hot = [verify(logits, Draft([2]), params, gen)[0][0] for _ in range(trials)]
    assert _tv(torch.tensor(one_hot), p) < bound


def _other_vocab_model(like: str, out: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(like)
    config.vocab_size, config.num_hidden_layers = 600, 1
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def _swapped_tokenizer_draft(models, out: str) -> str:
    """The 2-layer draft with a tokenizer of the same size whose two tokens trade ids."""
    import json
    import shutil

    shutil.copytree(models["draft"], out)
    models["tokenizer"].save_pretrained(out)
    with open(os.path.join(out, "tokenizer.json")) as f:
        data = json.load(f)
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(data, f)
    return out


def test_bad_speculative_configs_are_clear_errors(models, tmp_path):
    target = models["target"]
    with pytest.raises(ValueError, match="method 'medusa' needs 'model'"):
        LLM(model=target, speculative_config={"method": "medusa", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="'lookahead' is not supported.*ngram, draft_model, dflash, dspark, eagle, eagle3"):
        LLM(model=target, speculative_config={"method": "lookahead", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer >= 1, got 0"):
        LLM(model=target, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    start = time.monotonic()
    with pytest.raises(ValueError, match="num_speculative_tokens=1000000000 is more than the 128 tokens"):
        LLM(model=target, speculative_config={"method": "ngram", "num_speculative_tokens": 10**9})
    assert time.monotonic() - start < 5  # refused before anything is built (it took 32 s and 8 GB)
    with pytest.raises(ValueError, match="needs num_speculative_tokens"):
        LLM(model=target, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match=r"unknown speculative_config keys \['lookahead'\].*valid"):
        LLM(model=target, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1})
    with pytest.raises(ValueError, match="prompt_lookup_min=4, prompt_lookup_max=2"):
        LLM(model=target, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                              "prompt_lookup_min": 4, "prompt_lookup_max": 2})
    missing = str(tmp_path / "no-such-draft")
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=target, speculative_config={"method": "draft_model", "model": missing, "num_speculative_tokens": 2})
    other_vocab = _other_vocab_model(target, str(tmp_path / "other-vocab"))
    with pytest.raises(ValueError, match="vocabulary of 600 tokens.*has 512"):
        LLM(model=target, speculative_config={"method": "draft_model", "model": other_vocab,
                                              "num_speculative_tokens": 2})
    swapped = _swapped_tokenizer_draft(models, str(tmp_path / "swapped-tokens"))
    with pytest.raises(ValueError, match="tokenizer whose vocabulary differs"):
        LLM(model=target, speculative_config={"method": "draft_model", "model": swapped, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="parallel_drafting=True is not supported"):
        LLM(model=target, speculative_config={"method": "draft_model", "model": models["draft"],
                                              "num_speculative_tokens": 2, "parallel_drafting": True})
    with pytest.raises(TypeError, match="tensor_parallel_size=2 .only tensor_parallel_size=1"):
        LLM(model=target, tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_extraction_and_speculation_in_one_engine_are_refused(models, kv_config):
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="separate engines"):
        LLM(model=models["target"], speculative_config=ngram, kv_transfer_config=kv_config())
    with pytest.raises(ValueError, match="separate engines"):
        EngineConfig(model=models["target"], layer_ids=(1, 2), speculative=SpeculativeConfig("ngram", 2))
    llm = LLM(model=models["target"], speculative_config=ngram)
    (out,) = llm.generate([{"prompt_token_ids": models["prompts"][0]}], SamplingParams(
        max_tokens=4, extra_args={"kv_transfer_params": {"include_output_tokens": True}}))
    assert "writes no hidden states" in out.error


def test_vllm_arguments_hsx_cannot_use_are_accepted_with_one_warning(models, caplog):
    spec = {"method": "draft_model", "model": models["draft"], "num_speculative_tokens": 2, "enforce_eager": True,
            "max_model_len": 64, "parallel_drafting": False, "disable_padded_drafter_batch": True}
    with caplog.at_level(logging.WARNING):
        llm = LLM(model=models["target"], speculative_config=spec, tensor_parallel_size=1, enforce_eager=True,
                  enable_chunked_prefill=True, gpu_memory_utilization=0.8, disable_log_stats=False,
                  max_num_seqs=None, trust_remote_code=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("speculative_config keys" in w for w in warnings) == 1
    assert sum("LLM() arguments" in w and "gpu_memory_utilization" in w for w in warnings) == 1
    (out,) = llm.generate([{"prompt_token_ids": models["prompts"][1]}], SamplingParams(max_tokens=3, temperature=0))
    assert out.error is None and len(out.outputs[0].token_ids) == 3
    assert os.path.isdir(models["draft"])


@pytest.mark.slow
def test_sampled_speculation_follows_the_target_distribution(models, tmp_path):
    # top_k=2 keeps the support tiny: (first, second) token pairs take 4 values; the exact law comes from plain
    # transformers forwards. The second token is the speculative one: a draft-model token accepted with
    # min(1, p/q) or a residual sample (test_rejection_sampling_... shows this bound fails without the residual).
    n, temp = 2000, 1.5
    prompt = models["prompts"][3]
    model = models["model"]

    def law(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1] / temp
        top = torch.topk(logits, 2)
        return dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))

    exact = {(a, b): pa * pb for a, pa in law(prompt).items() for b, pb in law(prompt + [a]).items()}
    from transformers import AutoModelForCausalLM

    near = AutoModelForCausalLM.from_pretrained(models["target"])  # a draft close to the target, not equal: q != p
    with torch.no_grad():
        near.lm_head.weight.add_(0.3 * torch.randn(near.lm_head.weight.shape, generator=torch.Generator().manual_seed(0))
                                 * near.lm_head.weight.std())
    near.save_pretrained(str(tmp_path / "near"))
    llm = LLM(model=models["target"], speculative_config={"method": "draft_model", "model": str(tmp_path / "near"),
                                                          "num_speculative_tokens": 2})
    params = [SamplingParams(max_tokens=3, temperature=temp, top_k=2, seed=i, ignore_eos=True) for i in range(n)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params)
    pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
    assert set(pairs) <= set(exact)
    freq = {pair: pairs.count(pair) / n for pair in exact}
    tv = 0.5 * sum(abs(freq[pair] - p) for pair, p in exact.items())
    assert tv < 0.05, (tv, freq, exact)
    assert metric(llm, "vllm:spec_decode_num_drafts") >= n  # every request verified at least one draft token
    accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens")
    assert 0 < accepted < metric(llm, "vllm:spec_decode_num_draft_tokens")  # both branches ran


def test_a_draft_model_with_a_windowed_cache_is_refused_in_one_line(tiny_llama, tiny_model_factory):
    """hsx masks rejected drafts out of a draft model's cache, which is right for full attention only: a windowed
    draft would keep drafting from a context it should have forgotten, so it is refused before anything runs."""
    from extractor import LLM

    draft = tiny_model_factory("gemma2")
    with pytest.raises(ValueError, match="draft model .*sliding-window or linear-attention layers") as e:
        LLM(model=tiny_llama, speculative_config={"method": "draft_model", "model": draft,
                                                  "num_speculative_tokens": 2})
    assert "\n" not in str(e.value)


def test_a_transformers_that_cannot_roll_back_linear_attention_is_named_with_the_version_needed(tiny_model_factory):
    """On transformers 5.19-5.24 (the vLLM tier's is 5.19) the refusal quoted a TypeError from the cache; it names
    the version that records per-step recurrent states. On newer ones the same check finds nothing missing."""
    import transformers
    from packaging.version import Version

    from extractor.rollback import ROLLBACK_TRANSFORMERS, _recording_missing

    if Version(transformers.__version__) >= Version(ROLLBACK_TRANSFORMERS):
        assert _recording_missing() is None
        return
    model_dir = tiny_model_factory("qwen3_next")
    with pytest.raises(ValueError) as e:
        LLM(model=model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    message = str(e.value)
    assert f"rolled back with transformers >= {ROLLBACK_TRANSFORMERS}" in message
    assert f"this is transformers {transformers.__version__}" in message and "TypeError" not in message


def test_throw_away_drafts_never_take_a_row_past_max_model_len(tiny_model_factory):
    """A windowed target pads every row of a step to the widest with throw-away drafts; a row near max_model_len
    took positions up to k past it (a dynamic-RoPE target would rescale every token of that forward). Rows are
    capped so that no position passes max_model_len - 1, and decoding stays equal to transformers' generate."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("gemma2")
    max_len = 40
    draft = tiny_model_factory("llama")  # drafts all k tokens every step, whatever the text
    llm = LLM(model=model_dir, dtype="float32", max_model_len=max_len,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 4})
    assert llm.runner.rollback is not None and llm.runner.rollback.even
    seen = []
    rotary = llm.runner.model.model.rotary_emb
    handle = rotary.register_forward_pre_hook(lambda m, args, kwargs: seen.append(int(args[1].max())),
                                              with_kwargs=True)
    prompts = [[5, 6, 7, 8] * 8, [9, 10, 11, 9, 10, 11, 9, 10]]  # 32 and 8 tokens: the first reaches 40
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    handle.remove()
    assert max(seen) <= max_len - 1, max(seen)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for p, out in zip(prompts, outs):
        n = min(24, max_len - len(p))
        want = reference.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        assert out.outputs[0].token_ids == want[0, len(p):].tolist()
    llm.shutdown()
