"""A request's own `chat_template`, rendered under bounds before the tokenizer renders it for real.

A Jinja template is a program: a 150-byte nested loop takes seconds of the replica's admission thread, nesting makes
it unbounded, and one `'x' * 10**10` asks for ten gigabytes. `hsx serve` refuses request templates unless it was
started with --trust-request-chat-template (vLLM's rule), and even then renders each one first here, in a jinja2
sandbox shaped like transformers' (the same options, filters and globals, so the trial renders what the tokenizer
will), under two bounds:

- time: a trace raises once `timeout_s` has passed, on every line of the template's own code and on every Python
  call anywhere below it (jinja2's filters and globals too: lipsum, indent, tojson) — loops, however nested, stop;
- size: the output as it is produced, and every value the template builds, weighed as the characters it would
  print (a list holding one long string 1000 times weighs 1000 of them, though it costs only 1000 pointers):
  `*`, `**`, `+`, `%`, `~`, list/tuple/dict literals, macro and block bodies, and each call's and filter's result,
  against `max_chars`; before the step, every operation that C code would amplify in one uninterruptible call
  (a huge number or width given to a call or filter, format strings, join's separator, replace, indent, wrapstring,
  sum over sequences). Filters whose C regular expressions could backtrack without end (urlize) are refused.

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

    def weight(self, value: Any) -> int:
        """About how many characters `value` prints as, stopping once past max_chars: a string its length, a
        list/tuple/dict its items' weights (each reference counted: `[s] * n` prints s n times) plus one per item,
        anything else one. Shared sub-values are weighed once (memo by id), so a deep structure costs its size."""
        limit, memo = self.max_chars, {}

        def w(v: Any, depth: int) -> int:
            if isinstance(v, str):
                return len(v)
            if not isinstance(v, (list, tuple, dict)):
                return 1
            key = id(v)
            if key in memo:
                return memo[key]
            if depth > 100:
                raise TemplateRefused("the chat_template builds values nested more than 100 deep")
            total = len(v)
            for item in (v.values() if isinstance(v, dict) else v):  # no temporary (k, v) tuples: ids stay unique
                total += w(item, depth + 1)
                if total > limit:
                    break
            if isinstance(v, dict):
                total += sum(len(k) if isinstance(k, str) else 1 for k in v)
            memo[key] = total
            return total

        return w(value, 0)

    def built(self, value: Any, what: str) -> Any:
        """`value`, once its weight is within max_chars."""
        self.size(self.weight(value), what)
        return value

    def amplified(self, name: str, args: tuple, kwargs: Mapping[str, Any]) -> None:
        """Refuse, before it runs, a call of filter or str method `name` that C code would make large in one step."""
        if not args:
            return
        obj, rest = args[0], args[1:]
        arg = lambda i, key, default=None: rest[i] if len(rest) > i else kwargs.get(key, default)  # noqa: E731
        if name == "join" and isinstance(obj, str) and rest:  # str.join(iterable): obj is the separator
            obj, sep = rest[0], obj
        else:
            sep = arg(0, "d", "")
        if name == "join" and isinstance(sep, str) and isinstance(obj, (list, tuple, str)):
            self.size(self.weight(obj) + len(obj) * len(sep), "a joined string")
        elif name == "replace" and isinstance(obj, str):
            old, new, count = arg(0, "old"), arg(1, "new"), arg(2, "count", -1)
            if isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
                hits = obj.count(old) if old else len(obj) + 1
                if isinstance(count, int) and count >= 0:
                    hits = min(hits, count)
                self.size(len(obj) + hits * (len(new) - len(old)), "a replaced string")
        elif name == "indent" and isinstance(obj, str):
            width = arg(0, "width", 4)
            per = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
            self.size(len(obj) + (obj.count("\n") + 1) * max(per, 0), "an indented string")
        elif name == "wordwrap" and isinstance(obj, str):
            wrap = arg(2, "wrapstring")
            if isinstance(wrap, str):
                self.size(len(obj) + (len(obj) + 1) * len(wrap), "a wrapped string")
        elif name == "sum" and isinstance(arg(1, "start"), (list, tuple, str)):
            # sequences summed: each step copies everything so far, n steps over the total (in C)
            items = obj if isinstance(obj, (list, tuple)) else ()
            self.size(len(items) * self.weight(obj) // 64, "a sum of sequences (its copying, / 64)")

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
                if isinstance(seq, sized) and isinstance(n, int) and not isinstance(n, bool):
                    self.size(self.weight(seq) * max(n, 0), "a repeated value")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 64:
                raise TemplateRefused(f"the chat_template computes {left} ** {right}, a number too large to render")
        elif operator == "+":
            if isinstance(left, sized) and isinstance(right, sized):
                self.size(self.weight(left) + self.weight(right), "a joined value")
        elif operator == "%" and isinstance(left, str):
            self.format_string(left, "%")
            args = right if isinstance(right, tuple) else (right,)
            self.numbers(args)
            self.fields(left, right.values() if isinstance(right, Mapping) else args)

    def fields(self, template: str, args) -> None:
        """A format string can print any of its arguments once per field: refuse when fields x the heaviest
        argument is past max_chars (`'%(a)s%(a)s...' % {'a': s}`, `'{0}{0}...'.format(s)`)."""
        heaviest = max((self.weight(a) for a in args), default=0)
        self.size(len(template) + (template.count("%") + template.count("{")) * heaviest, "a formatted string")


class _Generator(CodeGenerator):
    """jinja2's code generator with `~` (string concatenation) routed through the budget."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.hsx_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def _weighed(self, visit, node, frame) -> None:  # a literal's value, weighed once built
        self.write("environment.hsx_built(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node, frame) -> None:
        self._weighed(super().visit_List, node, frame)

    def visit_Dict(self, node, frame) -> None:
        self._weighed(super().visit_Dict, node, frame)

    def visit_Tuple(self, node, frame) -> None:
        if node.ctx == "load":  # not an assignment target (`for a, b in ...`)
            self._weighed(super().visit_Tuple, node, frame)
        else:
            super().visit_Tuple(node, frame)


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
        for name in _REFUSED_FILTERS:
            self.filters[name] = functools.partial(_refused_filter, name)
        self.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                            dict=lambda *a, **kw: dict(*a, **kw), namespace=_Namespace)
        self.concat = self.hsx_join  # macro, call-block, {% set %}-block and {% filter %} bodies: `concat = environment.concat`

    def _checked(self, f, name: str):
        budget = self.budget

        @functools.wraps(f)  # keeps jinja2's pass_context / pass_environment marks
        def call(*args, **kwargs):
            budget.numbers(args)
            budget.numbers(kwargs.values())
            plain = [a for a in args if not isinstance(a, (jinja2.runtime.Context, jinja2.nodes.EvalContext,
                                                           jinja2.Environment))]
            if name == "format" and plain:
                budget.format_string(plain[0], "%")
                if isinstance(plain[0], str):
                    budget.fields(plain[0], [*plain[1:], *kwargs.values()])
            if name == "join" and plain and not isinstance(plain[0], (str, list, tuple)):
                i = args.index(plain[0])  # an iterator (range, map): made a list, so its length can be weighed
                args = (*args[:i], list(args[i]), *args[i + 1:])
                plain[0] = args[i]
            budget.amplified(name, tuple(plain), kwargs)
            return budget.built(f(*args, **kwargs), f"the output of filter {name!r}")

        return call

    def call_binop(self, context, operator, left, right):
        self.budget.binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
        budget = __self.budget
        if __obj is not safe_range:  # range builds nothing (and the sandbox caps it): loops meet the time bound
            budget.numbers(args)
            budget.numbers(kwargs.values())
        if isinstance(getattr(__obj, "__self__", None), str):  # a str method: 'x'.join(...), .replace(...)
            if __obj.__name__ == "join" and args and not isinstance(args[0], (str, list, tuple)):
                args = (list(args[0]), *args[1:])  # an iterator: made a list, so its length can be weighed
            budget.amplified(__obj.__name__, (__obj.__self__, *args), kwargs)
        return budget.built(super().call(__context, __obj, *args, **kwargs), "a call's result")

    def wrap_str_format(self, value):
        """str.format / format_map, as the sandbox wraps them when looked up, with their widths checked first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        template, budget = value.__self__, self.budget
        budget.format_string(template, "{}")

        @functools.wraps(wrapped)
        def checked(*args, **kwargs):
            values = [*args, *kwargs.values()]
            if value.__name__ == "format_map" and args and isinstance(args[0], Mapping):
                values = list(args[0].values())
            budget.fields(template, values)
            return wrapped(*args, **kwargs)

        return checked

    def hsx_concat(self, parts) -> str:
        for p in parts:  # weighed before str() turns a heavy list into its text
            if not isinstance(p, str):
                self.budget.built(p, "a concatenated value")
        texts = [str(p) for p in parts]
        self.budget.size(sum(map(len, texts)), "a concatenated string")
        return "".join(texts)

    def hsx_built(self, value):
        return self.budget.built(value, "a literal")

    def hsx_join(self, parts) -> str:
        parts = list(parts)
        self.budget.size(sum(len(p) if isinstance(p, str) else self.budget.weight(p) for p in parts),
                         "a macro's or block's output")
        return "".join(parts)


_REFUSED_FILTERS = ("urlize",)
"""Filters a request template may not use: their regular expressions run in C, beyond the time bound's reach, and
no chat template needs them."""


def _refused_filter(name: str, *args, **kwargs):
    raise TemplateRefused(f"the chat_template uses the filter {name!r}, which a request's template may not use "
                          "(its cost cannot be bounded); drop it, or put the template in the model's own files")


class _Tracer:
    """sys.settrace function raising _TooSlow past the deadline: on every Python call, and on every line of every
    frame (compiling) or of the template's own (rendering); `active = False` disarms the frames it already traces
    (so closing the generator does not raise)."""

    def __init__(self, deadline: float) -> None:
        self.deadline, self.every_frame, self.active = deadline, True, True

    def local(self, frame, event, arg):
        if self.active and time.monotonic() > self.deadline:
            raise _TooSlow
        return self.local

    def __call__(self, frame, event, arg):
        if not self.active:
            return None
        if time.monotonic() > self.deadline:  # any Python call below the template (a filter's loop): stop there
            raise _TooSlow
        if self.every_frame or frame.f_code.co_filename == TEMPLATE_FILENAME:
            return self.local
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
