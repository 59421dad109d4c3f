"""`hsx regenerate`'s settings (RegenerateConfig: the flags map one to one) and what the parts of the command take of
them: the server pool (PoolSettings), regenerate.json's settings (what a resume must ask for again).

    RegenerateConfig(...)               frozen; checked in __post_init__ (ValueError naming the flag)
        .check_required()               --server, --corpus, --output given
        .answer_cap()                   the most bytes of one answer read
        .pool_settings() -> PoolSettings
        .stop_strings()                 --extra-body's stop strings
        .spec(model) / .spec_changes(model, had)   regenerate.json's settings; how a resume's differ
    REASONING, API_KEY_ENVS
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from connectors.storage import parse_storage_options
from extractor.options import flag
from regeneration.answers import answer_cap
from regeneration.server_pool import PoolSettings

API_KEY_ENVS = ("HSX_REGENERATE_API_KEY", "OPENAI_API_KEY")
REASONING = ("keep", "strip")
_SPEC_KEYS = ("model", "max_tokens", "temperature", "top_p", "seed", "reasoning", "extra_body")
"""What a re-run must ask for as the first run did (the servers may change)."""


@dataclass(frozen=True)
class RegenerateConfig:
    """`hsx regenerate`: which servers, which model, which corpus, where the new corpus goes."""

    server: tuple[str, ...] = field(default=(), metadata={"cli": {"append": True, "metavar": "URL"}})
    """An OpenAI-compatible server (vLLM, SGLang, hsx serve): http://host:port, with or without /v1. Repeat the
    flag for several; the load is spread over them."""
    model: str | None = None
    """The served model name sent as `model`; default the one model the servers serve."""
    corpus: tuple[str, ...] = ()
    """Corpus files: JSONL (.jsonl, .json, optionally compressed) or Parquet, local or fsspec URLs, globs allowed."""
    output: str = ""
    """Where the regenerated corpus goes: a local folder or fsspec URL (re-running the same command resumes)."""
    api_key: str | None = field(default_factory=lambda: next(
        (os.environ[k] for k in API_KEY_ENVS if os.environ.get(k)), None))
    """Bearer key for the servers (default $HSX_REGENERATE_API_KEY, else $OPENAI_API_KEY)."""
    max_tokens: int = 1024
    """Most tokens generated per turn."""
    temperature: float = 0.0
    """Sampling temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    seed: int | None = None
    """Sampling seed: each request gets one derived from it, the sample id and the turn (reproducible whatever the
    server or the order)."""
    reasoning: str = "keep"
    """A reasoning model's reasoning_content: keep (stored with each turn) or strip (dropped)."""
    extra_body: dict[str, Any] = field(default_factory=dict)
    """JSON merged into every request body: a server's own fields, e.g. '{"chat_template_kwargs":
    {"enable_thinking": false}}' (vLLM, SGLang) or '{"top_k": 20}'."""
    concurrency: int = 32
    """Requests in flight per server."""
    request_timeout_s: float = 600.0
    """Longest wait for one answer."""
    retries: int = 5
    """Attempts of a request that gets a 500 or no answer in time (backoff doubling up to 30 s)."""
    server_wait_s: float = 300.0
    """How long requests wait for a server to answer again when none does, before they fail (a re-run retries
    them)."""
    id_field: str = "id"
    """Record field holding the sample id; records without it get a stable id from file and line/row."""
    corpus_storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for reading the corpus, as JSON."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for OUTPUT, as JSON."""
    flush_rows: int = 256
    """Commit the regenerated records at least every this many."""
    flush_seconds: float = 10.0
    """Commit at least this often; a crash redoes at most this much work."""
    retry_failed: bool = False
    """Regenerate again the records that failed in a way that repeats (the server refused them, malformed)."""
    progress: bool = True
    """Show a progress bar on stderr."""
    break_lease: bool = False
    """Take over OUTPUT's writer lease even though its holder looks alive (only when that job is gone)."""
    max_answer_bytes: int | None = None
    """Most bytes of one server answer read; a longer answer fails its record (default 8 MiB + 1 KiB per --max-tokens
    token: the prompt's token ids and the answer, with room to spare)."""
    tokenizer: str | None = None
    """The served model's tokenizer (a folder or Hugging Face name): each answer's token ids must decode to its text,
    or the record fails. Default: not checked (hsx run --regenerate-with checks with its own --model)."""
    tokenizer_revision: str | None = None
    """--tokenizer's revision (branch, tag or commit) for hub ids."""
    trust_remote_code: bool = False
    """Let --tokenizer run its own code."""

    def __post_init__(self) -> None:
        for name in ("server", "corpus"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(str(v) for v in value))
        for name in ("corpus_storage_options", "storage_options"):
            object.__setattr__(self, name, parse_storage_options(getattr(self, name), flag(name)))
        object.__setattr__(self, "extra_body", parse_storage_options(self.extra_body, "--extra-body",
                                                                     example='{"top_k": 20}'))
        if self.reasoning not in REASONING:
            raise ValueError(f"--reasoning {self.reasoning!r} is not a choice; use keep or strip")
        for name in ("max_tokens", "concurrency", "retries", "flush_rows"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout_s", "server_wait_s", "flush_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{flag(name)} must be > 0, got {getattr(self, name)}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty; pass --api-key KEY or unset $HSX_REGENERATE_API_KEY")
        if not self.id_field:
            raise ValueError("--id-field is empty; name the record field holding sample ids (default: id)")
        if self.max_answer_bytes is not None and self.max_answer_bytes < 1024:
            raise ValueError(f"--max-answer-bytes must be >= 1024, got {self.max_answer_bytes}")
        reserved = sorted(set(self.extra_body) & {"model", "messages", "prompt", "return_token_ids", "max_tokens",
                                                  "max_completion_tokens"})
        if reserved:
            raise ValueError(f"--extra-body sets {reserved}, which hsx regenerate sends itself (--max-tokens for the "
                             "length); leave them out")
        stop = self.extra_body.get("stop")
        if stop is not None and not isinstance(stop, str) and not (
                isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise ValueError(f"--extra-body's stop must be a string or a list of strings, got {stop!r}")

    def check_required(self) -> None:
        for name, what in (("server", "a server URL, e.g. --server http://127.0.0.1:8000"),
                           ("corpus", "corpus files"), ("output", "where the new corpus goes")):
            if not getattr(self, name):
                raise ValueError(f"{flag(name)} is required: {what}")

    def answer_cap(self) -> int:
        """The most bytes of one answer read (--max-answer-bytes, or its default from --max-tokens)."""
        return answer_cap(self.max_tokens, self.max_answer_bytes)

    def pool_settings(self) -> PoolSettings:
        """What the server pool (regeneration.server_pool) takes of these settings."""
        return PoolSettings(api_key=self.api_key, concurrency=self.concurrency, request_timeout_s=self.request_timeout_s,
                            retries=self.retries, server_wait_s=self.server_wait_s, answer_cap=self.answer_cap())

    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings --extra-body asks for (a server cuts them from the text, not from the ids)."""
        stop = self.extra_body.get("stop") or ()
        return (stop,) if isinstance(stop, str) else tuple(stop)

    def spec(self, model: str) -> dict[str, Any]:
        """regenerate.json's settings: what a resume must ask for again."""
        return {"model": model, "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed, "reasoning": self.reasoning, "extra_body": self.extra_body}

    def spec_changes(self, model: str, had: dict[str, Any]) -> list[str]:
        """How these settings differ from `had` (an earlier run's regenerate.json settings), one phrase per setting
        (the servers may change)."""
        wanted = self.spec(model)
        return [f"{k} {had.get(k)!r} there, {wanted[k]!r} now" for k in _SPEC_KEYS if had.get(k) != wanted[k]]
