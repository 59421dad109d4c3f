"""The official openai client against a live `hsx serve`: completions (token ids, text, a list), chat completions,
models, health. Each file is checked against a plain transformers forward (the oracle) and against the offline
LLM.generate of the same request."""

from __future__ import annotations

import os

import pytest
import torch

from connectors import load_hidden_states
from extractor import LLM, SamplingParams
from harness.serving import LAYERS
from harness.specs import spec_config
from tests.extractor.oracle import load_reference, reference_states, stop_string_cut

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def offline(serve_model, tmp_path_factory):
    """The offline engine on the same model and layers: what the server's files must equal."""
    out = tmp_path_factory.mktemp("offline")
    from connectors import KVTransferConfig

    llm = LLM(model=serve_model, speculative_config=spec_config(LAYERS),
              kv_transfer_config=KVTransferConfig(kv_connector_extra_config={"shared_storage_path": str(out)}))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def oracle(serve_model):
    return load_reference(serve_model)


def offline_file(llm: LLM, prompt, params: SamplingParams) -> tuple[dict, object]:
    (out,) = llm.generate([prompt], params)
    assert out.error is None, out.error
    return load_hidden_states(out.kv_transfer_params["hidden_states_path"]), out


def check_file(path: str, token_ids: list[int], oracle, offline_obj: dict) -> None:
    assert os.path.exists(path) and not os.path.exists(path + ".lock"), "answered before the file was durable"
    obj = load_hidden_states(path, verify=True)
    assert obj["token_ids"].tolist() == token_ids
    torch.testing.assert_close(obj["hidden_states"], reference_states(oracle, token_ids, LAYERS), rtol=1e-4, atol=1e-4)
    assert obj["token_ids"].tolist() == offline_obj["token_ids"].tolist()
    torch.testing.assert_close(obj["hidden_states"], offline_obj["hidden_states"], rtol=1e-4, atol=5e-5)  # threads differ


def test_completion_with_token_ids_as_speculators_sends_it(server, oracle, offline):
    ids = [17, 250, 3, 99, 480, 12, 7]
    r = server.client().completions.create(model=server.model, prompt=ids, max_tokens=1,
                                           extra_body={"return_token_ids": True})
    assert r.choices[0].prompt_token_ids == ids
    assert len(r.choices[0].token_ids) == 1 and r.usage.prompt_tokens == len(ids)
    path = r.kv_transfer_params["hidden_states_path"]
    assert path.startswith(server.output) and r.id in path
    expected, _ = offline_file(offline, {"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
    check_file(path, ids, oracle, expected)


def test_completion_with_text_and_output_tokens_matches_greedy_generation(server, oracle, offline):
    text = "The quick model reads a hidden state from the disk"
    r = server.client().completions.create(
        model=server.model, prompt=text, max_tokens=6, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True,
                    "kv_transfer_params": {"include_output_tokens": True}})
    choice = r.choices[0]
    prompt_ids = offline.get_tokenizer()(text).input_ids
    assert choice.prompt_token_ids == prompt_ids and len(choice.token_ids) == 6
    # greedy tokens from the oracle's own forward, one token at a time
    model = oracle[0]
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert choice.token_ids == ids[len(prompt_ids):]
    assert choice.text == offline.get_tokenizer().decode(choice.token_ids, skip_special_tokens=True)
    expected, out = offline_file(offline, text, SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, extra_args={"kv_transfer_params": {"include_output_tokens": True}}))
    assert out.outputs[0].token_ids == choice.token_ids
    check_file(r.kv_transfer_params["hidden_states_path"], ids[:-1], oracle, expected)  # prompt + output minus last


def test_a_stop_string_ends_the_completion_as_vllm_does(server, oracle, offline):
    text = "The quick model reads a hidden state from the disk"
    tok = offline.get_tokenizer()
    free = server.client().completions.create(model=server.model, prompt=text, max_tokens=16, temperature=0,
                                              extra_body={"ignore_eos": True, "return_token_ids": True})
    full = free.choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip()
    free_ids = free.choices[0].token_ids
    n = stop_string_cut(tok, free_ids, stop)  # the oracle: the free greedy tokens, decoded by prefixes
    r = server.client().completions.create(model=server.model, prompt=text, max_tokens=16, temperature=0, stop=stop,
                                           extra_body={"ignore_eos": True, "return_token_ids": True,
                                                       "kv_transfer_params": {"include_output_tokens": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    assert choice.token_ids == free_ids[:n] and choice.text == full[:full.index(stop)]
    ids = choice.prompt_token_ids + choice.token_ids[:-1]
    expected, _ = offline_file(offline, text, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=stop,
                                                             extra_args={"kv_transfer_params":
                                                                         {"include_output_tokens": True}}))
    check_file(r.kv_transfer_params["hidden_states_path"], ids, oracle, expected)
    # include_stop_str_in_output (vLLM's extra_body field): the same tokens, the text through the stop string
    kept = server.client().completions.create(model=server.model, prompt=text, max_tokens=16, temperature=0, stop=stop,
                                              extra_body={"ignore_eos": True, "return_token_ids": True,
                                                          "include_stop_str_in_output": True}).choices[0]
    assert kept.token_ids == free_ids[:n] and kept.text == full[:full.index(stop) + len(stop)]


def test_completion_with_a_list_of_prompts_writes_one_file_each(server, oracle, offline):
    prompts = ["A small cat", "Two rivers run far under the mountain", "Blue"]
    r = server.client().completions.create(model=server.model, prompt=prompts, max_tokens=0,
                                           extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    paths = [c.kv_transfer_params["hidden_states_path"] for c in r.choices]
    assert len(set(paths)) == 3 and r.kv_transfer_params["hidden_states_path"] == paths[0]
    for text, choice in zip(prompts, r.choices):
        assert choice.token_ids == [] and choice.finish_reason == "length"
        expected, _ = offline_file(offline, text, SamplingParams(max_tokens=0))
        check_file(choice.kv_transfer_params["hidden_states_path"], choice.prompt_token_ids, oracle, expected)


def test_chat_completion_as_speculators_sends_it(server, oracle, offline):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a river."},
                {"role": "assistant", "content": "The blue river runs"}]
    r = server.client().chat.completions.create(
        model=server.model, messages=messages, max_tokens=1,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "return_token_ids": True})
    ids = offline.get_tokenizer().apply_chat_template(messages, tokenize=True, add_generation_prompt=False,
                                                      continue_final_message=True, return_dict=True)["input_ids"]
    assert r.prompt_token_ids == list(ids)
    assert r.choices[0].message.role == "assistant" and len(r.choices[0].token_ids) == 1
    expected, _ = offline_file(offline, {"prompt_token_ids": list(ids)}, SamplingParams(max_tokens=1))
    check_file(r.kv_transfer_params["hidden_states_path"], list(ids), oracle, expected)


def test_chat_completion_with_a_generation_prompt_and_a_custom_path(server, oracle, offline):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    custom = os.path.join(server.output, "custom", "chat-1.safetensors")
    r = server.client().chat.completions.create(
        model=server.model, messages=messages, max_tokens=2, temperature=0,
        extra_body={"return_token_ids": True, "kv_transfer_params": {"hidden_states_path": custom}})
    assert r.kv_transfer_params["hidden_states_path"] == custom
    plain = [{"role": "user", "content": "Hello\nthere"}]  # text parts joined as vLLM does
    ids = offline.get_tokenizer().apply_chat_template(plain, tokenize=True, add_generation_prompt=True,
                                                      return_dict=True)["input_ids"]
    assert r.prompt_token_ids == list(ids)
    expected, _ = offline_file(offline, {"prompt_token_ids": list(ids)}, SamplingParams(max_tokens=0))
    check_file(custom, list(ids), oracle, expected)


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.model]
    r = server.get("/health", key=None)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
