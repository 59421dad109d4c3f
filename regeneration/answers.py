"""A server's answer as `hsx regenerate` reads it (regeneration/regenerate.py), and what it must be before its record is
kept: a server is a peer the job does not control, so its bytes are bounded, its JSON is read into a Turn only where
it has an OpenAI completion's shape, and its token ids are checked against what was asked and what it said.

    answer_cap(max_tokens, max_answer_bytes) -> int     the most bytes of one answer read (--max-answer-bytes)
    parse_completion(doc) / parse_chat(doc) -> Turn     a /v1/completions or /v1/chat/completions answer: text, the
                                                        prompt's and the generated token ids (None where the server
                                                        returns none), finish reason, reasoning, tool calls;
                                                        NotAnAPI where it is not shaped as OpenAI's
    load_tokenizer(name, revision, trust_remote_code)   --tokenizer, loaded (ValueError with the fix)
    ids_problem(ids, max_tokens, tokenizer)             why ids cannot be the answer's (too many, not in the
                                                        vocabulary), or None
    text_problem(tokenizer, ids, text, ...)             why ids do not decode to the answer's text, or None

Decoded ids and the server's text are compared as servers legitimately differ from a plain `decode`, and no more:
whitespace is ignored (a leading space that a SentencePiece decode drops, spaces around special tokens, tokenization
clean-up), U+FFFD is ignored (a character cut between tokens, which an incremental detokenizer holds back), the ids may
hold special tokens the text skips (the end of turn), and a stop string may follow the text (servers cut it from the
text, not from the ids; after it, at most what the last token adds). A chat answer may also hold its reasoning and
some markup around it (`<think>` tags, a channel name: at most MARKUP_CHARS characters beyond its reasoning, content
and stop string), and with tool calls their text, which a tool parser moved out of the content (each call's name
must be in the ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ANSWER_FLOOR_BYTES = 8 << 20
"""Room in every answer for what does not grow with --max-tokens: the prompt's token ids (a 128k-token prompt's ids
are about 1 MB of JSON), ids, names and usage."""
ANSWER_BYTES_PER_TOKEN = 1 << 10
"""Room per generated token: its text (JSON-escaped) and id, in content or reasoning, with room to spare."""
MARKUP_CHARS = 64
"""Characters (whitespace aside) a chat answer's ids may decode to beyond its reasoning and content: reasoning tags,
channel names."""


def answer_cap(max_tokens: int, max_answer_bytes: int | None = None) -> int:
    """The most bytes of one answer read: --max-answer-bytes, or the floor plus a KiB per token asked for."""
    return max_answer_bytes or ANSWER_FLOOR_BYTES + ANSWER_BYTES_PER_TOKEN * max_tokens


# -- what the answer says ---------------------------------------------------------------------------------------


class NotAnAPI(Exception):
    """An answer that is not an OpenAI API's."""


@dataclass
class Turn:
    """One answer: its text, the prompt's and the generated token ids (None: the server returned none), why it
    stopped, and a chat answer's reasoning and tool calls."""

    text: str
    prompt_ids: list[int] | None
    ids: list[int] | None
    finish_reason: str | None
    reasoning: str | None = None
    tool_calls: list | None = None


def _ids(value: Any, what: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                              for t in value):
        raise NotAnAPI(f"{what} is not a list of token ids")
    return value


def parse_completion(doc: dict[str, Any]) -> Turn:
    choice = doc["choices"][0]
    if not isinstance(choice, dict) or not isinstance(choice.get("text"), str):
        raise NotAnAPI("the completion's choices[0].text is not a string")
    return Turn(choice["text"], _ids(choice.get("prompt_token_ids"), "prompt_token_ids"),
                _ids(choice.get("token_ids"), "token_ids"), choice.get("finish_reason"))


def parse_chat(doc: dict[str, Any]) -> Turn:
    choice = doc["choices"][0]
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise NotAnAPI("the chat completion's choices[0].message is not an object")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise NotAnAPI("the chat completion's message content is not a string")
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    return Turn(content or "", _ids(doc.get("prompt_token_ids"), "prompt_token_ids"),
                _ids(choice.get("token_ids"), "token_ids"), choice.get("finish_reason"),
                reasoning if isinstance(reasoning, str) and reasoning else None,
                message.get("tool_calls") or None)


# -- whether it can be kept --------------------------------------------------------------------------------------


def load_tokenizer(name: str | None, revision: str | None = None, trust_remote_code: bool = False) -> Any | None:
    """The served model's tokenizer (--tokenizer), or None when not given; ValueError naming the fix."""
    if name is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - missing folder, no network, remote code refused: one message for all
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--tokenizer {name!r} cannot be loaded ({first}); pass the served model's folder or Hugging "
                         "Face name (--trust-remote-code if it needs its own code), or leave --tokenizer out and the "
                         "servers' token ids are not checked against their text") from None


def ids_problem(ids: list[int], max_tokens: int | None, tokenizer: Any | None) -> str | None:
    """Why `ids` cannot be the generated ids of a request for at most `max_tokens` tokens (None: any number), or
    None."""
    if max_tokens is not None and len(ids) > max_tokens:
        return f"{len(ids)} token ids for --max-tokens {max_tokens}, more than asked for (it ignores max_tokens)"
    if tokenizer is not None:
        vocab = len(tokenizer)
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            return (f"token id {bad}, outside the tokenizer's vocabulary ({vocab} ids): is --tokenizer the served "
                    "model's?")
    return None


def _plain(text: str) -> str:
    """`text` as compared: no whitespace, no U+FFFD."""
    return "".join(text.split()).replace("\ufffd", "")


def text_problem(tokenizer: Any, ids: list[int], text: str, *, finish_reason: str | None, chat: bool,
                 reasoning: str | None = None, tool_calls: list | None = None,
                 stop: tuple[str, ...] = ()) -> str | None:
    """Why `ids` do not decode to the answer's `text` (and `reasoning`), or None: see the module docstring for what
    is tolerated. `stop`: the request's stop strings, which may follow the text in the ids."""
    want, thought = _plain(text), _plain(reasoning or "")
    stops = [_plain(s) for s in stop if _plain(s)] if finish_reason == "stop" else []
    last = len(_plain(tokenizer.decode(ids[-1:]))) if stops else 0  # the token that completed a stop string
    room = MARKUP_CHARS + max(map(len, stops), default=0) + last
    for skip in (True, False):  # servers skip special tokens in the text by default; some are asked not to
        got = _plain(tokenizer.decode(ids, skip_special_tokens=skip))
        if not chat:  # the text, or the text cut before a stop string that the last token completed
            rest = got[len(want):] if got.startswith(want) else None
            if rest == "" or (rest and any(rest.startswith(s) and len(rest) - len(s) <= last for s in stops)):
                return None
            continue
        start = got.find(thought) if thought else 0
        at = got.find(want, start + len(thought)) if start >= 0 else -1
        if at < 0:
            continue
        if tool_calls:  # the call's text is in the ids, the parsed call beside the content: its name must be there
            names = [_plain(str((c.get("function") or {}).get("name") or "")) for c in tool_calls
                     if isinstance(c, dict)]
            if all(n in got for n in names):
                return None
            continue
        if len(got) - len(want) - len(thought) <= room:
            return None
    shown = tokenizer.decode(ids[:24], skip_special_tokens=True)
    what = "its text and reasoning" if thought else "its text"
    return (f"{len(ids)} token ids that do not decode to {what} (they decode to {shown[:80]!r}"
            f"{'...' if len(ids) > 24 else ''}, the text is {text[:80]!r}{'...' if len(text) > 80 else ''}): is "
            "--tokenizer the served model's?")
