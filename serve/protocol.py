"""The OpenAI wire format as vLLM's server shapes it: request bodies, error objects, response objects.

    CompletionBody / ChatBody     POST bodies, strict types (no "5" for 5, no true for 1); unknown fields ignored,
                                  fields hsx cannot honour (stream, n > 1, logprobs, ...) refused
    parse_body(cls, raw)          bytes -> body, or APIError 400 naming the field
    APIError                      an HTTP error with the OpenAI error object {"error": {message, type, param, code}}
    completion_response / chat_response
                                  the OpenAI objects plus vLLM's extensions: top-level kv_transfer_params
                                  {"hidden_states_path": ...}, prompt_token_ids (per choice for completions,
                                  top-level for chat) and token_ids when return_token_ids
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from extractor.chat_content import media_refusal

# status -> OpenAI error type
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error", 500: "server_error",
          503: "service_unavailable"}


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class KVTransferParams(_Body):
    """kv_transfer_params of one request (vLLM's keys)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    hidden_states_path: str | None = None
    include_output_tokens: bool = False
    overwrite: bool = False


class _Sampling(_Body):
    model: str
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=-(1 << 63), le=(1 << 64) - 1)  # torch.Generator.manual_seed's range
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    kv_transfer_params: KVTransferParams | None = None
    return_token_ids: bool = False
    # OpenAI fields hsx cannot honour: refused when set to anything but their no-op value
    stream: bool | None = None
    n: int | None = None
    logprobs: Any = None
    best_of: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict | None = None
    # vLLM's own sampling extensions (the client's extra_body) hsx's engine does not have: refused the same way
    min_tokens: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    use_beam_search: bool | None = None
    skip_special_tokens: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None

    def sampling(self) -> dict[str, Any]:
        """The sampling settings, as serve.engine.PromptRequest fields."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "stop_token_ids": list(self.stop_token_ids or []), "ignore_eos": self.ignore_eos,
                "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                "include_stop_str_in_output": self.include_stop_str_in_output}

    def unsupported(self) -> tuple[str, str] | None:
        """(field, reason) of the first setting hsx cannot honour, or None."""
        if self.stream:
            return "stream", "streaming is not supported; send stream=false (the response comes once the file is durable)"
        if self.n not in (None, 1):
            return "n", f"n={self.n}: one completion per prompt only; send n=1 or several prompts"
        if self.best_of not in (None, 1):
            return "best_of", "best_of is not supported; leave it out"
        if self.logprobs not in (None, False, 0):
            return "logprobs", "logprobs are not supported; leave them out (the hidden states are in the file)"
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0):
                return name, f"{name} is not supported; leave it out or send 0"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported; leave it out"
        no_ops = {"min_tokens": (None, 0), "min_p": (None, 0), "repetition_penalty": (None, 1),
                  "use_beam_search": (None, False), "skip_special_tokens": (None, True), "bad_words": (None, []),
                  "allowed_token_ids": (None,)}
        for name, fine in no_ops.items():
            if getattr(self, name) not in fine:
                return name, (f"{name}={getattr(self, name)!r} is not supported by hsx's engine; leave it out"
                              + (" (special tokens are always skipped in the text)" if name == "skip_special_tokens"
                                 else ""))
        return None


class CompletionBody(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(default=16, ge=0)
    """0 = prompt only (hsx and vLLM's extraction use); speculators sends 1."""
    echo: bool = False
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported; the prompt's token ids come back with return_token_ids"
        if self.suffix:
            return "suffix", "suffix is not supported; leave it out"
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if not self.prompt or isinstance(self.prompt[0], int):
            return [list(self.prompt)]  # a single token-id prompt (empty: rejected by the engine as empty)
        return list(self.prompt)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str
    detail: str | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL | str
    """{"url": ...} as OpenAI sends it, or the URL alone, as vLLM's chat parser also takes it (and hsx run does)."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_calls, ... reach the chat template
    role: str
    content: str | list[TextPart | ImagePart] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_and_images(cls, data: Any) -> Any:
        """An audio, video or file part: refused by name, not as a type error. Image parts pass here: the replica
        takes them to a vision-language target and refuses them for a text-only one."""
        content = data.get("content") if isinstance(data, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "image_url") and media_refusal([part], "") is not None:
                raise ValueError(f"this message's content part {j} is of type {kind or 'media'!r}: hsx serves text "
                                 "and images (image_url parts); drop that part")
        return data

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(isinstance(p, ImagePart) for p in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message for the chat template: text parts are joined or kept by the template's content format when
        it is applied (extractor.chat_content.messages_for_template), as in LLM.chat and the corpus readers."""
        return self.model_dump(exclude_none=True)


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_body(cls: type[_Body], raw: bytes) -> _Body:
    """A body from JSON bytes; APIError 400 naming the field (and what it got) otherwise."""
    try:
        body = cls.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                           code="invalid_json") from None
        if first["type"] == "model_type":
            raise APIError(400, "the request body must be a JSON object", code="invalid_body") from None
        param, union = _field_name(first["loc"])
        got = first.get("input")
        if union:  # pydantic reports the first branch of a union ("Input should be a valid string"): say all of them
            what = _UNION_HINTS.get(param.split(".")[-1].split("[")[0], "has the wrong type")
            raise APIError(400, f"{param}: {what} (got {_short(got)})", param=param, code="invalid_value") from None
        if first["type"] == "extra_forbidden":
            raise APIError(400, f"{param}: unknown key; kv_transfer_params takes hidden_states_path, "
                                "include_output_tokens, overwrite", param=param, code="invalid_value") from None
        detail = "" if first["type"] == "missing" else f" (got {_short(got)})"
        raise APIError(400, f"{param or 'body'}: {first['msg']}{detail}", param=param, code="invalid_value") from None
    bad = body.unsupported()
    if bad:
        raise APIError(400, bad[1], param=bad[0], code="unsupported")
    return body


_UNION_HINTS = {"prompt": "must be a string, a list of token ids, or a list of strings or of token-id lists",
                "content": "must be a string or a list of {\"type\": \"text\", \"text\": ...} parts",
                "stop": "must be a string or a list of strings"}
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[A-Z]\w*)$")


def _field_name(loc: tuple) -> tuple[str | None, bool]:
    """pydantic's location -> ("messages[0].content", whether a union branch was in it): branch tags dropped."""
    out, union = "", False
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _TYPE_TAG.match(part):
            union = True
        else:
            out += ("." if out else "") + part
    return out or None, union


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def completion_response(request_id: str, model: str, replies: list, return_token_ids: bool) -> dict[str, Any]:
    """The completion object for `replies` (one engine reply per prompt, in order)."""
    choices = []
    for i, r in enumerate(replies):
        choice = {"index": i, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason,
                  "stop_reason": r.stop_reason, "prompt_logprobs": None, "kv_transfer_params": _kv(r.path)}
        if return_token_ids:
            choice.update(prompt_token_ids=r.prompt_token_ids, token_ids=r.token_ids)
        choices.append(choice)
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": _usage(replies), "system_fingerprint": None,
            "kv_transfer_params": _kv(replies[0].path)}


def chat_response(request_id: str, model: str, reply, return_token_ids: bool) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", "content": reply.text, "tool_calls": []},
              "logprobs": None, "finish_reason": reply.finish_reason, "stop_reason": reply.stop_reason}
    out = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
           "choices": [choice], "usage": _usage([reply]), "system_fingerprint": None,
           "prompt_token_ids": reply.prompt_token_ids if return_token_ids else None,
           "kv_transfer_params": _kv(reply.path)}
    if return_token_ids:
        choice["token_ids"] = reply.token_ids
    return out


def _kv(path: str | None) -> dict[str, str] | None:
    """The response's kv_transfer_params: the file's path; None from a speculative server, which writes none."""
    return None if path is None else {"hidden_states_path": path}


def _usage(replies: list) -> dict[str, int]:
    prompt = sum(len(r.prompt_token_ids) for r in replies)
    completion = sum(len(r.token_ids) for r in replies)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def models_response(model: str, max_model_len: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": int(time.time()),
                                        "owned_by": "hsx", "root": model, "parent": None,
                                        "max_model_len": max_model_len}]}
