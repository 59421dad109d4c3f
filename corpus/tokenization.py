"""Records -> token ids + loss mask, on CPU, before any GPU sees them. Every problem is a per-sample error.

    TokenizeSettings                 what tokenization needs (picklable; shipped to Ray actors)
    SampleTokenizer(settings)        one tokenizer; .tokenize(payload) -> Tokenized, raises SampleError
    TokenizeStage                    the Ray Data stage: a pyarrow batch of records in, a batch of samples out

Record shapes, first match wins (a field that is null counts as absent, as Parquet columns leave them):
    {"input_ids": [int, ...], "loss_mask": [0/1, ...]?}    pre-tokenized; mask defaults to all ones
    {"messages": [{"role", "content"}, ...]}                OpenAI chat  -> chat template, mask on assistant tokens
                                                            (image_url parts on a vision-language target: kept)
    {"conversations": [{"from", "value"}, ...]}             ShareGPT     -> same
    {"prompt": str}                                         plain text with the tokenizer's special tokens; mask all 1
Samples longer than the limit (max_model_len minus max_tokens) are truncated or rejected (`overlength`).

A record's failure is its own row, never its block's: token ids must fit int64 (the column type), text must be valid
Unicode (no lone surrogates, which tokenizers refuse), and anything else a record makes go wrong is caught per record.
Error texts are made storable (valid UTF-8, cut to a bounded length) before they enter the block.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import pyarrow as pa

from corpus.chat import ChatEncoder, normalize_messages
from corpus.readers import RECORD_SCHEMA, invalid_unicode, short_repr, storable_text

logger = logging.getLogger(__name__)

SAMPLE_SCHEMA = pa.schema([
    ("sample_id", pa.string()), ("source", pa.string()),
    ("prompt_token_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.uint8())),
    ("num_prompt_tokens", pa.int64()), ("truncated", pa.bool_()), ("error", pa.string()),
    ("prompt_text", pa.string()), ("images", pa.list_(pa.string())),
])
"""A sample. An image sample (a chat record with image parts, on a vision-language target) also carries its
rendered prompt (one placeholder per image) and its images' references; its ids and loss mask are over that text
before the processor expands the placeholders, and it is neither truncated nor limited here: the worker expands it
(extractor.multimodal) and applies the limit then, never cutting an image."""
INT64_MAX = 2**63 - 1


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
    images: bool = False
    """The target takes images (a vision-language target): chat records' image parts are kept, not refused."""


@dataclass
class Tokenized:
    ids: list[int]
    mask: list[int]
    truncated: bool = False
    text: str | None = None
    """An image sample's rendered prompt (one placeholder per image); None for text samples."""
    images: list[str] | None = None
    """An image sample's image references (paths, file://, data: or http(s) URLs), in order."""


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
        """The record's sample; raises SampleError for anything wrong with it, whatever went wrong."""
        try:
            return self._tokenize(payload)
        except SampleError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever a record makes go wrong fails that record, not its block
            logger.exception("tokenizing a record failed unexpectedly")
            raise SampleError(f"tokenization failed unexpectedly ({type(e).__name__}: {e}); this is a bug in hsx: "
                              "please report it with this record") from e

    def _tokenize(self, payload: str) -> Tokenized:
        record, shape = parse_record(payload)
        if shape == "input_ids":
            ids, mask = pretokenized(record)
        elif shape in ("messages", "conversations"):
            problem = _unicode_problem(record[shape], shape)
            if problem:
                raise SampleError(problem)
            encoder = self._chat_encoder()
            images: list | None = [] if self.settings.images else None
            try:
                messages = normalize_messages({shape: record[shape]}, encoder.content_format, images)
            except ValueError as e:
                raise SampleError(str(e)) from e
            try:
                text, ids, mask = encoder.encode_text(messages)
            except ValueError as e:
                raise SampleError(str(e)) from e
            except Exception as e:  # noqa: BLE001 - a template or tokenizer failure fails this sample only
                raise SampleError(f"chat template failed: {type(e).__name__}: {e}") from e
            if images:  # expanded, limited and loaded by the worker (extractor.multimodal)
                bad = [i for i, ref in enumerate(images) if not isinstance(ref, str)]
                if bad:
                    raise SampleError(f"image {bad[0]} of the record is not a path or URL string")
                return Tokenized(ids, mask, text=text, images=list(images))
        else:  # "prompt"
            prompt = record["prompt"]
            if not isinstance(prompt, str):
                raise SampleError(f"field 'prompt' must be a string, got {type(prompt).__name__}")
            problem = _unicode_problem(prompt, "field 'prompt'")
            if problem:
                raise SampleError(problem)
            try:
                ids = list(self.tokenizer(prompt).input_ids)
            except Exception as e:  # noqa: BLE001
                raise SampleError(f"tokenizer failed: {type(e).__name__}: {e}") from e
            mask = [1] * len(ids)
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


SHAPES = ("input_ids", "messages", "conversations", "prompt")
"""The record fields that decide what a record is, first present wins."""


def parse_record(payload: str) -> tuple[dict, str]:
    """(record, shape): the record's JSON object and the first of SHAPES it holds (a null field counts as absent);
    SampleError naming what is wrong otherwise. How `hsx run` and `hsx regenerate` both read a record."""
    try:
        record = json.loads(payload)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, json's limits, nesting
        raise SampleError(f"the record is not JSON that can be read ({type(e).__name__}: {e})") from e
    if not isinstance(record, dict):
        raise SampleError(f"a record must be a JSON object, got {type(record).__name__}")
    shape = next((k for k in SHAPES if record.get(k) is not None), None)
    if shape is None:
        raise SampleError(f"record has none of the fields input_ids, messages, conversations, prompt "
                          f"(found {sorted(record)[:10]})")
    return record, shape


def _unicode_problem(value, where: str) -> str | None:
    """The first text in `value` (a string, or JSON lists and objects of them) that is not valid Unicode."""
    stack = [(where, value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            problem = invalid_unicode(v)
            if problem:
                return f"{path} is not valid Unicode text ({problem}); fix the broken \\u escape in the corpus"
        elif isinstance(v, dict):
            stack.extend((f"{path}.{k}", x) for k, x in reversed(v.items()))
            stack.extend((f"a key of {path}", k) for k in v)
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in reversed(list(enumerate(v))))
    return None


def pretokenized(record: dict) -> tuple[list[int], list[int]]:
    ids = record["input_ids"]
    if not isinstance(ids, list):
        raise SampleError(f"field 'input_ids' must be a list of token ids, got {type(ids).__name__}")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT64_MAX:
            raise SampleError(f"input_ids[{i}] is {short_repr(t)}; token ids are non-negative integers (indices into the "
                              "model's vocabulary, at most 2**63-1)")
    mask = record.get("loss_mask")
    if mask is None:
        return ids, [1] * len(ids)
    if not isinstance(mask, list):
        raise SampleError(f"field 'loss_mask' must be a list of 0/1 values, got {type(mask).__name__}")
    for i, m in enumerate(mask):
        if isinstance(m, float) or m not in (0, 1):
            raise SampleError(f"loss_mask[{i}] is {short_repr(m)}; give 0 or 1 per token")
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
        text, images = None, None
        if error is None:
            try:
                out = tokenizer.tokenize(payload)
                ids, mask, truncated = out.ids, out.mask, out.truncated
                text, images = out.text, out.images
            except SampleError as e:
                error = f"{source}: {e}"
        cols["sample_id"].append(sid)
        cols["source"].append(source)
        cols["prompt_token_ids"].append(ids)
        cols["loss_mask"].append(mask)
        cols["num_prompt_tokens"].append(len(ids))
        cols["truncated"].append(truncated)
        cols["error"].append(None if error is None else storable_text(error))
        cols["prompt_text"].append(text)
        cols["images"].append(images)
    return pa.Table.from_pydict(cols, schema=SAMPLE_SCHEMA)
