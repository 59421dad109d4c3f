"""`hsx serve --speculative-config`: a decoding service with vLLM's speculative methods (here a target's own MTP
layers), hit by the official openai client. Oracle: transformers' `generate` for the tokens (lossless), and the offline
engine's vLLM metrics for the same requests for the server's /metrics counters."""

from __future__ import annotations

import json

import pytest
import torch

from harness.serving import served
from reference.tiny_models import add_mtp_layers, build_tiny_model, randomise_norms

SPEC = {"method": "mtp", "num_speculative_tokens": 2}
_g = torch.Generator().manual_seed(11)
PROMPTS = tuple(torch.randint(5, 400, (n,), generator=_g).tolist() for n in (9, 21, 4))  # no near-tie in greedy
NEW_TOKENS = 14


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("mtp-serve")
    return add_mtp_layers(randomise_norms(build_tiny_model("deepseek_v3", str(root / "ds"), seed=4)), 1, seed=6)


@pytest.fixture(scope="module")
def mtp_server(mtp_target, tmp_path_factory):
    log = tmp_path_factory.mktemp("mtp-serve-log") / "serve.log"
    with served(mtp_target, None, str(log), layers=None, dtype="float32", replicas=1,
                speculative_config=json.dumps(SPEC)) as server:
        yield server


def _spec_counts(samples: dict[str, float], model: str) -> tuple:
    label = f'model_name="{model}"'
    totals = tuple(int(samples[f"vllm:spec_decode_{n}_total{{{label}}}"])
                   for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    per_pos = tuple(int(samples[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{i}"}}'])
                    for i in range(SPEC["num_speculative_tokens"]))
    return (*totals, per_pos)


@pytest.mark.ray
@pytest.mark.slow
def test_an_mtp_server_decodes_losslessly_and_counts_as_the_offline_engine(mtp_server, mtp_target):
    from transformers import AutoModelForCausalLM

    from extractor import LLM, SamplingParams

    client = mtp_server.client()
    assert "vllm:spec_decode_num_drafts_total" in mtp_server.get("/metrics").text  # declared before any request
    replies = []
    for ids in PROMPTS:  # one at a time: each request its own batch, as the offline engine below runs it
        r = client.completions.create(model=mtp_server.model, prompt=list(ids), max_tokens=NEW_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
        assert r.kv_transfer_params is None and r.choices[0].kv_transfer_params is None  # no file
        replies.append(list(r.choices[0].token_ids))

    model = AutoModelForCausalLM.from_pretrained(mtp_target, dtype=torch.float32).eval()
    for ids, got in zip(PROMPTS, replies):
        want = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
        assert got == want

    llm = LLM(mtp_target, speculative_config=SPEC, dtype="float32")
    try:
        for ids in PROMPTS:
            (out,) = llm.generate([{"prompt_token_ids": list(ids)}],
                                  SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
            assert list(out.outputs[0].token_ids) == replies[PROMPTS.index(ids)]
        metrics = {m.name: m for m in llm.get_metrics()}
    finally:
        llm.shutdown()
    want = (*(int(metrics[f"vllm:spec_decode_{n}"].value) for n in ("num_drafts", "num_draft_tokens",
                                                                    "num_accepted_tokens")),
            tuple(int(v) for v in metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values))
    assert want[0] > 0
    assert _spec_counts(mtp_server.metrics(), mtp_server.model) == want


@pytest.mark.ray
@pytest.mark.slow
def test_an_mtp_server_answers_text_prompts_and_refuses_kv_transfer_params(mtp_server):
    client = mtp_server.client()
    r = mtp_server.post("/v1/completions", {"model": mtp_server.model, "prompt": [1, 2, 3], "max_tokens": 2,
                                            "kv_transfer_params": {"include_output_tokens": True}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kv_transfer_params" and "--speculative-config method 'mtp'" in error["message"]
    models = client.models.list()
    assert [m.id for m in models.data] == [mtp_server.model]
    text = client.completions.create(model=mtp_server.model, prompt="the model reads", max_tokens=3, temperature=0)
    assert text.choices[0].finish_reason in ("length", "stop")


def test_spec_decode_counters_sum_the_replicas_running_counts_as_vllm_names_them():
    """What the ingress does with each replica's running counts (no Ray: the class alone): deltas summed over
    replicas, a report older than one already seen ignored, vLLM's names and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    from serve.engine import EngineReply
    from serve.metrics import ServeMetrics

    metrics = ServeMetrics(2, "tiny")
    for replica, counts in (("a", (3, 6, 4, (3, 1))), ("b", (2, 4, 1, (1, 0))), ("a", (5, 10, 7, (5, 2))),
                            ("a", (4, 8, 5, (4, 1))), ("b", (2, 4, 1, (1, 0)))):  # a stale report of a, b's again
        metrics.observe_reply(EngineReply("r", replica=replica, spec_decode=counts), answered=True)
    metrics.observe_reply(EngineReply("r", replica="a"), answered=True)  # a reply without counts
    samples = {s.name + str(sorted(s.labels.items())): s.value
               for f in text_string_to_metric_families(metrics.text().decode()) for s in f.samples}
    label = [("model_name", "tiny")]
    assert samples[f"vllm:spec_decode_num_drafts_total{label}"] == 7
    assert samples[f"vllm:spec_decode_num_draft_tokens_total{label}"] == 14
    assert samples[f"vllm:spec_decode_num_accepted_tokens_total{label}"] == 8
    assert [samples[f"vllm:spec_decode_num_accepted_tokens_per_pos_total{[*label, ('position', str(i))]}"]
            for i in range(2)] == [6, 2]
    assert not any(name.startswith("vllm:") for name in {f.name for f in text_string_to_metric_families(
        ServeMetrics().text().decode())})  # an extraction server has none
