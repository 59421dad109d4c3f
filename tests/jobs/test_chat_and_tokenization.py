"""Chat loss masks for any template (checked against `{% generation %}` masks), and the tokenization stage (no Ray)."""

from __future__ import annotations

import json

import pytest

from corpus.chat import ChatEncoder, normalize_messages
from corpus.tokenization import SampleError, SampleTokenizer, TokenizeSettings

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "The cat is blue."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one"},
     {"role": "assistant", "content": "two three"}, {"role": "user", "content": "four?"},
     {"role": "assistant", "content": "Five, six!\nseven"}],
    [{"role": "user", "content": "no answer yet"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "b"},
     {"role": "assistant", "content": "  spaced out  "}],
]

# A template with a different shape (Llama-3-like headers, no trailing newline, BOS) and no generation markers.
HEADER_TEMPLATE = (
    "<|endoftext|>{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_end|>\n\n{{ m['content'] | trim }}"
    "<|pad|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant<|im_end|>\n\n{% endif %}"
)
# Rewrites earlier assistant turns (keeps only their first word), as reasoning templates do.
REWRITING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split(' ')[0] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from reference.tiny_models import build_tokenizer

    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_prefix_diff_mask_equals_the_templates_generation_mask(tokenizer, messages):
    ids, mask = ChatEncoder(tokenizer).encode(messages)
    ref = tokenizer.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
    assert ids == list(ref["input_ids"])
    assert mask == list(ref["assistant_masks"])


def _decoded_spans(tokenizer, ids, mask):
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tokenizer.decode(cur))
            cur = []
    if cur:
        spans.append(tokenizer.decode(cur))
    return spans


def test_mask_works_for_a_template_without_generation_markers(tokenizer):
    messages = CONVERSATIONS[1]
    ids, mask = ChatEncoder(tokenizer, HEADER_TEMPLATE).encode(messages)
    assert ids == list(tokenizer.apply_chat_template(messages, chat_template=HEADER_TEMPLATE)["input_ids"])
    assert _decoded_spans(tokenizer, ids, mask) == ["two three<|pad|>", "Five, six!\nseven<|pad|>"]


def test_template_that_rewrites_earlier_turns_is_located_by_search(tokenizer):
    messages = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "alpha beta"},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "gamma delta"}]
    # the first turn renders differently once a later turn follows ("alpha" only): it cannot be located
    with pytest.raises(ValueError, match="rewrites it"):
        ChatEncoder(tokenizer, REWRITING_TEMPLATE).encode(messages)
    messages[1]["content"] = "alpha"  # a one-word turn renders the same either way
    ids, mask = ChatEncoder(tokenizer, REWRITING_TEMPLATE).encode(messages)
    assert _decoded_spans(tokenizer, ids, mask) == ["alpha<|im_end|>", "gamma delta<|im_end|>"]


def test_template_whose_prefixes_shift_still_matches_the_generation_mask(tokenizer):
    # the header counts the messages, so no prefix rendering is a prefix of the full one: turns are found by search
    counting = "<|im_start|>system\n{{ messages | length }} messages<|im_end|>\n" + tokenizer.chat_template
    messages = CONVERSATIONS[1]
    ids, mask = ChatEncoder(tokenizer, counting).encode(messages)
    ref = tokenizer.apply_chat_template(messages, chat_template=counting, return_assistant_tokens_mask=True,
                                        return_dict=True)
    assert ids == list(ref["input_ids"]) and mask == list(ref["assistant_masks"])
    assert sum(mask) > 0


def test_unlocatable_turn_is_a_clear_error(tokenizer):
    drop = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|im_start|>{{ m['content'] }}"
            "<|im_end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>{% endif %}")
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "zebra"},
                {"role": "user", "content": "r"}, {"role": "assistant", "content": "yak"}]
    with pytest.raises(ValueError, match="cannot locate assistant message 1"):
        ChatEncoder(tokenizer, drop).encode(messages)


def test_sharegpt_and_openai_parts_normalise_to_roles():
    assert normalize_messages({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}) \
        == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]}
    assert normalize_messages(parts) == [{"role": "user", "content": "x\ny"}]  # joined as vLLM joins text parts
    for bad, msg in [({"messages": []}, "empty"), ({"messages": [{"role": "alien", "content": "x"}]}, "unknown role"),
                     ({"conversations": [{"value": "x"}]}, "no 'from'"), ({"messages": "hi"}, "must be a list"),
                     ({"messages": [{"role": "user", "content": 3}]}, "string")]:
        with pytest.raises(ValueError, match=msg):
            normalize_messages(bad)


@pytest.fixture(scope="module")
def sample_tokenizer(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tk")
    tokenizer.save_pretrained(str(path))
    return lambda **kw: SampleTokenizer(TokenizeSettings(tokenizer=str(path), **{"max_prompt_tokens": 64, **kw}))


def test_every_record_shape_tokenizes(sample_tokenizer, tokenizer):
    tok = sample_tokenizer()
    out = tok.tokenize(json.dumps({"prompt": "The cat jumps."}))
    assert out.ids == list(tokenizer("The cat jumps.").input_ids) and out.mask == [1] * len(out.ids)
    out = tok.tokenize(json.dumps({"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}))
    assert (out.ids, out.mask) == ([5, 6, 7], [0, 1, 1])
    chat = CONVERSATIONS[0]
    out = tok.tokenize(json.dumps({"messages": chat}))
    ref = tokenizer.apply_chat_template(chat, return_assistant_tokens_mask=True, return_dict=True)
    assert (out.ids, out.mask) == (list(ref["input_ids"]), list(ref["assistant_masks"]))
    share = {"conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "The cat is blue."}]}
    assert tok.tokenize(json.dumps(share)).ids == out.ids


def test_overlength_is_truncated_or_skipped_as_asked(sample_tokenizer):
    record = json.dumps({"input_ids": list(range(10, 110))})
    out = sample_tokenizer(overlength="truncate").tokenize(record)
    assert out.truncated and out.ids == list(range(10, 74)) and len(out.mask) == 64
    with pytest.raises(SampleError, match="over-length: 100 tokens > limit 64"):
        sample_tokenizer(overlength="skip").tokenize(record)


@pytest.mark.parametrize("record, msg", [
    ({"prompt": ""}, "empty sample"),
    ({"prompt": 5}, "must be a string"),
    ({"input_ids": [1, "a"]}, "non-negative integers"),
    ({"input_ids": [1, 2**63]}, r"input_ids\[1\] is 9223372036854775808; .* at most 2\*\*63-1"),
    ({"input_ids": [1, 2], "loss_mask": [1, 3]}, r"loss_mask\[1\] is 3; give 0 or 1"),
    ({"prompt": "a \ud800 b"}, "field 'prompt' is not valid Unicode text"),
    ({"input_ids": None, "messages": None, "prompt": "null fields are absent"}, None),
    ({"input_ids": [1, 2], "loss_mask": [1]}, "1 values for 2"),
    ({"text": "x"}, "none of the fields"),
    ({"messages": [{"role": "user", "content": "{{"}], "x": 1}, None),
])
def test_bad_records_raise_sample_errors(sample_tokenizer, record, msg):
    tok = sample_tokenizer()
    if msg is None:  # template syntax in content is data, not template; null fields do not pick the shape
        assert tok.tokenize(json.dumps(record)).ids
        return
    with pytest.raises(SampleError, match=msg):
        tok.tokenize(json.dumps(record))


def test_chat_records_without_any_template_fail_with_the_flag_to_use(sample_tokenizer, tmp_path):
    from reference.tiny_models import build_tokenizer

    tok = build_tokenizer(str(tmp_path))
    tok.chat_template = None
    tok.save_pretrained(str(tmp_path))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    st = SampleTokenizer(TokenizeSettings(tokenizer=str(tmp_path), max_prompt_tokens=64))
    with pytest.raises(SampleError, match="--chat-template"):
        st.tokenize(json.dumps({"messages": CONVERSATIONS[0]}))
    assert st.tokenize(json.dumps({"prompt": "still fine"})).ids
