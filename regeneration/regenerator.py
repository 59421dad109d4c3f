"""One record of a corpus regenerated through the server pool, as `hsx regenerate` does it (regeneration/regenerate.py):
the record is read as `hsx run` reads it, each answer is asked for, read (regeneration/answers.py) and checked, and the
regenerated record is assembled.

    Regenerator(pool, config, model, tokenizer=None)
        await .run(sample_id, source, payload) -> Outcome   never raises for what one record or server does: the
                                                            error is the Outcome's (retry False when it repeats)
    Outcome                       the record settled: the regenerated record or the error, token counts, whether it
                                  carries the servers' own ids (exact) or why it keeps its text only
    BadRecord                     a record that cannot be regenerated (fails the same way every time)
    request_seed(seed, sample_id, turn)   one request's seed: the same whatever server or order
    exact_tokens(turns, reasoning)        a regenerated conversation's ids and loss mask from the servers' own ids

Turn replay: a chat's assistant turns are regenerated in order, each asked with the conversation so far (the earlier
turns already regenerated); its ids are the last request's prompt ids and generated ids, kept only where that prompt
renders every earlier turn's generated ids as they were generated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import xxhash

from corpus.chat import normalize_messages
from corpus.tokenization import SampleError, parse_record, pretokenized
from extractor.chat_content import OPENAI
from regeneration.answers import NotAnAPI, Turn, ids_problem, parse_chat, parse_completion, text_problem
from regeneration.config import RegenerateConfig
from regeneration.server_pool import BadAnswer, NoServer, Pool, Refused, Transient

_CHAT_KEYS = ("messages", "conversations")
"""The chat records' keys (OpenAI's and ShareGPT's), as `hsx run` reads them."""


class BadRecord(ValueError):
    """A record that cannot be regenerated (fails the same way every time)."""


@dataclass
class Outcome:
    """One input record settled: its regenerated record, or why it failed (retry False: it fails the same way every
    time); what PartWriter commits and the job counts."""

    sample_id: str
    source: str
    record: dict[str, Any] | None = None
    error: str | None = None
    retry: bool = True
    prompt_tokens: int = 0
    tokens: int = 0
    exact: bool = False
    text_only_reason: str | None = None


def request_seed(seed: int | None, sample_id: str, turn: int) -> int | None:
    """The seed of one request: the same for the same sample and turn, whatever server or order."""
    if seed is None:
        return None
    return xxhash.xxh3_64_intdigest(f"{seed}\x00{sample_id}\x00{turn}".encode("utf-8", "surrogatepass")) >> 1


class Regenerator:
    """Turns one record into its regenerated record through a Pool."""

    def __init__(self, pool: Pool, config: RegenerateConfig, model: str, tokenizer: Any | None = None) -> None:
        self.pool = pool
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        """--tokenizer: the answers' ids are decoded and compared with their text (None: not checked)."""

    def _body(self, sample_id: str, turn: int, **what: Any) -> dict[str, Any]:
        body = {"model": self.model, **what, "max_tokens": self.config.max_tokens,
                "temperature": self.config.temperature, "top_p": self.config.top_p, "return_token_ids": True,
                **self.config.extra_body}
        seed = request_seed(self.config.seed, sample_id, turn)
        if seed is not None:
            body["seed"] = seed
        return body

    async def run(self, sample_id: str, source: str, payload: str) -> Outcome:
        out = Outcome(sample_id, source)
        try:
            record, shape = parse_record(payload)  # as hsx run reads it
            if shape in _CHAT_KEYS:
                await self._chat(record, shape, out)
            else:
                await self._completion(record, shape, out)
        except (BadRecord, SampleError, Refused) as e:
            out.error, out.retry = f"{source}: {e}", False
        except (Transient, NoServer) as e:
            out.error = f"{source}: {e}"
        except NotAnAPI as e:
            out.error = f"{source}: the server's answer is not an OpenAI completion: {e}"
        except BadAnswer as e:
            out.error = f"{source}: {e}"
        return out

    def _check(self, turn: Turn, server: str, chat: bool) -> Turn:
        """The turn, once its token ids can be its answer: no more than --max-tokens, inside the tokenizer's
        vocabulary, decoding to its text (with --tokenizer); BadAnswer naming the server otherwise."""
        if turn.prompt_ids is not None:
            problem = ids_problem(turn.prompt_ids, None, self.tokenizer)
            if problem:
                raise BadAnswer(f"{server} answered prompt ids with a {problem}; the answer was dropped")
        if turn.ids is None:
            return turn
        problem = ids_problem(turn.ids, self.config.max_tokens, self.tokenizer)
        if problem is None and self.tokenizer is not None:
            problem = text_problem(self.tokenizer, turn.ids, turn.text, finish_reason=turn.finish_reason, chat=chat,
                                   reasoning=turn.reasoning, tool_calls=turn.tool_calls,
                                   stop=self.config.stop_strings())
        if problem:
            raise BadAnswer(f"{server} answered {problem}; the answer was dropped")
        return turn

    async def _completion(self, record: dict[str, Any], shape: str, out: Outcome) -> None:
        if shape == "input_ids":
            ids, mask = pretokenized(record)  # SampleError: the record fails for good
            prompt: Any = ids
        else:
            prompt = record["prompt"]
            if not isinstance(prompt, str):
                raise BadRecord(f"field 'prompt' must be a string, got {type(prompt).__name__}")
        doc, server = await self.pool.call("/completions", self._body(out.sample_id, 0, prompt=prompt))
        turn = self._check(parse_completion(doc), server, chat=False)
        new = dict(record)
        new["completion"] = turn.text
        new["finish_reason"] = turn.finish_reason
        if turn.ids is not None and (shape == "input_ids" or turn.prompt_ids is not None):
            prompt_ids = ids if shape == "input_ids" else turn.prompt_ids
            new["input_ids"] = [*prompt_ids, *turn.ids]
            if shape == "input_ids":
                new["loss_mask"] = [*mask, *([1] * len(turn.ids))]
            out.exact, out.prompt_tokens, out.tokens = True, len(prompt_ids), len(prompt_ids) + len(turn.ids)
        elif shape == "input_ids":
            raise Transient("the server returned no token ids (return_token_ids), which a token-id prompt needs: "
                            "use a server that returns them (vLLM >= 0.10.2, hsx serve)")
        else:  # text only: hsx run tokenizes prompt and answer as one text
            new["prompt"] = prompt + turn.text
            out.text_only_reason = "the server returned no token ids"
        out.record = new

    async def _chat(self, record: dict[str, Any], shape: str, out: Outcome) -> None:
        images: list[Any] = []
        try:  # content parts kept as parts: the server applies its template's rule, hsx run later its own; image
            # parts go to the server as they are (it loads them under its own media settings)
            messages = normalize_messages({shape: record[shape]}, OPENAI, images, keep_images=True)
        except ValueError as e:
            raise BadRecord(str(e)) from None
        if messages[-1]["role"] != "assistant":  # one answer to the last turn
            messages.append({"role": "assistant", "content": ""})
        # an assistant turn that opens the conversation answers nothing: kept as it is (not in the loss mask)
        todo = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
        if not todo:
            raise BadRecord("the conversation is one assistant turn; there is nothing to answer")
        turns: list[Turn] = []
        for n, i in enumerate(todo):
            asked = [_for_request(m) for m in messages[:i]]
            doc, server = await self.pool.call("/chat/completions", self._body(out.sample_id, n, messages=asked))
            turn = self._check(parse_chat(doc), server, chat=True)
            message = {k: v for k, v in messages[i].items() if k not in ("content", "reasoning_content", "tool_calls")}
            message.update(role="assistant", content=turn.text)
            if turn.reasoning is not None and self.config.reasoning == "keep":
                message["reasoning_content"] = turn.reasoning
            if turn.tool_calls:
                message["tool_calls"] = turn.tool_calls
            messages[i] = message
            turns.append(turn)
        new = {k: v for k, v in record.items() if k not in (*_CHAT_KEYS, "input_ids", "loss_mask")}
        new["messages"] = messages
        new["finish_reasons"] = [t.finish_reason for t in turns]
        ids, mask, why = exact_tokens(turns, self.config.reasoning)
        if images:  # the server's ids hold the images' expanded placeholders: hsx run processes the images itself
            ids, why = None, "the record holds images (hsx run loads and processes them again)"
        if ids is None:
            out.text_only_reason = why
        else:
            new["input_ids"], new["loss_mask"] = ids, mask
            out.exact, out.prompt_tokens, out.tokens = True, len(turns[-1].prompt_ids), len(ids)
        out.record = new


def _for_request(message: dict[str, Any]) -> dict[str, Any]:
    """A message as a request carries it: OpenAI's keys (a stored reasoning_content goes back, as vLLM's and the
    chat templates of reasoning models read it)."""
    return {k: v for k, v in message.items() if k in ("role", "content", "name", "tool_calls", "tool_call_id",
                                                      "reasoning_content")}


def exact_tokens(turns: list[Turn], reasoning: str) -> tuple[list[int] | None, list[int] | None, str | None]:
    """(ids, loss mask, None) of a regenerated conversation from the servers' own ids — the last request's prompt
    ids and generated ids, 1 over every turn's generated ids where the last prompt holds them as generated — or
    (None, None, why not)."""
    if any(t.ids is None or t.prompt_ids is None for t in turns):
        return None, None, "the server returned no token ids"
    if reasoning == "strip" and any(t.reasoning for t in turns):
        return None, None, "--reasoning strip (the generated ids hold the reasoning)"
    last = turns[-1]
    ids = [*last.prompt_ids, *last.ids]
    mask = [0] * len(ids)
    for t in turns:
        start, end = len(t.prompt_ids), len(t.prompt_ids) + len(t.ids)
        if ids[:start] != t.prompt_ids or ids[start:end] != t.ids:
            return None, None, "the chat template renders an earlier turn's generated ids differently"
        mask[start:end] = [1] * len(t.ids)
    return ids, mask, None
