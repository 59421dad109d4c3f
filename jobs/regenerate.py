"""`hsx regenerate`: the target's own answers, from the OpenAI-compatible servers users already run (vLLM, SGLang,
`hsx serve`), written as a new corpus that `hsx run` extracts prefill-only.

    RegenerateConfig(...)                 the command's settings (flags map one to one)
    prepare_regeneration(config) -> RegenerationPlan
                                          servers probed (each answers /v1/models and serves the model), OUTPUT's
                                          regenerate.json written or checked, the writer lease taken, settled ids
                                          loaded; ValueError for anything the user must fix (exit 2)
    execute_regeneration(plan) -> RegenerateResult
    regenerate(config)                    both

What a record becomes (the corpus kinds `hsx run` reads; the shape is decided as `hsx run` decides it):
    {"messages" | "conversations": [...]}  every assistant turn regenerated in order from the conversation so far
                                           (system, user and tool turns kept; a conversation ending in another role
                                           gets one answer appended) -> {"messages": regenerated, "input_ids": the
                                           last request's prompt ids + its generated ids, "loss_mask": 1 on each
                                           regenerated turn's generated ids}
    {"prompt": text}                       one completion -> {"prompt", "completion", "input_ids": prompt + output}
    {"input_ids": [...], "loss_mask"?}     one completion of those ids -> input_ids + output, mask + ones
The token ids are the server's own (`return_token_ids`, which vLLM and `hsx serve` honour): the extraction sees
exactly the tokens the target produced. Where a server returns no ids, or a later turn's prompt renders an earlier
turn's ids differently, the record keeps its text only (chats: `messages`; prompts: prompt + completion as one
prompt) and `hsx run` tokenizes it; the job says so once. `--reasoning keep` stores a reasoning model's
`reasoning_content` (or vLLM's newer `reasoning`) beside each turn's content, `strip` drops it (the record then keeps
text only: the ids hold the reasoning).

OUTPUT (local or any fsspec URL) is a run of its own kind, exactly once like `hsx run`'s:
    OUTPUT/regenerate.json                 what produced it (model, sampling, reasoning); a re-run checks it
    OUTPUT/data/part-<attempt>-<seq>.jsonl the regenerated records of one commit, one JSON object a line
    OUTPUT/manifest/part-*.parquet         connectors.run's manifest: per input record one row, "ok" (path = its
                                           part, offset/bytes = its line, checksum = the line's xxh3) or "failed"
                                           (the error; retry false when it fails the same way every time: the
                                           server refused the request, the record is malformed)
A part's lines are written (atomically) before the manifest part that commits them: a record counts only with its
"ok" row, and a part without one (the driver died in between) is an orphan that readers never see and the next run
removes. A re-run skips committed records and retries failed ones (not those failing for good, unless
--retry-failed); after any kill every input ends with exactly one settled row. `hsx run --corpus OUTPUT` reads the
committed records only (jobs/corpus_regenerated.py), `hsx status OUTPUT` counts them.

Servers (jobs/server_pool.py): each gets --concurrency requests at once; a request goes to the live server with the
most free slots. A server that stops answering (connection refused or reset, 503, 429) is set aside with a growing back-off and its
requests move to the others, or wait for it; a request fails (retried by the next run) only when no server answers
for --server-wait-s. 500s and timeouts are retried --retries times with backoff (tenacity). 400, 413 and 422 (prompt
too long, bad request) fail the record with the server's own message; other 4xx (Ray Serve's 404 while an app
redeploys) set the server aside like one that does not answer. A server that answers what is not an OpenAI API
is refused before work, or set aside for good mid-run. No answer is trusted further than it can be checked
(jobs/answers.py): one is read up to --max-answer-bytes and no further, no redirect is followed (a prompt never goes
to a server /v1/models did not vouch for), and generated ids beyond --max-tokens, or (with --tokenizer) ids that do
not decode to the answer's text, fail that record alone, naming the server; the others go on.

OUTPUT follows the rules of every hsx output folder (connectors.outputs): never a model's or a run's folder or inside
one, never over, in or around the corpus; a resume asks for the same settings and the same corpus files.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from connectors.manifest import FAILED, OK, RESULT_SCHEMA, new_attempt_id, referenced_paths
from connectors.run import RunDir
from extractor.options import flag
from jobs.corpus_regenerated import FINISHED, REGEN_JSON
from jobs.progress import progress_bar, set_total
from jobs.server_pool import BadAnswer, NoServer, Pool, PoolSettings, Refused, Transient, base_url

logger = logging.getLogger(__name__)

REGEN_FORMAT = "hsx.regenerated"
REGEN_VERSION = "1"
DATA_PREFIX = "data/part-"
API_KEY_ENVS = ("HSX_REGENERATE_API_KEY", "OPENAI_API_KEY")
REASONING = ("keep", "strip")
_CHAT_KEYS = ("messages", "conversations")
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
        from connectors.storage import parse_storage_options

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
        from jobs.answers import answer_cap

        return answer_cap(self.max_tokens, self.max_answer_bytes)

    def pool_settings(self) -> PoolSettings:
        """What the server pool (jobs.server_pool) takes of these settings."""
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


# -- talking to servers -------------------------------------------------------------------------------------------


class NotAnAPI(Exception):
    """An answer that is not an OpenAI API's."""


# -- one record ---------------------------------------------------------------------------------------------------


class BadRecord(ValueError):
    """A record that cannot be regenerated (fails the same way every time)."""


@dataclass
class Turn:
    text: str
    prompt_ids: list[int] | None
    ids: list[int] | None
    finish_reason: str | None
    reasoning: str | None = None
    tool_calls: list | None = None


@dataclass
class Outcome:
    sample_id: str
    source: str
    record: dict[str, Any] | None = None
    error: str | None = None
    retry: bool = True
    prompt_tokens: int = 0
    tokens: int = 0
    exact: bool = False
    text_only_reason: str | None = None


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


def request_seed(seed: int | None, sample_id: str, turn: int) -> int | None:
    """The seed of one request: the same for the same sample and turn, whatever server or order."""
    if seed is None:
        return None
    import xxhash

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
        from jobs.tokenization import SampleError, parse_record

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
        from jobs.answers import ids_problem, text_problem

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
        from jobs.tokenization import pretokenized

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
        from extractor.chat_content import OPENAI
        from jobs.chat import normalize_messages

        try:  # content parts kept as parts: the server applies its template's rule, hsx run later its own
            messages = normalize_messages({shape: record[shape]}, OPENAI)
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


# -- the output ---------------------------------------------------------------------------------------------------


def read_spec(run: RunDir) -> dict[str, Any] | None:
    """regenerate.json, or None; RunFormatError when it is not one this hsx reads."""
    from connectors.run import RunFormatError

    if not run.exists(REGEN_JSON):
        return None
    try:
        doc = json.loads(run.read_bytes(REGEN_JSON))
    except ValueError as e:
        raise RunFormatError(f"{run.url_of(REGEN_JSON)} is not JSON ({e}); the folder was damaged") from None
    if not isinstance(doc, dict) or doc.get("format") != REGEN_FORMAT:
        raise RunFormatError(f"{run.url_of(REGEN_JSON)} is not a regenerated corpus's (format "
                             f"{doc.get('format') if isinstance(doc, dict) else None!r})")
    if doc.get("version") != REGEN_VERSION:
        raise RunFormatError(f"{run.url_of(REGEN_JSON)} has version {doc.get('version')!r}; this hsx reads "
                             f"{REGEN_VERSION}: upgrade hsx")
    return doc


class PartWriter:
    """Buffers outcomes; each flush puts one data part (the ok records' lines) and then the manifest part that
    commits them."""

    def __init__(self, run: RunDir, attempt: str, retry_s: float = 120.0) -> None:
        from jobs.manifest import ManifestWriter

        self.run = run
        self.attempt = attempt
        self.retry_s = retry_s
        self.manifest = ManifestWriter(run, attempt, flush_rows=1 << 62, retry_s=retry_s)
        self.lines: list[bytes] = []
        self.rows: list[dict[str, Any]] = []
        self.seq = 0
        self.last = time.monotonic()
        self._lock = threading.Lock()  # a flush cancelled while in its thread may still run: the next one waits

    def add(self, o: Outcome) -> None:
        if o.record is None:
            self.rows.append({"sample_id": o.sample_id, "status": FAILED, "error": o.error, "source": o.source,
                              "retry": o.retry})
            return
        from connectors.format import data_checksum

        line = json.dumps(o.record, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n"
        self.rows.append({"sample_id": o.sample_id, "status": OK, "source": o.source, "bytes": len(line),
                          "num_tokens": o.tokens or None, "num_prompt_tokens": o.prompt_tokens or None,
                          "checksum": data_checksum([line]), "truncated": False, "_line": len(self.lines)})
        self.lines.append(line)

    def due(self, rows: int, seconds: float) -> bool:
        return len(self.rows) >= rows or (bool(self.rows) and time.monotonic() - self.last >= seconds)

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        from connectors.storage import retrying

        self.last = time.monotonic()
        if not self.rows:
            self.manifest.flush()  # a part whose put raised earlier
            return
        if self.lines:
            name = f"{DATA_PREFIX}{self.attempt}-{self.seq:06d}.jsonl"
            offsets = [0]
            for line in self.lines:
                offsets.append(offsets[-1] + len(line))
            for row in self.rows:
                if "_line" in row:
                    row.update(path=name, offset=offsets[row.pop("_line")])
            retrying("data part", self.run.url_of(name), 1, 0.2, self.retry_s)(self.run.put, name, b"".join(self.lines))
        self.seq += 1
        self.manifest.add(pa.Table.from_pylist(self.rows, schema=RESULT_SCHEMA))  # every row, whatever its keys
        self.manifest.flush()
        self.lines, self.rows = [], []


def remove_orphans(run: RunDir) -> int:
    """Data parts no manifest row points at (a driver died between a part and its commit): removed."""
    names = [f"data/{n}" for n in run.list("data") if f"data/{n}".startswith(DATA_PREFIX)]
    if not names:
        return 0
    live = referenced_paths(run, DATA_PREFIX)
    gone = 0
    for name in names:
        if name not in live:
            with contextlib.suppress(FileNotFoundError):
                run.fs.rm(run.path(name))
                gone += 1
    return gone


# -- the job ------------------------------------------------------------------------------------------------------


@dataclass
class RegenerationPlan:
    config: RegenerateConfig
    output: RunDir
    model: str
    servers: list[str]
    files: list
    done: Any
    attempt: str
    lease: Any
    new: bool
    tokenizer: Any = None
    """--tokenizer, loaded (None: the answers' ids are not checked against their text)."""


@dataclass
class RegenerateResult:
    output: str
    attempt: str
    new: bool = True
    records: int = 0
    """Records read this run."""
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    """Records an earlier run settled."""
    duplicates: int = 0
    exact: int = 0
    """Ok records that carry the servers' own token ids."""
    text_only: Counter = field(default_factory=Counter)
    """Why records keep text only: count."""
    tokens: int = 0
    requests: int = 0
    seconds: float = 0.0
    failures: list[tuple[str, str]] = field(default_factory=list)
    per_server: dict[str, tuple[int, float]] = field(default_factory=dict)
    """url -> (answers, seconds spent waiting on them)."""
    stopped: str | None = None
    """Why the run stopped early (the lease was lost, a storage outage), or None."""
    text_checked: bool = False
    """Whether the answers' token ids were decoded and compared with their text (--tokenizer)."""

    def lines(self) -> list[str]:
        secs = max(self.seconds, 1e-9)
        out = [f"hsx regenerate {'finished' if self.new else 'resumed and finished'} in {self.seconds:.1f}s: "
               f"{self.ok} ok, {self.failed} failed, {self.skipped} skipped (already done) of {self.records} records"
               + (f" ({self.duplicates} duplicate ids)" if self.duplicates else ""),
               f"  {self.requests} requests ({self.requests / secs:.1f}/s), {self.tokens} tokens stored "
               f"({self.tokens / secs:.0f}/s); {self.exact} of {self.ok} with the servers' own token ids"]
        if self.exact and not self.text_checked:
            out.append("  the servers' token ids were not checked against their text: pass --tokenizer (the served "
                       "model's) to check them")
        for why, n in self.text_only.items():
            out.append(f"  text only ({n}): {why}; hsx run tokenizes their text (tokens may differ from those the "
                       "target produced)")
        for url, (n, s) in self.per_server.items():
            out.append(f"  server {url}: {n} answers" + (f", {s / n:.2f} s each" if n else ""))
        out.append(f"  output:   {self.output}  (hsx run --corpus {self.output}; hsx status {self.output})")
        if self.failures:
            out.append(f"  first failures ({len(self.failures)} of {self.failed}):")
            out += [f"    {sid}: {err}" for sid, err in self.failures]
        if self.stopped:
            out.append(f"  STOPPED EARLY: {self.stopped}; re-run the same command to finish")
        return out


def prepare_regeneration(config: RegenerateConfig, within: str | None = None) -> RegenerationPlan:
    """Everything checked before the first request (ValueError for what the user must fix). `within`: the folder
    OUTPUT may lie inside (hsx run --regenerate-with's OUTPUT, which holds its regeneration)."""
    from connectors.lease import WriterLease
    from connectors.run import RUN_JSON, RunFormatError
    from jobs.answers import load_tokenizer
    from jobs.corpus import expand_corpus
    from jobs.registry import DoneSet

    config.check_required()
    servers = [base_url(u) for u in config.server]
    if len(set(servers)) != len(servers):
        raise ValueError(f"--server lists a server twice: {servers}")
    files = expand_corpus(config.corpus, config.corpus_storage_options)
    output = RunDir(config.output, config.storage_options)
    check_output(output, config, files, within)
    output.check_reachable()
    if output.exists(RUN_JSON):
        raise ValueError(f"{output.url} holds an extraction run (run.json); write the regenerated corpus elsewhere")
    tokenizer = load_tokenizer(config.tokenizer, config.tokenizer_revision, config.trust_remote_code)
    served = asyncio.run(_probe(servers, config))
    model = config.model
    if model is None:
        names = sorted({m for ids in served.values() for m in ids})
        if len(names) != 1:
            raise ValueError(f"the servers serve {names}; pass --model NAME")
        model = names[0]
    for url, ids in served.items():
        if model not in ids:
            raise ValueError(f"--server {url} does not serve model {model!r} (it serves {ids}); pass --model with "
                             "one of those, or drop the server")
    try:
        spec = read_spec(output)
    except RunFormatError as e:
        raise ValueError(str(e)) from None
    wanted = config.spec(model)
    if spec is not None:
        had = spec.get("settings", {})
        diff = [f"{k} {had.get(k)!r} there, {wanted[k]!r} now" for k in _SPEC_KEYS if had.get(k) != wanted[k]]
        diff += _corpus_difference(spec.get("corpus"), [f.url for f in files])
        if diff:
            raise ValueError(f"{output.url} was regenerated with other settings: " + "; ".join(diff) + ". Re-run "
                             "with the same settings and --corpus to resume it, or write to another --output")
    attempt = new_attempt_id()
    lease = WriterLease.acquire(output, attempt, break_lease=config.break_lease, command="hsx regenerate",
                                harm="Two writers would regenerate records twice")
    try:
        if spec is None:
            output.put(REGEN_JSON, json.dumps({"format": REGEN_FORMAT, "version": REGEN_VERSION, "settings": wanted,
                                               "corpus": [f.url for f in files], "created_at": time.time()},
                                              indent=2).encode())
        with contextlib.suppress(FileNotFoundError):
            output.fs.rm(output.path(FINISHED))
        removed = remove_orphans(output)
        if removed:
            logger.info("removed %d uncommitted data part(s) of an attempt that died", removed)
        done = DoneSet.load(output, retry_failed=config.retry_failed)
    except BaseException:
        lease.release()
        raise
    return RegenerationPlan(config, output, model, servers, files, done, attempt, lease, spec is None, tokenizer)


def check_output(output: RunDir, config: RegenerateConfig, files: list, within: str | None) -> None:
    """The rules every output folder of hsx follows (connectors.outputs.OutputFolder): never a model's or a run's
    folder or inside one, never over, in or around the corpus; new, empty or an earlier regeneration (its
    regenerate.json). `within`: the run OUTPUT of hsx run --regenerate-with, whose checks cover a regeneration inside
    it. Object-store outputs have no folders to check."""
    from connectors.outputs import OutputFolder, corpus_inputs, within_output

    if not output.local or within_output(config.output, within):
        return
    OutputFolder(config.output, command="regenerate", flag="--output",
                 inputs=corpus_inputs(config.corpus, [f.url for f in files]), legacy_markers=(REGEN_JSON,)).check()


def _corpus_difference(had: Any, now: list[str]) -> list[str]:
    """What differs between the corpus files regenerate.json names and those given now (resuming with another corpus
    would add its records to this one)."""
    if not isinstance(had, list):
        return []
    added, gone = sorted(set(now) - set(had)), sorted(set(had) - set(now))

    def show(urls: list[str]) -> str:
        return ", ".join(urls[:3]) + (f" and {len(urls) - 3} more" if len(urls) > 3 else "")

    return ([f"corpus: {len(added)} file(s) not in it now given ({show(added)})"] if added else []) + \
        ([f"corpus: {len(gone)} of its file(s) not given now ({show(gone)})"] if gone else [])


async def _probe(servers: list[str], config: RegenerateConfig) -> dict[str, list[str]]:
    async with Pool(servers, config.pool_settings()) as pool:
        return await pool.probe()


def execute_regeneration(plan: RegenerationPlan, stop: threading.Event | None = None) -> RegenerateResult:
    """Regenerate every record not settled; commits as it goes; releases the lease; writes FINISHED. Setting `stop`
    ends it early (what was answered is committed; RuntimeError)."""
    result = RegenerateResult(plan.output.url, plan.attempt, new=plan.new, text_checked=plan.tokenizer is not None)
    start = time.monotonic()
    try:
        with plan.lease.keep_alive() as lost:
            asyncio.run(_run(plan, result, lost, stop or threading.Event()))
    finally:
        result.seconds = time.monotonic() - start
        with contextlib.suppress(Exception):
            plan.output.put(FINISHED, json.dumps({"attempt": plan.attempt, "ok": result.ok, "failed": result.failed,
                                                  "stopped": result.stopped}).encode())
        plan.lease.release()
    return result


def regenerate(config: RegenerateConfig) -> RegenerateResult:
    return execute_regeneration(prepare_regeneration(config))


async def _run(plan: RegenerationPlan, result: RegenerateResult, lost, stop: threading.Event) -> None:
    from jobs.corpus import count_records, read_records
    from jobs.registry import id_keys

    config = plan.config
    writer = PartWriter(plan.output, plan.attempt)
    queue: asyncio.Queue = asyncio.Queue(maxsize=4 * config.concurrency * len(plan.servers))
    outcomes: asyncio.Queue = asyncio.Queue()
    seen: set[int] = set()
    warned: set[str] = set()
    bar = progress_bar("regenerating", "record", config.progress)

    async def read() -> None:
        for file in plan.files:
            blocks = read_records(file, config.id_field, config.corpus_storage_options)
            while (block := await asyncio.to_thread(next, blocks, None)) is not None:
                keys = id_keys([r.sample_id for r in block])
                settled = plan.done.contains(keys)
                for record, key, done in zip(block, keys.tolist(), settled):
                    result.records += 1
                    if done:
                        result.skipped += 1
                        bar.update(1)
                        continue
                    if key in seen:
                        result.duplicates += 1
                        await outcomes.put(Outcome(record.sample_id, record.source, retry=False, error=(
                            f"{record.source}: duplicate sample id {record.sample_id!r} (another record has it); "
                            "give each record its own id")))
                        continue
                    seen.add(key)
                    if record.error is not None:
                        await outcomes.put(Outcome(record.sample_id, record.source, error=record.error, retry=False))
                        continue
                    await queue.put(record)

    async def work(regen: Regenerator) -> None:
        while (record := await queue.get()) is not None:
            await outcomes.put(await regen.run(record.sample_id, record.source, record.payload))

    async def commit() -> None:
        while True:
            try:
                o = await asyncio.wait_for(outcomes.get(), timeout=1.0)
            except asyncio.TimeoutError:
                o = None
            if o is StopAsyncIteration:
                break
            if o is not None:
                _count(result, o, warned)
                writer.add(o)
                bar.update(1)
                bar.set_postfix_str(f"ok={result.ok} failed={result.failed}", refresh=False)
            if lost.is_set():
                raise RuntimeError("the writer lease was lost")
            if stop.is_set():
                raise RuntimeError("stopped")
            if writer.due(config.flush_rows, config.flush_seconds):
                await asyncio.to_thread(writer.flush)
        await asyncio.to_thread(writer.flush)

    async with Pool(plan.servers, config.pool_settings()) as pool:
        regen = Regenerator(pool, config, plan.model, plan.tokenizer)
        committer = asyncio.create_task(commit())
        total = asyncio.create_task(asyncio.to_thread(lambda: sum(count_records(f, config.corpus_storage_options)
                                                                  for f in plan.files)))
        total.add_done_callback(lambda t: t.cancelled() or t.exception() is not None or set_total(bar, t.result()))
        workers = [asyncio.create_task(work(regen)) for _ in range(config.concurrency * len(plan.servers))]
        reader = asyncio.create_task(read())
        try:
            await _first_error(reader, committer)
            for _ in workers:
                await queue.put(None)
            await _first_error(asyncio.gather(*workers), committer)
            await outcomes.put(StopAsyncIteration)
            await committer
        except BaseException as e:  # Ctrl-C, the lease lost, storage down, a bug: keep what was answered, stop
            result.stopped = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            for task in (reader, *workers, committer):
                task.cancel()
            await asyncio.gather(reader, *workers, committer, return_exceptions=True)
            if not lost.is_set():
                while not outcomes.empty():
                    o = outcomes.get_nowait()
                    if isinstance(o, Outcome):
                        _count(result, o, warned)
                        writer.add(o)
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(writer.flush)
            raise
        finally:
            bar.close()
            total.cancel()
            result.requests = sum(s.answered for s in pool.servers)
            result.per_server = {s.url: (s.answered, s.seconds) for s in pool.servers}


async def _first_error(task, committer: asyncio.Task) -> None:
    """Wait for `task`; the committer failing (storage, lease) stops the wait with its error."""
    task = asyncio.ensure_future(task)
    done, _ = await asyncio.wait({task, committer}, return_when=asyncio.FIRST_COMPLETED)
    if committer in done and task not in done:
        task.cancel()
        committer.result()
        raise RuntimeError("the commit loop ended early")
    task.result()


def _count(result: RegenerateResult, o: Outcome, warned: set[str]) -> None:
    if o.record is None:
        result.failed += 1
        if len(result.failures) < 10:
            result.failures.append((o.sample_id, o.error or ""))
        return
    result.ok += 1
    result.tokens += o.tokens
    if o.exact:
        result.exact += 1
    elif o.text_only_reason:
        result.text_only[o.text_only_reason] += 1
        if o.text_only_reason not in warned:
            warned.add(o.text_only_reason)
            logger.warning("records keep their text only: %s (first: %s); hsx run tokenizes them", o.text_only_reason,
                           o.sample_id)


