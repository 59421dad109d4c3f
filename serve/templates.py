"""A request's own `chat_template`, rendered under bounds before the tokenizer renders it for real.

A Jinja template is a program: a 150-byte nested loop takes seconds of the replica's admission thread, nesting makes
it unbounded, and one `'x' * 10**10` asks for ten gigabytes. `hsx serve` refuses request templates unless it was
started with --trust-request-chat-template (vLLM's rule), and even then renders each one first here, in a jinja2
sandbox shaped like transformers' (the same options, filters and globals, so the trial renders what the tokenizer
will), under two bounds:

- time: a trace on the template's own code raises once `timeout_s` has passed — loops, however nested, stop;
- size: the output as it is produced, and every operation that can build a large value in one step (`*`, `**`,
  `+`, `%`, `~`, calls and filters given a huge number, format strings with a huge width), against `max_chars`.

    check_request_template(template, variables, timeout_s=..., max_chars=...)
        the rendered text when the template renders within both bounds; TemplateRefused (a ValueError naming the bound) if not.
        Errors of the template itself (syntax, undefined calls, raise_exception) propagate as jinja2 errors.

Only when the trial passes does the tokenizer's apply_chat_template render it (then it takes no longer, and produces
the same text). The model's own template is trusted and rendered directly.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

TEMPLATE_FILENAME = "<template>"
"""The file name of code jinja2 compiles from a string: the frames the time bound traces."""
_PERCENT_SPEC = re.compile(r"%[-#0 +]*(\d*)(?:\.(\d*))?")  # a %-format's width and precision
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")  # a str.format field's spec
_DIGITS = re.compile(r"\d+")


class TemplateRefused(ValueError):
    """A request's chat_template went past a bound; the message names it and the flag that sets it."""


class _TooSlow(BaseException):
    """Raised by the trace inside the template's frames: a BaseException, so no handler in the template or jinja2's
    runtime (they catch Exception) can swallow it."""


class _Budget:
    def __init__(self, timeout_s: float, max_chars: int) -> None:
        self.timeout_s, self.max_chars = timeout_s, max_chars
        self.deadline = time.monotonic() + timeout_s

    def size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise TemplateRefused(f"the chat_template would build {what} of {n} characters or items, more than the "
                                  f"{self.max_chars} a rendered prompt may have")

    def numbers(self, values) -> None:
        for v in values:
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > self.max_chars:
                raise TemplateRefused(f"the chat_template passes the number {v} to a call or filter, more than the "
                                      f"{self.max_chars} characters a rendered prompt may have")

    def format_string(self, s: Any, style: str) -> None:
        """Refuse a format string (style "%" or "{}") whose widths or precisions exceed max_chars."""
        if not isinstance(s, str):
            return
        if style == "%":
            found = [d for m in _PERCENT_SPEC.finditer(s) for d in m.groups() if d]
        else:
            found = [d for m in _BRACE_SPEC.finditer(s) for d in _DIGITS.findall(m.group(1))]
        for d in found:
            if len(d) > 12 or int(d) > self.max_chars:
                raise TemplateRefused(f"the chat_template formats with a width of {d[:20]}, more than the "
                                      f"{self.max_chars} characters a rendered prompt may have")

    def binop(self, operator: str, left: Any, right: Any) -> None:
        sized = (str, list, tuple)
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, sized) and isinstance(n, int):
                    self.size(len(seq) * max(n, 0), "a repeated value")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 64:
                raise TemplateRefused(f"the chat_template computes {left} ** {right}, a number too large to render")
        elif operator == "+":
            if isinstance(left, sized) and isinstance(right, sized):
                self.size(len(left) + len(right), "a joined value")
        elif operator == "%" and isinstance(left, str):
            self.format_string(left, "%")
            self.numbers(right if isinstance(right, tuple) else (right,))


class _Generator(CodeGenerator):
    """jinja2's code generator with `~` (string concatenation) routed through the budget."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.hsx_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` tag (it marks assistant tokens): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """namespace() without underscore-prefixed attributes (as transformers allows it)."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja2's own signature trick, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attributes may not start with '_' ({name!r})")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    code_generator_class = _Generator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, budget: _Budget) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
        self.budget = budget
        self.filters["tojson"] = _tojson
        self.filters = {name: self._checked(f, name) for name, f in self.filters.items()}
        self.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                            dict=lambda *a, **kw: dict(*a, **kw), namespace=_Namespace)

    def _checked(self, f, name: str):
        budget = self.budget

        @functools.wraps(f)  # keeps jinja2's pass_context / pass_environment marks
        def call(*args, **kwargs):
            budget.numbers(args)
            budget.numbers(kwargs.values())
            if name == "format" and args:
                budget.format_string(next((a for a in args if isinstance(a, str)), None), "%")
            out = f(*args, **kwargs)
            if isinstance(out, (str, list, tuple)):
                budget.size(len(out), f"the output of filter {name!r}")
            return out

        return call

    def call_binop(self, context, operator, left, right):
        self.budget.binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
        if __obj is not safe_range:  # range builds nothing (and the sandbox caps it): loops meet the time bound
            __self.budget.numbers(args)
            __self.budget.numbers(kwargs.values())
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        """str.format / format_map, as the sandbox wraps them when looked up, with their widths checked first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            self.budget.format_string(value.__self__, "{}")
        return wrapped

    def hsx_concat(self, parts) -> str:
        texts = [str(p) for p in parts]
        self.budget.size(sum(map(len, texts)), "a concatenated string")
        return "".join(texts)


class _Tracer:
    """sys.settrace function raising _TooSlow past the deadline, in every frame (compiling) or the template's own
    (rendering); `active = False` disarms the frames it already traces (so closing the generator does not raise)."""

    def __init__(self, deadline: float) -> None:
        self.deadline, self.every_frame, self.active = deadline, True, True

    def local(self, frame, event, arg):
        if self.active and time.monotonic() > self.deadline:
            raise _TooSlow
        return self.local

    def __call__(self, frame, event, arg):
        if self.active and (self.every_frame or frame.f_code.co_filename == TEMPLATE_FILENAME):
            return self.local(frame, event, arg)
        return None


def check_request_template(template: str, variables: Mapping[str, Any], *, timeout_s: float, max_chars: int) -> str:
    """Render `template` with `variables` (messages, add_generation_prompt, the tokenizer's special tokens, the
    request's chat_template_kwargs) within `timeout_s` and `max_chars`: the text, or TemplateRefused."""
    budget = _Budget(timeout_s, max_chars)
    budget.size(len(template), "a template")
    previous, tracer, chunks = sys.gettrace(), _Tracer(budget.deadline), None
    try:
        sys.settrace(tracer)  # compiling: the parser's own frames too
        compiled = _BoundedEnvironment(budget).from_string(template)
        tracer.every_frame = False  # rendering: the template's code
        chunks = compiled.generate(**variables)
        produced, text = 0, []
        for chunk in chunks:
            text.append(chunk)
            produced += len(chunk)
            budget.size(produced, "a prompt")
            if time.monotonic() > budget.deadline:
                raise _TooSlow
        return "".join(text)
    except _TooSlow:
        raise TemplateRefused(f"the chat_template did not finish rendering within {timeout_s:g} s "
                              "(--chat-template-timeout-s); simplify it (loops over loops?)") from None
    except RecursionError:
        raise TemplateRefused("the chat_template nests or recurses too deeply to render") from None
    finally:
        tracer.active = False
        sys.settrace(previous)
        if chunks is not None:
            chunks.close()
