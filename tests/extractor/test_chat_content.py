"""`LLM.chat`, the corpus readers and `hsx serve` take OpenAI content parts by vLLM's rule (issue 49 item 8): text
parts joined with newlines for a template that expects a string, passed as parts to one that loops over them; an
image part on a text-only target is refused naming the model. On 6c0b8cf `LLM.chat` rendered a part list as Python
text (`[{'type': 'text', ...}]`), image parts included, and the corpus reader joined parts with nothing between."""

from __future__ import annotations

import pytest

from extractor import LLM, SamplingParams
from harness.specs import spec_config

PARTS = [{"type": "text", "text": "What is it?"}, {"type": "text", "text": "Say it twice."}]
PARTS_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}"
                  "{% else %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endif %}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""A template that renders each part itself (as Gemma-3's and Llama-3.2-Vision's do)."""


@pytest.fixture(scope="module")
def llm(tiny_llama, tmp_path_factory):
    from connectors import KVTransferConfig

    out = str(tmp_path_factory.mktemp("chat-content"))
    return LLM(model=tiny_llama, speculative_config=spec_config([1]), dtype="float32",
               kv_transfer_config=KVTransferConfig(kv_connector="ExampleHiddenStatesConnector",
                                                   kv_role="kv_producer",
                                                   kv_connector_extra_config={"shared_storage_path": out}))


def _oracle(llm, messages, template=None) -> list[int]:
    return list(llm.tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"])


def test_text_parts_reach_a_string_template_joined_by_newlines(llm):
    # hostile input: content [{"type": "text", "text": "What is it?"}, ...] (the seed's --backend openai-chat shape)
    (out,) = llm.chat([{"role": "user", "content": PARTS}], SamplingParams(max_tokens=0))
    assert out.error is None
    assert out.prompt_token_ids == _oracle(llm, [{"role": "user", "content": "What is it?\nSay it twice."}])
    assert "{'type'" not in out.prompt and "What is it?\nSay it twice." in out.prompt


def test_text_parts_reach_a_template_that_loops_over_them_as_parts(llm):
    (out,) = llm.chat([{"role": "user", "content": PARTS}], SamplingParams(max_tokens=0),
                      chat_template=PARTS_TEMPLATE)
    assert out.prompt_token_ids == _oracle(llm, [{"role": "user", "content": PARTS}], PARTS_TEMPLATE)
    assert "[What is it?][Say it twice.]" in out.prompt


def test_an_image_part_on_a_text_only_target_is_refused_naming_the_model(llm, tiny_llama):
    # hostile input: an image_url part beside a text part; it was rendered into the prompt as Python text
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in it?"},
                                             {"type": "image_url", "image_url": {"url": "file:///x.png"}}]}]
    with pytest.raises(ValueError, match=rf"message 0 content part 1 is of type 'image_url', but {tiny_llama} is a "
                                         "text-only model"):
        llm.chat(messages, SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="content part 0 must be"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": 3}]}], SamplingParams(max_tokens=0))


def test_a_corpus_record_keeps_the_same_rule(llm, tmp_path):
    from corpus.chat import ChatEncoder, normalize_messages

    record = {"messages": [{"role": "user", "content": PARTS}, {"role": "assistant", "content": "It is."}]}
    for template in (None, PARTS_TEMPLATE):
        encoder = ChatEncoder(llm.tokenizer, template)
        ids, mask = encoder.encode(normalize_messages(record, encoder.content_format))
        expected = record["messages"] if template else [
            {"role": "user", "content": "What is it?\nSay it twice."}, record["messages"][1]]
        assert ids == list(llm.tokenizer.apply_chat_template(expected, chat_template=template, tokenize=True,
                                                             return_dict=True)["input_ids"])
        assert 0 < sum(mask) < len(ids)
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    with pytest.raises(ValueError, match="messages\\[0\\] content part 0 is of type 'image_url'.*text-only"):
        normalize_messages(image)


def test_named_chat_templates_of_a_tokenizer_are_judged_by_the_default_one(llm):
    # review finding: a model shipping additional_chat_templates/ loads chat_template as a dict, which the content
    # rule's cache could not hash (every chat record failed as "a bug in hsx")
    from corpus.chat import ChatEncoder, normalize_messages

    plain = llm.tokenizer.chat_template
    llm.tokenizer.chat_template = {"default": plain, "tool_use": PARTS_TEMPLATE}
    try:
        record = {"messages": [{"role": "user", "content": PARTS}, {"role": "assistant", "content": "It is."}]}
        encoder = ChatEncoder(llm.tokenizer)
        ids, _ = encoder.encode(normalize_messages(record, encoder.content_format))
        joined = [{"role": "user", "content": "What is it?\nSay it twice."}, record["messages"][1]]
        assert ids == list(llm.tokenizer.apply_chat_template(joined, chat_template=plain, tokenize=True,
                                                             return_dict=True)["input_ids"])
        (out,) = llm.chat([{"role": "user", "content": PARTS}], SamplingParams(max_tokens=0))
        assert out.prompt_token_ids == _oracle(llm, [{"role": "user", "content": "What is it?\nSay it twice."}], plain)
    finally:
        llm.tokenizer.chat_template = plain
