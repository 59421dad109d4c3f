"""Chat records -> token ids plus a loss mask over the assistant's tokens, for any chat template.

    normalize_messages(record) -> [{"role", "content", ...}]     OpenAI `messages` or ShareGPT `conversations`
    ChatEncoder(tokenizer, template).encode(messages) -> (ids, mask)

How the mask is found, without knowing the template: for each assistant message i, render the conversation up to
message i with the generation prompt (`P_i`) and up to and including message i (`Q_i`). What `Q_i` adds after `P_i`
is the assistant's turn as the template writes it — content plus end-of-turn marker — minus trailing whitespace (the
separator before the next turn, which a model does not generate). That character span is located in the rendering of
the whole conversation (same offsets when the template renders prefixes stably; otherwise found by search after the
previous turn, for templates that render earlier parts differently as the conversation grows), and every token
overlapping it gets mask 1. Ids are the
tokenizer's encoding of the full rendering without added special tokens, exactly what `apply_chat_template` returns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extractor.chat_content import OPENAI, STRING, for_template, image_content, message_content
from extractor.chat_content import content_format as template_content_format

ROLE_ALIASES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant",
    "system": "system", "developer": "system",
    "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool",
}


def normalize_messages(record: Mapping[str, Any], content_format: str = STRING,
                       images: list[Any] | None = None, keep_images: bool = False) -> list[dict[str, Any]]:
    """The conversation of an OpenAI (`messages`) or ShareGPT (`conversations`) record, with canonical roles. Content
    parts become what a template of `content_format` takes (ChatEncoder.content_format: text parts joined with
    newlines, or kept as parts for a template that loops over them); a media part is refused (text-only targets),
    unless `images` is a list (a vision-language target): then image parts become {"type": "image"} where they stood
    and their references are appended to it, in order; with `keep_images` they stay image parts, as
    {"type": "image_url", "image_url": {"url": ...}} (a request to a server that loads them itself).

    Raises ValueError saying what is wrong with the record.
    """
    if "messages" in record:
        key, role_key, content_key = "messages", "role", "content"
    else:
        key, role_key, content_key = "conversations", "from", "value"
    turns = record[key]
    if not isinstance(turns, list):
        raise ValueError(f"{key!r} must be a list of messages, got {type(turns).__name__}")
    if not turns:
        raise ValueError(f"{key!r} is empty; nothing to extract")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping):
            raise ValueError(f"{key}[{i}] must be an object with {role_key!r} and {content_key!r}, got "
                             f"{type(turn).__name__}")
        if role_key not in turn:
            raise ValueError(f"{key}[{i}] has no {role_key!r} field (keys: {_short(sorted(turn))})")
        raw_role = turn[role_key]
        role = ROLE_ALIASES.get(str(raw_role).lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise ValueError(f"{key}[{i}] has unknown role {_short(raw_role)}; known roles: {sorted(ROLE_ALIASES)}")
        content = turn.get(content_key)
        if isinstance(content, list) and images is not None:  # a vision-language target, as LLM.chat
            content, found = image_content(content, f"{key}[{i}]")
            if keep_images:  # each image part as OpenAI's image_url part, in its place
                refs = iter(found)
                content = [p if p["type"] == "text" else {"type": "image_url", "image_url": {"url": next(refs)}}
                           for p in content]
            if found and content_format != OPENAI:
                raise ValueError(f"{key}[{i}] has image parts but the chat template takes string content, so it "
                                 "cannot place them; pass a template that renders image parts with --chat-template")
            images.extend(found)
            content = for_template(content, content_format)
        elif isinstance(content, list):  # OpenAI content parts: vLLM's rule (extractor.chat_content), as LLM.chat
            content = for_template(message_content(content, f"{key}[{i}]"), content_format)
        if content is None and role == "assistant" and turn.get("tool_calls"):
            content = ""
        if not isinstance(content, (str, list)):
            raise ValueError(f"{key}[{i}] needs a string {content_key!r}, got {type(content).__name__}")
        message = {k: v for k, v in turn.items() if k not in (role_key, content_key)}
        message.update(role=role, content=content)
        out.append(message)
    return out


def _short(value, limit: int = 60) -> str:
    """repr for an error text, cut short: records quote whatever they hold."""
    r = repr(value)
    return r if len(r) <= limit else f"{r[:limit]}..."


class ChatEncoder:
    """Renders conversations with one chat template and marks the assistant's tokens."""

    def __init__(self, tokenizer, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass one with --chat-template FILE.jinja")
        self.content_format = template_content_format(template or getattr(tokenizer, "chat_template", None))
        """How content parts reach this template (extractor.chat_content): pass it to normalize_messages."""
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("chat records need a fast tokenizer (character offsets locate the assistant's tokens); "
                             f"{type(tokenizer).__name__} is a slow one")

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def assistant_spans(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The full rendering and the character spans of each assistant turn in it."""
        full = self.render(messages)
        spans: list[tuple[int, int]] = []
        cursor = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True) if i else ""
            upto = self.render(messages[: i + 1])
            start = len(before) if upto.startswith(before) else _appended_at(before, upto)
            turn = upto[start:].rstrip()
            if not turn:
                continue  # an empty turn (e.g. empty content with a template that adds nothing)
            end = start + len(turn)
            if start >= cursor and full[:end] == upto[:end]:
                span = (start, end)
            else:  # the template renders this turn differently once later turns follow: find it after the last one
                found = full.find(turn, cursor)
                if found < 0:
                    raise ValueError(f"cannot locate assistant message {i} in the rendered conversation: the chat "
                                     "template rewrites it when later turns follow (e.g. drops reasoning); pass a "
                                     "template that keeps earlier turns with --chat-template")
                span = (found, found + len(turn))
            spans.append(span)
            cursor = span[1]
        return full, spans

    def encode(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """(token ids, loss mask): mask 1 on every token overlapping an assistant turn."""
        return self.encode_text(messages)[1:]

    def encode_text(self, messages: list[dict[str, Any]]) -> tuple[str, list[int], list[int]]:
        """(the rendering, its token ids, loss mask): encode's, with the text it tokenized."""
        full, spans = self.assistant_spans(messages)
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [0] * len(ids)
        j = 0
        for t, (s, e) in enumerate(enc["offset_mapping"]):
            if e <= s:
                continue
            while j < len(spans) and spans[j][1] <= s:
                j += 1
            if j < len(spans) and s < spans[j][1] and e > spans[j][0]:
                mask[t] = 1
        return full, ids, mask


def _appended_at(before: str, upto: str) -> int:
    """Where `upto` starts adding to `before` when the template also changed something earlier (a header that counts
    messages, a date): the start of the final insertion in a character diff."""
    import difflib

    ops = difflib.SequenceMatcher(None, before, upto, autojunk=False).get_opcodes()
    tag, i1, _, j1, _ = ops[-1]
    if tag == "insert" and i1 == len(before):
        return j1
    # no clean append: fall back to the common prefix
    n = min(len(before), len(upto))
    i = 0
    while i < n and before[i] == upto[i]:
        i += 1
    return i
