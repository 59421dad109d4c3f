"""Records -> token ids + loss mask, on CPU, before any GPU sees them. Every problem is a per-sample error.

    TokenizeSettings                 what tokenization needs (picklable; shipped to Ray actors)
    SampleTokenizer(settings)        one tokenizer; .tokenize(payload) -> Tokenized, raises SampleError
    TokenizeStage                    the Ray Data stage: a pyarrow batch of records in, a batch of samples out

Record shapes, first match wins:
    {"input_ids": [int, ...], "loss_mask": [0/1, ...]?}    pre-tokenized; mask defaults to all ones
    {"messages": [{"role", "content"}, ...]}                OpenAI chat  -> chat template, mask on assistant tokens
    {"conversations": [{"from", "value"}, ...]}             ShareGPT     -> same
    {"prompt": str}                                         plain text with the tokenizer's special tokens; mask all 1
Samples longer than the limit (max_model_len minus max_tokens) are truncated or rejected (`overlength`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa

from jobs.chat import ChatEncoder, normalize_messages
from jobs.corpus import RECORD_SCHEMA

SAMPLE_SCHEMA = pa.schema([
    ("sample_id", pa.string()), ("source", pa.string()),
    ("prompt_token_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.uint8())),
    ("num_prompt_tokens", pa.int64()), ("truncated", pa.bool_()), ("error", pa.string()),
])


class SampleError(ValueError):
    """A record that cannot become a sample; the message is what the manifest's `error` column shows."""


@dataclass(frozen=True)
class TokenizeSettings:
    tokenizer: str
    """Tokenizer folder or hub id (the model's)."""
    max_prompt_tokens: int
    """Longest prompt kept: max_model_len minus max_tokens."""
    overlength: str = "truncate"
    """"truncate" or "skip"."""
    chat_template: str | None = None
    """Template text (not a path) replacing the tokenizer's own."""
    revision: str | None = None
    trust_remote_code: bool = False


@dataclass
class Tokenized:
    ids: list[int]
    mask: list[int]
    truncated: bool = False


class SampleTokenizer:
    def __init__(self, settings: TokenizeSettings) -> None:
        from transformers import AutoTokenizer

        self.settings = settings
        self.tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer, revision=settings.revision,
                                                       trust_remote_code=settings.trust_remote_code)
        self._chat: ChatEncoder | None = None

    def _chat_encoder(self) -> ChatEncoder:
        if self._chat is None:
            try:
                self._chat = ChatEncoder(self.tokenizer, self.settings.chat_template)
            except ValueError as e:
                raise SampleError(str(e)) from e
        return self._chat

    def tokenize(self, payload: str) -> Tokenized:
        try:
            record = json.loads(payload)
        except json.JSONDecodeError as e:
            raise SampleError(f"malformed JSON: {e}") from e
        if "input_ids" in record:
            ids, mask = _pretokenized(record)
        elif "messages" in record or "conversations" in record:
            try:
                messages = normalize_messages(record)
            except ValueError as e:
                raise SampleError(str(e)) from e
            encoder = self._chat_encoder()
            try:
                ids, mask = encoder.encode(messages)
            except ValueError as e:
                raise SampleError(str(e)) from e
            except Exception as e:  # noqa: BLE001 - a template or tokenizer failure fails this sample only
                raise SampleError(f"chat template failed: {type(e).__name__}: {e}") from e
        elif "prompt" in record:
            prompt = record["prompt"]
            if not isinstance(prompt, str):
                raise SampleError(f"field 'prompt' must be a string, got {type(prompt).__name__}")
            try:
                ids = list(self.tokenizer(prompt).input_ids)
            except Exception as e:  # noqa: BLE001
                raise SampleError(f"tokenizer failed: {type(e).__name__}: {e}") from e
            mask = [1] * len(ids)
        else:
            raise SampleError(f"record has none of the fields input_ids, messages, conversations, prompt "
                              f"(found {sorted(record)[:10]})")
        if not ids:
            raise SampleError("empty sample (0 tokens); nothing to extract")
        limit = self.settings.max_prompt_tokens
        if len(ids) > limit:
            if self.settings.overlength == "skip":
                raise SampleError(f"over-length: {len(ids)} tokens > limit {limit} (max model length minus "
                                  "--max-tokens); pass --overlength truncate to keep the first tokens, or raise "
                                  "--max-model-len")
            return Tokenized(ids[:limit], mask[:limit], truncated=True)
        return Tokenized(ids, mask)


def _pretokenized(record: dict) -> tuple[list[int], list[int]]:
    ids = record["input_ids"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise SampleError("field 'input_ids' must be a list of non-negative integers")
    mask = record.get("loss_mask")
    if mask is None:
        return ids, [1] * len(ids)
    if not isinstance(mask, list) or not all(m in (0, 1) and not isinstance(m, float) for m in mask):
        raise SampleError("field 'loss_mask' must be a list of 0/1 values")
    if len(mask) != len(ids):
        raise SampleError(f"field 'loss_mask' has {len(mask)} values for {len(ids)} input_ids; give one per token")
    return ids, [int(m) for m in mask]


class TokenizeStage:
    """Ray Data stage: holds one tokenizer for the actor's lifetime."""

    def __init__(self, settings: TokenizeSettings) -> None:
        self.tokenizer = SampleTokenizer(settings)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return tokenize_table(self.tokenizer, batch)


def tokenize_table(tokenizer: SampleTokenizer, batch: pa.Table) -> pa.Table:
    cols: dict[str, list] = {name: [] for name in SAMPLE_SCHEMA.names}
    for sid, source, payload, error in zip(*(batch.column(n).to_pylist() for n in RECORD_SCHEMA.names)):
        ids: list[int] = []
        mask: list[int] = []
        truncated = False
        if error is None:
            try:
                out = tokenizer.tokenize(payload)
                ids, mask, truncated = out.ids, out.mask, out.truncated
            except SampleError as e:
                error = f"{source}: {e}"
        cols["sample_id"].append(sid)
        cols["source"].append(source)
        cols["prompt_token_ids"].append(ids)
        cols["loss_mask"].append(mask)
        cols["num_prompt_tokens"].append(len(ids))
        cols["truncated"].append(truncated)
        cols["error"].append(error)
    return pa.Table.from_pydict(cols, schema=SAMPLE_SCHEMA)
