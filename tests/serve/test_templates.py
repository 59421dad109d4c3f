"""A request's own chat_template (serve/templates.py, and the engine's admission that uses it): refused unless the
server trusts request templates, and even then bounded in time and size — every kind of template bomb stops — while
an ordinary template renders exactly what the tokenizer's own apply_chat_template renders (the oracle)."""

from __future__ import annotations

import time

import pytest

from serve.templates import TemplateRefused, check_request_template

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
            {"role": "assistant", "content": "hello"}]
ORDINARY = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}{% set ns = namespace(n=0) %}"
            "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}[{{ ns.n }}]{{ messages[0] | tojson }}"
            "{% generation %}{{ 'x' * 3 }}{% endgeneration %}{{ '%03d' % 7 }}{{ '{:>4}'.format('a') }}")
BOMBS = {
    "nested loops": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "nested loops writing": "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
    "loops in a macro": "{% macro f() %}{% for a in range(100000) %}{% for b in range(100000) %}y{% endfor %}"
                        "{% endfor %}{% endmacro %}{{ f() }}",
    "string repeat": "{{ 'x' * 10**9 }}",
    "list repeat": "{{ [1] * 1000000000 }}",
    "power": "{{ 9 ** 999999999 }}",
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s }}",
    "doubling with +": "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                       "{% endfor %}",
    "center filter": "{{ 'x' | center(1000000000) }}",
    "str method": "{{ 'x'.ljust(1000000000) }}",
    "percent width": "{{ '%1000000000d' % 1 }}",
    "format filter width": "{{ '%1000000000d' | format(1) }}",
    "str.format width": "{{ '{:>1000000000}'.format(1) }}",
    "format_map width": "{{ '{x:>1000000000}'.format_map({'x': 1}) }}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "deep nesting": "{{" + "(" * 5000 + "1" + ")" * 5000 + "}}",
    # the work happens below the template, in jinja2's or C code: one call, no template line runs meanwhile
    "lipsum": "{{ lipsum(n=100000) }}",
    "indent width": "{{ ('a\n' * 100000) | indent(100000) }}",
    "join separator": "{{ range(100000) | join('x' * 100000) }}",
    "str.join separator": "{{ ('x' * 100000).join(range(100000) | map('string')) }}",
    "replace chain": "{{ ('a' * 1000).replace('a', 'a' * 1000).replace('a', 'a' * 1000) }}",
    "replace filter": "{{ ('a' * 1000) | replace('a', 'a' * 1000) | replace('a', 'a' * 1000) }}",
    "wrapstring": "{{ ('a ' * 100000) | wordwrap(1, wrapstring='x' * 100000) }}",
    "list of references printed": "{% set s = 'x' * 1000000 %}{{ [s] * 100000 }}",
    "nested literals": "{% set a = 'x' * 100000 %}{% set b = [a, a, a, a, a, a, a, a, a, a] %}"
                       "{% set c = [b, b, b, b, b, b, b, b, b, b] %}{% set d = [c, c, c, c, c, c, c, c, c, c] %}"
                       "{{ d | string | length }}",
    "nested macros": "{% macro m0() %}" + "x" * 1000 + "{% endmacro %}" + "".join(
        f"{{% macro m{i + 1}() %}}" + f"{{{{ m{i}() }}}}" * 10 + "{% endmacro %}" for i in range(8))
        + "{{ m8() | length }}",
    "format fields": "{% set s = 'x' * 100000 %}{{ ('%(a)s' * 10000) % {'a': s} }}",
    "str.format fields": "{% set s = 'x' * 100000 %}{{ ('{0}' * 10000).format(s) }}",
    "sum of lists": "{{ ([[1]] * 100000) | sum(start=[]) | length }}",
    "batch fill": "{% set s = 'x' * 100000 %}{{ [1] | batch(100000, fill_with=s) | list }}",
    "urlize": "{{ ('www.' + 'a.' * 50000) | urlize }}",
}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def _variables(tokenizer, **extra):
    return {**tokenizer.special_tokens_map, "messages": MESSAGES, "tools": None, "documents": None,
            "add_generation_prompt": True, **extra}


def test_an_ordinary_template_renders_what_the_tokenizer_renders(tokenizer):
    ours = check_request_template(ORDINARY, _variables(tokenizer), timeout_s=5, max_chars=1 << 20)
    theirs = tokenizer.apply_chat_template(MESSAGES, chat_template=ORDINARY, add_generation_prompt=True,
                                           tokenize=False)
    assert ours == theirs and "[3]" in ours and "xxx" in ours and "007" in ours


REALISTIC = ("{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}{% if m['role'] == 'system' %}"
             "{% set ns.system = m['content'] | trim %}{% endif %}{% endfor %}"
             "{% if tools %}{{ 'Tools:\n' + tools | tojson(indent=4) + '\n' }}{% endif %}"
             "{{ '<|system|>%s\n' % ns.system }}"
             "{% for m in messages if m['role'] != 'system' %}{{ '<|{}|>'.format(m['role']) }}"
             "{{ m['content'] | trim | replace('\r\n', '\n') | indent(2) }}{{ ['', loop.index0 | string] | join(':') }}"
             "\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_a_long_conversation_through_a_realistic_template_is_not_refused(tokenizer):
    """The bounds refuse amplification, not size: 200 turns of about 2000 characters (400k in all, under the 1 MiB
    bound) through a template using tojson(indent), %, str.format, replace, indent and join render exactly what the
    tokenizer renders."""
    import random

    rng = random.Random(3)
    words = ["alpha", "beta", "gamma\r\n", "delta", "{x}", "%s", "\n"]
    messages = [{"role": "system", "content": " keep it short "}] + [
        {"role": ("user", "assistant")[i % 2], "content": " ".join(rng.choice(words) for _ in range(330))}
        for i in range(200)]
    tools = [{"type": "function", "function": {"name": f"tool{i}", "parameters": {"type": "object"}}}
             for i in range(20)]
    variables = {**_variables(tokenizer), "messages": messages, "tools": tools}
    ours = check_request_template(REALISTIC, variables, timeout_s=30, max_chars=1 << 20)
    theirs = tokenizer.apply_chat_template(messages, chat_template=REALISTIC, tools=tools, add_generation_prompt=True,
                                           tokenize=False)
    assert ours == theirs and len(ours) > 350_000


@pytest.mark.parametrize("name", list(BOMBS))
def test_every_template_bomb_is_refused_and_stops(name, tokenizer):
    start = time.monotonic()
    with pytest.raises(TemplateRefused) as e:
        check_request_template(BOMBS[name], _variables(tokenizer), timeout_s=0.5, max_chars=1 << 20)
    # unbounded, these take hours or ask for gigabytes; the bound stops each within its time (plus scheduling)
    assert time.monotonic() - start < 15, name
    assert "chat_template" in str(e.value)


def test_output_past_the_size_bound_is_refused(tokenizer):
    template = "{% for i in range(100000) %}{{ messages[1]['content'] }}{% endfor %}"  # 800000 characters
    with pytest.raises(TemplateRefused, match=r"a prompt of \d+ characters or items, more than the 5000"):
        check_request_template(template, _variables(tokenizer), timeout_s=30, max_chars=5000)


def test_the_templates_own_errors_propagate(tokenizer):
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="no system role"):
        check_request_template("{{ raise_exception('no system role') }}", _variables(tokenizer), timeout_s=1,
                               max_chars=1000)
    with pytest.raises(jinja2.exceptions.SecurityError):  # the sandbox still holds
        check_request_template("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
                               _variables(tokenizer), timeout_s=1, max_chars=1000)


@pytest.fixture(scope="module")
def engines(tiny_llama, tmp_path_factory):
    """Two engines as `hsx serve` replicas build them (no Ray needed for admission): trusting request templates
    or not."""
    from serve.config import ServeConfig
    from serve.engine import Engine

    out = tmp_path_factory.mktemp("engine-out")
    base = dict(model=tiny_llama, output=str(out), layers=(1, 2, 4), device="cpu", api_key="k")
    return (Engine(ServeConfig(**base)),
            Engine(ServeConfig(**base, trust_request_chat_template=True, chat_template_timeout_s=0.5)))


def test_admission_refuses_request_templates_unless_trusted_and_bounds_them_then(engines, tokenizer):
    from serve.engine import PromptRequest, _Rejected

    plain, trusting = engines
    request = PromptRequest("chat-1", messages=MESSAGES[:2], chat_template=ORDINARY, max_tokens=0)
    with pytest.raises(_Rejected) as e:
        plain._admit(request)
    assert e.value.reply_fields["status"] == 400 and e.value.reply_fields["param"] == "chat_template"
    assert "--trust-request-chat-template" in e.value.reply_fields["message"]
    item = trusting._admit(request)
    expected = tokenizer.apply_chat_template(MESSAGES[:2], chat_template=ORDINARY, add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
    assert item.prompt_token_ids == list(expected)
    start = time.monotonic()
    with pytest.raises(_Rejected) as e:
        trusting._admit(PromptRequest("chat-2", messages=MESSAGES[:2], chat_template=BOMBS["nested loops"]))
    assert time.monotonic() - start < 15
    assert e.value.reply_fields["code"] == "chat_template_too_costly" and "--chat-template-timeout-s" in \
        e.value.reply_fields["message"]
    # the model's own template is trusted: rendered as the tokenizer renders it, on either server
    own = tokenizer.apply_chat_template(MESSAGES[:2], add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
    assert plain._admit(PromptRequest("chat-3", messages=MESSAGES[:2], max_tokens=0)).prompt_token_ids == list(own)
