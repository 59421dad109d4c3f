"""`Engine`: one Ray Serve replica holding one `extractor.LLM`, gathering concurrent prompts into engine batches.

    PromptRequest       one prompt as the ingress sends it: text, token ids or chat messages, sampling, kv params
    EngineReply         what comes back: token ids, text, the durable file's path, or an error (status + message)
    Engine.extract(r)   validate and tokenize (text on a thread of its own; 400 before anything runs; a refused custom path
                        was answered 403 by the ingress; a chat's images fetched and decoded first on a pool of
                        IMAGE_LOADERS threads, so that a slow image holds its own request, never the others'), then
                        Engine._run_batch: Ray Serve's @serve.batch gathers up to max_num_seqs prompts for
                        batch_wait_timeout_s; batches formed while the engine is busy are merged into its next call;
                        one LLM.generate runs them (on a worker thread) and returns once every file is durable
    Engine.info()       model name, max_model_len, layer ids (for /v1/models)

A caller that goes away (client disconnect, timeout) cancels its `extract`: a prompt still waiting leaves the batch
before it runs (Ray Serve drops cancelled requests); one already running is aborted (`LLM.abort_request`: it leaves
the batch at the engine's next step and writes nothing); one that finished in the meantime has its file removed
(and forgotten by the connector, so a retry may write that path) as soon as the batch returns — no file is left for
a request nobody answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from connectors import storage
from connectors.writer import named_thread_pool
from extractor.chat_content import OPENAI, content_format, messages_for_template
from serve.config import ServeConfig
from serve.templates import TemplateRefused, check_request_template

logger = logging.getLogger(__name__)

IMAGE_LOADERS = 4
"""Threads of a replica that fetch and decode chats' images (each request waits on its own), and the most image
requests that hold decoded images at once (loaded, waiting for admission)."""


@dataclass
class PromptRequest:
    """One prompt for the engine. Exactly one of prompt (text), prompt_token_ids, messages is set."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens: int | None = 16
    """None = the rest of max_model_len (chat's default, as vLLM)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    kv_transfer_params: dict[str, Any] = field(default_factory=dict)
    files: bool = True
    """Whether it writes a file: False for a request without kv_transfer_params on a --no-files server."""


@dataclass
class EngineReply:
    request_id: str
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    path: str | None = None
    """The durable file (None on error)."""
    status: int = 200
    message: str | None = None
    param: str | None = None
    code: str | None = None
    batch_size: int = 0
    first_in_batch: bool = False
    """Exactly one reply per batch says so (the ingress counts batches by it)."""
    batch_seconds: float = 0.0
    """The engine call this prompt ran in: compute plus durable writes."""
    bytes_written: int = 0
    write_seconds: float | None = None
    """Its file: request end to durable (the connector's measure)."""
    replica: str = ""
    spec_decode: tuple | None = None
    """A speculative server's running counts on this replica (num_drafts, num_draft_tokens, num_accepted_tokens,
    accepted per position) as of this reply's batch; the ingress turns them into vLLM's counters."""
    discarded: int = 0
    """Files this replica has removed so far because their clients went away (cumulative)."""
    aborted: int = 0
    """Requests this replica has stopped mid-batch because their clients went away (cumulative)."""

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass
class _Item:
    """A prompt admitted to the batch queue; shared by the waiting caller and the batch (same process)."""

    request: PromptRequest
    prompt_token_ids: list[int]
    prompt_text: str | None
    params: Any  # extractor.SamplingParams
    media: Any = None  # an image prompt's processed inputs (extractor.multimodal.MediaPrompt)
    abandoned: bool = False
    reply: EngineReply | None = None


# apply_chat_template's own arguments, which decide what it returns: not the caller's to set through
# chat_template_kwargs (return_tensors="np" would hand back arrays, truncation would cut the prompt silently)
_CALL_KWARGS = {"tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
                "return_assistant_tokens_mask"}

# pre-tokenizers that keep every character of the text (Split and Punctuation unless their behavior removes them)
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Split", "Punctuation", "Digits"}


def max_bytes_per_token(tokenizer) -> int | None:
    """The most UTF-8 bytes of a text one token can stand for, where that is bounded, else None.

    Then a text of C characters has at least ceil(C / that) tokens, and a text too long for --max-prompt-tokens can be
    refused without tokenizing it (megabytes take seconds). Bounded for fast byte-level BPE tokenizers (GPT-2's and
    Llama-3's shapes): no normalizer, a byte-level pre-tokenizer and splits that keep every character, and every byte
    in the vocabulary (or an unknown token, unfused, for those it lacks), so each byte of the text is in exactly one
    token; and a token covers at most as many bytes as its vocabulary piece has characters (one per byte) or its
    added token's text has bytes. Not bounded (None) where a normalizer or pre-tokenizer may drop characters (NFKC or
    NFC, as Qwen2's; BERT's cleaning; whitespace splitting), where an added token absorbs the whitespace beside it
    (lstrip / rstrip), or where unknown characters fuse into one token."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # a tokenizer the tokenizers library cannot serialise: no claim
        return None
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    model = spec.get("model") or {}
    if (spec.get("normalizer") is not None or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict)
            or not any(step.get("type") == "ByteLevel" for step in steps)
            or any(step.get("type") not in _KEEPING_PRE_TOKENIZERS or step.get("behavior") == "Removed"
                   for step in steps)
            or (model.get("fuse_unk") and model.get("unk_token") is not None)):
        return None
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    from tokenizers.pre_tokenizers import ByteLevel

    if not set(ByteLevel.alphabet()) <= set(model["vocab"]) and (model.get("unk_token") is None
                                                                  or model.get("fuse_unk")):
        return None  # a byte the vocabulary lacks, with no unknown token for it, is dropped from the text
    return max([len(piece) for piece in model["vocab"]] + [len(a["content"].encode()) for a in added] + [1])


class _Rejected(Exception):
    def __init__(self, status: int, message: str, param: str | None, code: str) -> None:
        super().__init__(message)
        self.reply_fields = {"status": status, "message": message, "param": param, "code": code}


class Engine:
    """A Serve deployment class (wrapped by serve.deployment in serve.server)."""

    def __init__(self, config: ServeConfig) -> None:
        import torch

        from extractor import LLM  # torch: in the replica, not the ingress

        self.config = config
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.llm = LLM.from_config(config.engine_config(device), config.kv_transfer_config())
        self.tokenizer = copy.deepcopy(self.llm.tokenizer)  # admission's own: the engine thread decodes with its
        self.max_model_len = self.llm.runner.max_model_len
        self.max_prompt_tokens = min(config.max_prompt_tokens or self.max_model_len, self.max_model_len)
        self._bytes_per_token = max_bytes_per_token(self.tokenizer)
        self._fs = storage.open_url(config.output, config.storage_options)[0] if config.output else None
        self._executor = named_thread_pool(1, "hsx-engine")
        # text prompts and chat templates are tokenized on this thread, one at a time, not on the event loop: a
        # megabyte of text takes seconds, during which the loop would answer no other request (tokenizers releases
        # the GIL, so the loop and the engine thread run on meanwhile)
        self._admitter = named_thread_pool(1, "hsx-admit")
        # a chat's images are fetched and decoded on these threads, before its admission: a slow or hostile image
        # (a server dripping bytes, up to --image-fetch-timeout-s) holds its own request, never the admission thread
        self._image_loader = named_thread_pool(IMAGE_LOADERS, "hsx-images")
        self._image_slots = asyncio.Semaphore(IMAGE_LOADERS)  # from the load until the admission turned them into
        # the vision tower's features: a replica holds at most IMAGE_LOADERS x --max-request-image-bytes of images
        self._run_batch.set_max_batch_size(config.max_num_seqs)
        self._run_batch.set_batch_wait_timeout_s(config.batch_wait_timeout_s)
        self._batches = itertools.count()
        self._waiting: list[tuple[list[_Item], asyncio.Future]] = []
        self._runner: asyncio.Task | None = None
        self._discarded = 0
        self._aborted = 0
        try:
            self._replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # built outside Serve (a unit test of the class)
            self._replica = "local"

    def info(self) -> dict[str, Any]:
        spec = self.config.speculative
        return {"model": self.config.model_name, "max_model_len": self.max_model_len,
                "layer_ids": [] if spec else list(self.llm.spec.layer_ids), "dtype": self.llm.spec.dtype,
                "speculative": None if spec is None else {"method": spec.method, "k": spec.num_speculative_tokens}}

    async def extract(self, request: PromptRequest) -> EngineReply:
        item = await self._admitted(request)
        if isinstance(item, EngineReply):  # refused
            return item
        try:
            return await self._run_batch(item)
        except asyncio.CancelledError:
            item.abandoned = True  # a batch still running removes the file when it returns
            self.llm.abort_request(request.request_id)  # or, while it still decodes, stops it writing one
            if item.reply is not None:
                self._discard(item.reply)
            raise

    # -- admission: every user error answered here, before anything runs or is written -----------------------------
    async def _admitted(self, request: PromptRequest) -> _Item | EngineReply:
        """The request admitted to the batch queue, or its refusal. A chat's images load on the image pool first,
        then the prompt is tokenized on the admission thread: neither blocks the event loop, and an image that is
        slow to load holds only its own request."""
        loop = asyncio.get_running_loop()
        try:
            self._refuse_text_too_long(request)
            if self.llm.runner.vision is not None and _has_image_parts(request.messages):
                return await self._admitted_with_images(request, loop)
            if request.prompt_token_ids is not None and request.messages is None:  # nothing to tokenize
                return self._admit(request)
            return await loop.run_in_executor(self._admitter, self._admit, request)
        except _Rejected as e:
            return EngineReply(request.request_id, **e.reply_fields, replica=self._replica,
                               discarded=self._discarded, aborted=self._aborted)

    async def _admitted_with_images(self, request: PromptRequest, loop) -> _Item:
        """A chat with images: at most IMAGE_LOADERS at once hold decoded images, from their load (on the image pool)
        until the admission thread has turned them into the vision tower's features. A slot is given back when that
        work ends, not when the client leaves (its pool thread still holds the images until then), and waiting for
        one is bounded by the fetch deadline (503)."""
        deadline = self.llm.config.media.image_fetch_timeout_s
        try:
            await asyncio.wait_for(self._image_slots.acquire(), deadline)
        except asyncio.TimeoutError:
            raise _Rejected(503, f"the replica's {IMAGE_LOADERS} image loaders were busy for {deadline:g} s; retry "
                                 "later", "messages", "images_busy") from None

        def load_then_admit() -> _Item:
            return self._admitter.submit(self._admit, request, self._load_images(request)).result()

        try:
            work = self._image_loader.submit(load_then_admit)
        except BaseException:
            self._image_slots.release()
            raise
        work.add_done_callback(lambda _: loop.call_soon_threadsafe(self._image_slots.release))
        return await asyncio.wrap_future(work)

    def _refuse_text_too_long(self, r: PromptRequest) -> None:
        """A text prompt with more characters than max_prompt_tokens tokens can cover is refused untokenized."""
        if r.prompt is None or r.messages is not None or self._bytes_per_token is None:
            return
        floor = -(-len(r.prompt) // self._bytes_per_token)
        if floor > self.max_prompt_tokens:
            raise _Rejected(400, f"the prompt has at least {floor} tokens ({len(r.prompt)} characters, at most "
                                 f"{self._bytes_per_token} per token for this tokenizer), more than the limit of "
                                 f"{self.max_prompt_tokens} (--max-prompt-tokens / --max-model-len); shorten it",
                            "prompt", "prompt_too_long")

    def _load_images(self, r: PromptRequest) -> tuple[list[dict[str, Any]], list[Any]]:
        """On the image pool: the messages for the template and their images loaded (extractor.media.load_images,
        under the replica's media settings: allowed hosts, the fetch deadline, the decoded-size budgets); 400 naming
        the image when one cannot be loaded."""
        from extractor.media import load_images

        messages, refs = self._messages_with_images(r)
        try:
            return messages, load_images(refs, self.llm.config.media, "the prompt") if refs else []
        except ValueError as e:
            raise _Rejected(400, str(e), "messages", "invalid_image") from None

    def _admit(self, r: PromptRequest, loaded: tuple[list[dict[str, Any]], list[Any]] | None = None) -> _Item:
        """`loaded`: a chat's messages and images from _load_images (None: found here; a chat without image parts)."""
        from extractor import SamplingParams  # torch: in the replica, not the ingress
        from extractor.request import RequestRejected  # torch: in the replica, not the ingress

        text, media = r.prompt, None
        if r.messages is not None:
            ids, text, media = self._apply_chat_template(r, loaded)
        elif r.prompt_token_ids is not None:
            ids = list(r.prompt_token_ids)
        else:
            ids = list(self.tokenizer(r.prompt).input_ids)
        param = "messages" if r.messages is not None else "prompt"
        try:  # the engine's own check (extractor.request.check_request), with this server's prompt limit
            max_tokens = self.llm.check_request(ids, max_tokens=r.max_tokens, max_prompt_tokens=self.max_prompt_tokens,
                                                limit_flags="--max-prompt-tokens / --max-model-len",
                                                stop_token_ids=r.stop_token_ids, param=param)
        except RequestRejected as e:
            raise _Rejected(400, str(e), e.param, e.code) from None
        kv = dict(r.kv_transfer_params)  # a custom path was located (and a refused one answered 403) by the ingress
        sampling = {k: v for k, v in (("temperature", r.temperature), ("top_p", r.top_p), ("top_k", r.top_k))
                    if v is not None}
        try:
            params = SamplingParams(max_tokens=max_tokens, seed=r.seed, stop_token_ids=list(r.stop_token_ids),
                                    stop=list(r.stop), include_stop_str_in_output=r.include_stop_str_in_output,
                                    ignore_eos=r.ignore_eos, extra_args={"kv_transfer_params": kv} if r.files else {},
                                    **sampling)
        except (ValueError, TypeError) as e:
            raise _Rejected(400, str(e), None, "invalid_value") from None
        return _Item(r, ids, text, params, media)

    def _messages_with_images(self, r: PromptRequest) -> tuple[list[dict[str, Any]], list[Any]]:
        """The messages for the template and the images they bring, in order: image parts become {"type": "image"}
        on a vision-language target; on a text-only one the first image part is refused (400, naming it)."""
        from extractor.chat_content import image_content, media_refusal

        messages, images = [], []
        for i, m in enumerate(r.messages):
            content = m.get("content")
            if self.llm.runner.vision is None:
                refused = media_refusal(content, f"message {i}", self.config.model_name)
                if refused is not None:
                    raise _Rejected(400, refused, "messages", "invalid_content")
                messages.append(m)
                continue
            if content is None or isinstance(content, str):
                messages.append(m)
                continue
            try:
                parts, found = image_content(content, f"message {i}")
            except ValueError as e:
                raise _Rejected(400, str(e), "messages", "invalid_content") from None
            messages.append({**m, "content": parts})
            images.extend(found)
        return messages, images

    def _apply_chat_template(self, r: PromptRequest, loaded=None) -> tuple[list[int], str, Any]:
        """The prompt's token ids and text, and an image prompt's processed inputs (None without images); `loaded`:
        the messages and images _load_images gave (None: found here)."""
        if r.add_generation_prompt and r.continue_final_message:
            raise _Rejected(400, "add_generation_prompt and continue_final_message cannot both be true; set "
                                 "add_generation_prompt=false to continue the last message", "continue_final_message",
                            "invalid_value")
        if r.continue_final_message and r.messages[-1].get("role") != "assistant":
            raise _Rejected(400, "continue_final_message needs the last message to be the assistant's",
                            "continue_final_message", "invalid_value")
        clash = sorted(set(r.chat_template_kwargs or {}) & _CALL_KWARGS)
        if clash:
            raise _Rejected(400, f"chat_template_kwargs may not set {', '.join(clash)}: hsx sets them itself (the "
                                 "template's token ids, whole); pass only the template's own variables",
                            "chat_template_kwargs", "invalid_value")
        messages, images = loaded if loaded is not None else self._messages_with_images(r)
        if r.chat_template is not None:
            self._check_request_template(r)
        template = r.chat_template or getattr(self.tokenizer, "chat_template", None)
        if images and content_format(template) != OPENAI:
            raise _Rejected(400, "the chat template takes string content, so it cannot place images; send a "
                                 "chat_template that renders image parts", "messages", "chat_template_error")
        try:
            out = self.tokenizer.apply_chat_template(
                messages_for_template(messages, template), chat_template=r.chat_template,
                add_generation_prompt=r.add_generation_prompt, continue_final_message=r.continue_final_message,
                tokenize=not images, return_dict=not images, **(r.chat_template_kwargs or {}))
        except Exception as e:  # jinja errors, a tokenizer without a template, bad kwargs: all the caller's input
            raise _Rejected(400, f"the chat template failed on these messages: {type(e).__name__}: {e}",
                            "messages", "chat_template_error") from None
        if images:  # processed here, the vision tower included: loaded on the image pool (once), else loaded here
            try:
                media = self.llm.prepare_loaded_images(out, images, max_tokens=self.max_prompt_tokens) \
                    if loaded is not None else self.llm.prepare_media(out, {"image": images},
                                                                      max_tokens=self.max_prompt_tokens)
            except (ValueError, TypeError) as e:
                raise _Rejected(400, str(e), "messages", "invalid_image") from None
            return list(media.input_ids), out, media
        ids = list(out["input_ids"])
        return ids, self.tokenizer.decode(ids), None

    def _check_request_template(self, r: PromptRequest) -> None:
        """A client's chat_template: refused unless the server trusts them, and then rendered first under bounds
        (serve.templates): a template past them is refused before the tokenizer runs it."""
        if not self.config.trust_request_chat_template:
            raise _Rejected(400, "this server does not render a chat_template sent with the request (a Jinja program "
                                 "from the client); leave chat_template out to use the model's own, or start hsx "
                                 "serve with --trust-request-chat-template", "chat_template",
                            "chat_template_not_allowed")
        variables = {**self.tokenizer.special_tokens_map, **(r.chat_template_kwargs or {}), "messages": r.messages,
                     "tools": None, "documents": None, "add_generation_prompt": r.add_generation_prompt}
        limit = self.config.max_body_bytes
        if self._bytes_per_token is not None:
            limit = min(limit, self.max_prompt_tokens * self._bytes_per_token)
        try:
            check_request_template(r.chat_template, variables, timeout_s=self.config.chat_template_timeout_s,
                                   max_chars=limit)
        except TemplateRefused as e:
            raise _Rejected(400, f"{e}; nothing was run", "chat_template", "chat_template_too_costly") from None
        except Exception as e:  # the template's own errors: syntax, raise_exception, a sandbox refusal
            raise _Rejected(400, f"the chat template failed on these messages: {type(e).__name__}: {e}",
                            "chat_template", "chat_template_error") from None

    # -- the batch ------------------------------------------------------------------------------------------------
    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01, max_concurrent_batches=1024)  # sizes set in __init__
    async def _run_batch(self, items: list[_Item]) -> list[EngineReply]:
        """One batch Ray Serve gathered. Serve forms batches as requests arrive, whether or not the engine is free
        (max_concurrent_batches bounds only their execution), so the batches formed while the engine runs wait here
        and go into the next engine call together: one engine, full batches."""
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((items, done))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run_engine())
        return await done

    async def _run_engine(self) -> None:
        """Run the waiting batches, merged, one engine call at a time, until none wait."""
        loop = asyncio.get_running_loop()
        while self._waiting:
            groups, self._waiting = self._waiting, []
            items = [i for g, _ in groups for i in g if not i.abandoned]  # callers gone while waiting: dropped
            try:
                replies = await loop.run_in_executor(self._executor, self._generate, items) if items else []
            except Exception as e:  # the engine call itself failed: every caller of it gets the error
                for _, done in groups:
                    if not done.done():
                        done.set_exception(e)
                continue
            by_item = {id(i): r for i, r in zip(items, replies)}
            for item, reply in zip(items, replies):
                item.reply = reply
                if item.abandoned:
                    self._discard(reply)
            for reply in replies:
                reply.replica, reply.discarded, reply.aborted = self._replica, self._discarded, self._aborted
            for group, done in groups:
                if not done.done():  # never run (abandoned) prompts answer nobody: a placeholder keeps the shape
                    done.set_result([by_item.get(id(i)) or EngineReply(i.request.request_id, status=499)
                                     for i in group])

    def _generate(self, items: list[_Item]) -> list[EngineReply]:
        """On the engine thread: one LLM.generate over the batch; returns once every file is durable."""
        start = time.perf_counter()
        prompts = [{"prompt_token_ids": i.prompt_token_ids, "prompt": i.prompt_text, "multi_modal_inputs": i.media}
                   for i in items]
        outputs = self.llm.generate(prompts, [i.params for i in items],
                                    request_ids=[i.request.request_id for i in items])
        seconds = time.perf_counter() - start
        batch = next(self._batches)
        replies = []
        for n, (item, out) in enumerate(zip(items, outputs)):
            reply = EngineReply(item.request.request_id, list(out.prompt_token_ids), batch_size=len(items),
                                first_in_batch=n == 0, batch_seconds=seconds)
            if out.error is not None:
                status, code = _ERROR_STATUS.get(out.error_kind, (500, "engine_error"))
                self._aborted += out.error_kind == "aborted"
                reply.status, reply.message, reply.code = status, out.error, code
            else:
                completion = out.outputs[0]
                reply.token_ids, reply.text = list(completion.token_ids), completion.text
                reply.finish_reason, reply.stop_reason = completion.finish_reason, completion.stop_reason
                if out.kv_transfer_params:  # it wrote a file: its durable path
                    reply.path = out.kv_transfer_params["hidden_states_path"]
                    reply.write_seconds = out.write_seconds
                    try:
                        reply.bytes_written = storage.size_of(self._fs, _fs_path(self._fs, reply.path))
                    except OSError:
                        reply.bytes_written = 0
            replies.append(reply)
        if self.config.speculative is not None:  # the replica's running counts, as of this batch, on every reply
            stats = self.llm.stats  # (the ingress keeps the newest per replica: one whose caller left is not missed)
            counts = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, tuple(stats.accepted_per_pos))
            for reply in replies:
                reply.spec_decode = counts
        logger.debug("batch %d: %d prompts in %.3fs", batch, len(items), seconds)
        return replies

    def _discard(self, reply: EngineReply) -> None:
        """Remove the file of a request whose caller went away."""
        from connectors import cleanup_hidden_states  # torch: in the replica, not the ingress

        if reply.path is None:
            return
        try:
            cleanup_hidden_states(reply.path, storage_options=self.config.storage_options)
            self.llm.connector.forget(reply.path)
            self._discarded += 1
            logger.info("request %s: the client went away; removed %s", reply.request_id, reply.path)
        except OSError as e:
            logger.warning("request %s: the client went away, and removing %s failed: %s", reply.request_id,
                           reply.path, e)
        reply.path = None

    def __del__(self) -> None:  # Serve calls it on graceful shutdown: pending writes finish first
        for pool in (getattr(self, "_admitter", None), getattr(self, "_image_loader", None)):
            if pool is not None:  # a prompt still being tokenized or loaded has no answer to wait for
                with contextlib.suppress(Exception):  # at interpreter exit the executor's modules may be gone
                    pool.shutdown(wait=False, cancel_futures=True)
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()


def _has_image_parts(messages: list[dict[str, Any]] | None) -> bool:
    """Whether a chat has a part that may carry an image (its content a list with an image part)."""
    from extractor.chat_content import IMAGE_PARTS

    return any(isinstance(m, dict) and isinstance(m.get("content"), list) and any(
        isinstance(p, dict) and p.get("type") in IMAGE_PARTS for p in m["content"]) for m in messages or ())


def _fs_path(fs, path: str) -> str:
    return path if storage.is_local(fs) else fs._strip_protocol(path)


_ERROR_STATUS = {"invalid": (400, "invalid_request"), "path_in_use": (409, "path_in_use"),
                 "write_failed": (500, "write_failed"), "bad_states": (500, "bad_states"), "engine": (500, "engine_error"),
                 "aborted": (499, "aborted")}
"""(status, code) per RequestOutput.error_kind of an engine error that admission did not catch."""
