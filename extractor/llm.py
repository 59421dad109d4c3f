"""`LLM`: the offline engine, with vLLM's API for the `extract_hidden_states` method and speculative decoding.

    llm = LLM(model=..., speculative_config={...}, kv_transfer_config=KVTransferConfig(...))
    outputs = llm.generate(prompts, sampling_params)    # one RequestOutput per prompt, in order
    outputs = llm.chat(messages, sampling_params)
    metrics = llm.get_metrics()                         # vLLM's counters (extractor.metrics.Counter / Vector)
    outputs[i].spec_decode                              # that request's share of them (speculative engines)

With speculative_config {"method": "ngram" | "draft_model" | a registered drafter family, ...} the engine decodes
speculatively instead of extracting (extractor/speculative.py: each step a proposer drafts up to k tokens per row, one
target forward verifies them, the rejected positions are rolled back). Such an engine writes no hidden states.

Per request, here: tokenize and check (extractor/request.py) -> connector.start_request (destination checked); then
the scheduler (extractor/scheduler.py): batched prefill, captured rows handed to the connector chunk by chunk ->
decode steps (rows of output tokens when `include_output_tokens`) -> connector.request_finished. Writes overlap compute; `generate` returns once every file is durable. A request that
fails (empty prompt, too long, rejected path, failed write) gets `error` set in its output; the rest complete.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from connectors import KVTransferConfig, RequestInfo
from connectors.base import NullConnector
from connectors.format import MM_EMBEDS, MM_TOKEN_TYPE_IDS, POSITION_IDS
from connectors.paths import PathInUse
from connectors.quant import write_failure
from extractor.chat_content import OPENAI, content_format, image_content, message_content, messages_for_template
from extractor.config import EngineConfig, speculative_config_from_dict
from extractor.media import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_REQUEST_IMAGE_BYTES, MediaPolicy, load_images
from extractor.metrics import Metric, SpecDecodingStats
from extractor.multimodal import MediaPrompt
from extractor.proposers import Proposer, make_proposer
from extractor.request import Request, check_request
from extractor.runner import ModelRunner
from extractor.sampling import SamplingParams, make_generator
from extractor.scheduler import Aborts, Scheduler
from extractor.stopping import Stopping

logger = logging.getLogger(__name__)

PromptType = str | Mapping[str, Any]
# vLLM LLM() arguments the seed scripts pass that change nothing hsx computes: accepted with one warning.
# value None = any value; otherwise the one value hsx can honour (another one is an error).
_IGNORED_ARGS = {"enforce_eager": None, "enable_chunked_prefill": None, "gpu_memory_utilization": None,
                 "disable_log_stats": None, "disable_chunked_mm_input": None, "tensor_parallel_size": 1}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    """"stop" (EOS, a stop token or a stop string), "length" (max_tokens or max_model_len), None when it failed."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended it (None: EOS, length, or failed), as vLLM reports it."""


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    kv_transfer_params: dict[str, Any] | None = None
    """{"hidden_states_path": url} once the file is durable; None when the request failed."""
    error: str | None = None
    """Why this request failed (hsx extension); None on success."""
    error_kind: str | None = None
    """What kind of failure (hsx extension; None on success): "invalid" (the request itself: its prompt, params or
    path), "path_in_use" (another request owns its hidden_states_path), "write_failed" (the file could not be made
    durable), "bad_states" (the states hold NaN, Inf or a layer of zeros: nothing written), "engine" (the forward
    failed), "aborted" (abort_request)."""
    write_seconds: float | None = None
    """Seconds its file took from the request's end to durable (hsx extension); None when nothing was written."""
    spec_decode: SpecDecodingStats | None = None
    """This request's share of get_metrics()'s counters (hsx extension): its drafts, draft tokens, accepted tokens
    and accepted per position (and, when it succeeded, its prompt and generated tokens); summed over a call's outputs
    they are what the engine's counters grew by. None for an engine that does not decode speculatively."""
    finished: bool = True

    @property
    def ok(self) -> bool:
        return self.error is None


class LLM:
    """Load a causal LM and extract hidden states of chosen layers for every request."""

    def __init__(self, model: str, *, speculative_config: Mapping[str, Any] | None = None,
                 kv_transfer_config: KVTransferConfig | None = None, dtype: str = "auto",
                 max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None, device: str | None = None, attn_implementation: str | None = None,
                 revision: str | None = None, tokenizer: str | None = None, trust_remote_code: bool = False,
                 target: str = "", limit_mm_per_prompt: Mapping[str, int] | None = None,
                 allowed_local_media_path: str | None = None, allow_media_fetch: bool = False,
                 allowed_media_domains: Sequence[str] | None = None, image_fetch_timeout_s: float | None = None,
                 max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
                 max_request_image_bytes: int = DEFAULT_MAX_REQUEST_IMAGE_BYTES, packing: str = "auto",
                 **unsupported: Any) -> None:
        cannot = {k: v for k, v in unsupported.items() if k not in _IGNORED_ARGS or
                  (_IGNORED_ARGS[k] is not None and v is not None and v != _IGNORED_ARGS[k])}
        if cannot:
            detail = ", ".join(f"{k}={v!r}" + (f" (only {k}={_IGNORED_ARGS[k]!r})" if k in _IGNORED_ARGS else "")
                               for k, v in sorted(cannot.items()))
            raise TypeError(f"LLM() got arguments hsx does not support: {detail}; supported: model, "
                            "speculative_config, kv_transfer_config, dtype, max_model_len, max_num_batched_tokens, "
                            "max_num_seqs, device, attn_implementation, revision, tokenizer, trust_remote_code, "
                            "target, limit_mm_per_prompt, allowed_local_media_path, allow_media_fetch, "
                            "allowed_media_domains, image_fetch_timeout_s, max_image_bytes, max_request_image_bytes, "
                            "packing "
                            f"(accepted and ignored: {', '.join(sorted(_IGNORED_ARGS))})")
        if unsupported:
            logger.warning("LLM() arguments %s have no effect in hsx and are ignored", sorted(unsupported))
        speculative, layer_ids = speculative_config_from_dict(speculative_config)
        optional = {"max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs}
        config = EngineConfig(
            model=str(model), layer_ids=layer_ids, dtype=dtype,
            max_model_len=max_model_len, device=device, attn_implementation=attn_implementation, revision=revision,
            tokenizer=tokenizer, trust_remote_code=trust_remote_code, speculative=speculative, target=target,
            packing=packing, media=MediaPolicy(limit_mm_per_prompt, allowed_local_media_path, allow_media_fetch,
                                               allowed_media_domains, image_fetch_timeout_s, max_image_bytes,
                                               max_request_image_bytes),
            **{k: v for k, v in optional.items() if v is not None})
        self._start(config, kv_transfer_config)

    @classmethod
    def from_config(cls, config: EngineConfig, kv_transfer_config: KVTransferConfig | None = None,
                    proposer: Proposer | None = None) -> LLM:
        """An engine from typed settings (what jobs hand their workers): nothing is re-parsed. `proposer` replaces
        the one config.speculative names (a drafter of your own; needs config.speculative for k)."""
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an extractor.EngineConfig, got {type(config).__name__}")
        if proposer is not None and config.speculative is None:
            raise ValueError("a proposer needs config.speculative (SpeculativeConfig with num_speculative_tokens)")
        llm = cls.__new__(cls)
        llm._start(config, kv_transfer_config, proposer)
        return llm

    def _start(self, config: EngineConfig, kv_transfer_config: KVTransferConfig | None,
               proposer: Proposer | None = None) -> None:
        self.config = config
        if config.speculative is not None and kv_transfer_config is not None:
            raise ValueError(f"speculative_config method {config.speculative.method!r} with a kv_transfer_config: "
                             "extraction (method extract_hidden_states) and speculative decoding are separate "
                             "engines in hsx, as in vLLM; build one LLM for each")
        self.kv_transfer_config = kv_transfer_config or KVTransferConfig()
        if not isinstance(self.kv_transfer_config, KVTransferConfig):
            raise TypeError(f"kv_transfer_config must be a connectors.KVTransferConfig, got "
                            f"{type(self.kv_transfer_config).__name__}")
        self.runner = ModelRunner(self.config)
        if config.speculative is not None:
            try:  # a cache that cannot forget rejected drafts would make speculative decoding silently wrong
                self.runner.prepare_speculation()
            except ValueError:
                self.runner.close()
                raise
        self.tokenizer = self.runner.tokenizer
        self.spec = self.runner.facts.file_spec()  # extractor.facts: the one derivation of a model's file spec
        spec = config.speculative
        self.connector = self.kv_transfer_config.create_connector(self.spec) if spec is None else NullConnector()
        self.spec = getattr(self.connector, "spec", None) or self.spec  # with the connector's storage dtype
        if self.spec.scaled and self.runner.device.type != "cpu":  # fp8 converted on the GPU, before the copy
            self.runner.device_storage = self.spec.storage_dtype
        self.proposer = None if spec is None else proposer or make_proposer(spec, self.runner)
        if self.proposer is not None:  # a speculative engine captures only what its proposer reads
            self.runner.set_capture(tuple(self.proposer.capture_layer_ids))
        self.stats = SpecDecodingStats(spec.num_speculative_tokens if spec else 0)
        self._stopping = Stopping(self.tokenizer, self.runner.eos_token_ids(), self.runner.max_model_len)
        self._counter = itertools.count()
        self._aborts = Aborts(self.connector)
        self._scheduler = Scheduler(config, self.runner, self.connector, self.proposer, self._stopping, self.stats,
                                    self._aborts)

    # -- public API -------------------------------------------------------------------------------------------------
    def get_tokenizer(self):
        return self.tokenizer

    def get_metrics(self) -> list[Metric]:
        """vLLM's offline metrics since the engine started: token counters and, when decoding speculatively,
        vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens (Counter, `.value`) and
        vllm:spec_decode_num_accepted_tokens_per_pos (Vector, `.values`, length k)."""
        return self.stats.metrics()

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        """Stop requests of a generate() call running on another thread (vLLM's LLMEngine.abort_request): a waiting
        request never runs, a running one leaves the batch at its next step; either writes no file and comes back
        with error_kind "aborted". Ids of no running generate() call, or of finished requests, are ignored."""
        self._aborts.request([request_id] if isinstance(request_id, str) else list(request_id))

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 request_ids: Sequence[str] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt, write one hidden-states file per request; outputs in prompt order."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        if request_ids is not None and len(request_ids) != len(prompts):
            raise ValueError(f"got {len(request_ids)} request_ids for {len(prompts)} prompts; pass one per prompt")
        rids = [str(r) for r in request_ids] if request_ids is not None else \
            [str(next(self._counter)) for _ in prompts]
        if len(set(rids)) != len(rids):
            raise ValueError("request_ids must be unique within one generate() call")
        with self._aborts.running(rids):
            return self._generate(rids, prompts, params, use_tqdm)

    def _generate(self, rids: list[str], prompts: list[PromptType], params: list[SamplingParams],
                  use_tqdm: bool) -> list[RequestOutput]:
        requests = [self._make_request(i, rid, p, sp) for i, (rid, p, sp) in enumerate(zip(rids, prompts, params))]
        runnable = [r for r in requests if r.error is None]
        progress = _progress(len(runnable), use_tqdm)
        self._scheduler.run(runnable, progress)
        progress.close()
        failures = self.connector.wait_for_save()
        for r in requests:
            if r.request_id in failures:
                r.error_kind, r.error = write_failure(failures[r.request_id])
            if r.error is None:
                self.stats.prompt_tokens += len(r.prompt_token_ids)
                self.stats.generation_tokens += len(r.output_ids)
                if r.spec_decode is not None:
                    r.spec_decode.prompt_tokens, r.spec_decode.generation_tokens = (len(r.prompt_token_ids),
                                                                                    len(r.output_ids))
        return [self._output(r) for r in requests]

    def chat(self, messages: Sequence[Mapping[str, str]] | Sequence[Sequence[Mapping[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (or `chat_template`) to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        prompts = []
        for c, conv in enumerate(conversations):
            checked, images = [], []
            for i, m in enumerate(conv):  # OpenAI content parts, as vLLM takes them (extractor.chat_content)
                where = f"conversation {c} message {i}" if len(conversations) > 1 else f"message {i}"
                if not isinstance(m, Mapping):
                    raise TypeError(f"{where} must be a dict with 'role' and 'content', got {type(m).__name__}")
                if m.get("content") is None:
                    checked.append(dict(m))
                elif self.runner.vision is not None:  # a vision-language target: image parts stay parts
                    content, found = image_content(m["content"], where)
                    checked.append({**m, "content": content})
                    images.extend(found)
                else:
                    checked.append({**m, "content": message_content(m["content"], where, self.config.model)})
            if images:  # the template places each image's placeholder; the processor expands it (per request)
                if content_format(template) != OPENAI:
                    raise ValueError(f"{self.config.model}'s chat template takes string content, so it cannot place "
                                     "images; pass a chat_template that renders image parts")
                text = self.tokenizer.apply_chat_template(messages_for_template(checked, template),
                                                          chat_template=chat_template, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt)
                prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
                continue
            ids = self.tokenizer.apply_chat_template(messages_for_template(checked, template),
                                                     chat_template=chat_template, tokenize=True,
                                                     add_generation_prompt=add_generation_prompt, return_dict=True)
            prompts.append({"prompt_token_ids": list(ids["input_ids"]),
                            "prompt": self.tokenizer.decode(ids["input_ids"])})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def shutdown(self) -> None:
        self.connector.shutdown()
        self.runner.close()

    # -- requests -----------------------------------------------------------------------------------------------------
    @staticmethod
    def _params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sampling_params = list(sampling_params)
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {n} prompts; pass one or one per prompt")
        return sampling_params

    def _make_request(self, index: int, rid: str, prompt: PromptType, params: SamplingParams) -> Request:
        req = Request(index, rid, None, [], params, spec_decode=None if self.proposer is None else
                      SpecDecodingStats(self.stats.num_speculative_tokens))
        try:
            self._tokenize(req, prompt)
            self._check(req)
            if self.proposer is not None and params.kv_transfer_params:
                raise ValueError("kv_transfer_params on a request to a speculative-decoding engine, which writes no "
                                 "hidden states; drop them, or extract with an extract_hidden_states engine")
            mask = None if req.loss_mask is None else torch.tensor(req.loss_mask, dtype=torch.uint8)
            # before the connector takes the request: nothing may fail between its start and the batch
            req.generator = make_generator(params) if params.max_tokens > 0 else None
            req.writes = self.connector.writes(params.sent_kv_transfer_params)
            if self.proposer is None and params.sent_kv_transfer_params is not None and not req.writes:
                raise ValueError("kv_transfer_params on a request to an engine that writes no files (its "
                                 "KVTransferConfig names the NullConnector); drop them, or build the engine with the "
                                 "hidden-states connector to write them")
            if req.writes:
                rows, kept = {}, {}
                if req.media is not None:  # an image prompt's record (extractor.multimodal, connectors.format)
                    rows = {MM_TOKEN_TYPE_IDS: req.media.mm_token_type_ids, POSITION_IDS: req.media.positions.T}
                    kept = {MM_EMBEDS: req.media.image_features}
                elif self.runner.vision is not None:  # a text prompt on a VL target: the same keys in every file
                    n = len(req.prompt_token_ids)
                    rows = {MM_TOKEN_TYPE_IDS: torch.zeros(n, dtype=torch.uint8),
                            POSITION_IDS: torch.arange(n)[:, None].expand(n, 3)}
                self.connector.start_request(RequestInfo(rid, len(req.prompt_token_ids), params.kv_transfer_params,
                                                         sample_id=req.sample_id, loss_mask=mask, prompt_rows=rows,
                                                         request_tensors=kept))
        except (ValueError, TypeError) as e:
            req.error = str(e)
            req.error_kind = "path_in_use" if isinstance(e, PathInUse) else "invalid"
            req.generator = None
            logger.warning("request %s failed: %s", rid, e)
        return req

    def _tokenize(self, req: Request, prompt: PromptType) -> None:
        if isinstance(prompt, str):
            req.prompt = prompt
            req.prompt_token_ids = list(self.tokenizer(prompt).input_ids)
            return
        if not isinstance(prompt, Mapping):
            raise TypeError(f"prompt must be a str or a dict with 'prompt' or 'prompt_token_ids', got "
                            f"{type(prompt).__name__}")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise TypeError("prompt_token_ids must be a list of ints")
            req.prompt_token_ids = list(ids)
            req.prompt = prompt.get("prompt")
        elif "prompt" in prompt:
            req.prompt = str(prompt["prompt"])
            req.prompt_token_ids = list(self.tokenizer(req.prompt).input_ids)
        else:
            raise ValueError(f"prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if prompt.get("multi_modal_inputs") is not None:  # processed by prepare_media
            media = prompt["multi_modal_inputs"]
            if self.runner.vision is None:
                raise ValueError(f"multi_modal_inputs given, but {self.config.model} is a text-only target")
            if not isinstance(media, MediaPrompt) or list(media.input_ids) != req.prompt_token_ids:
                raise TypeError("multi_modal_inputs must be what LLM.prepare_media returned, with its input_ids as "
                                "prompt_token_ids")
            req.media = media
        elif prompt.get("multi_modal_data") is not None:
            req.media = self.prepare_media(req.prompt, prompt["multi_modal_data"])
            req.prompt_token_ids = list(req.media.input_ids)
        self._refuse_bare_image_tokens(req)
        if prompt.get("loss_mask") is not None:
            req.loss_mask = [int(x) for x in prompt["loss_mask"]]
        if prompt.get("sample_id") is not None:
            req.sample_id = str(prompt["sample_id"])

    def _refuse_bare_image_tokens(self, req: Request) -> None:
        """Image placeholder tokens with no image behind them (token ids, or text naming the placeholder) would run
        on the placeholder's embedding: refused, as vLLM refuses them."""
        vision = self.runner.vision
        if vision is None or req.media is not None or vision.image_token_id not in req.prompt_token_ids:
            return
        raise ValueError(f"the prompt holds the image placeholder token {vision.image_token_id} but no image; give "
                         "its image in multi_modal_data (or an image part in a chat message), or drop the "
                         "placeholder")

    def prepare_media(self, prompt: str | None, multi_modal_data: Any, max_tokens: int | None = -1) -> MediaPrompt:
        """An image prompt processed as generate() runs it: `multi_modal_data` ({"image": image or [images]}) loaded
        under the engine's media policy (extractor.media.load_images) and processed with the prompt text (one
        placeholder per image) by the model's processor; ValueError names the image and the fix (an
        extractor.media.ImageUnavailable where a later try may succeed). generate() takes the result as
        {"prompt_token_ids": m.input_ids, "multi_modal_inputs": m}. PIL images given are checked against the size
        budgets and converted to RGB (a copy the caller may keep apart). `max_tokens`: a prompt whose images expand it
        past this many tokens is refused before the vision tower runs (default max_model_len; None: no limit, for a
        caller that truncates)."""
        self._vision()
        data = multi_modal_data
        if not isinstance(data, Mapping) or set(data) - {"image"}:
            other = sorted(set(data) - {"image"}) if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"multi_modal_data takes {{'image': image or [images]}}; got {other} (hsx takes images)")
        if prompt is None:
            raise ValueError("multi_modal_data needs the prompt as text ('prompt', one image placeholder per image), "
                             "not prompt_token_ids")
        refs = data["image"]
        refs = list(refs) if isinstance(refs, (list, tuple)) else [refs]
        return self.prepare_loaded_images(prompt, load_images(refs, self.config.media, "the prompt"), max_tokens)

    def prepare_loaded_images(self, prompt: str, images: list, max_tokens: int | None = -1) -> MediaPrompt:
        """prepare_media for `images` that extractor.media.load_images already returned under this engine's media
        policy (what `hsx serve` does on an image pool of its own, before its admission thread calls this): processed
        as they are, neither checked nor converted again, so each image is decoded once and held once."""
        if max_tokens == -1:
            max_tokens = self.runner.max_model_len
        vision = self._vision()
        try:
            return vision.prepare(prompt, images, "the prompt", max_tokens=max_tokens)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - the vision tower or the model's position code on these images:
            # this request's failure (an out-of-memory included), never the batch's
            raise ValueError(f"the prompt's images could not be processed: {type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200] if str(e) else ''}") from e

    def _vision(self):
        """The runner's vision part; ValueError on a text-only target."""
        if self.runner.vision is None:
            raise ValueError(f"multi_modal_data given, but {self.config.model} is a text-only target: hsx gives a "
                             "text-only target text alone (an image is never turned into text); drop it, or use a "
                             "vision-language target")
        return self.runner.vision

    def check_request(self, prompt_token_ids: Sequence[int], *, max_tokens: int | None, **limits) -> int:
        """extractor.request.check_request against this engine's model (max_model_len, vocabulary): RequestRejected
        naming the parameter, or max_tokens resolved (None = the rest of max_model_len). What `generate` checks per
        request, and what `hsx serve` checks before admitting one."""
        return check_request(prompt_token_ids, max_model_len=self.runner.max_model_len,
                             vocab_size=self.runner.vocab_size, max_tokens=max_tokens, **limits)

    def _check(self, req: Request) -> None:
        # generate() clamps max_tokens to the room left (as vLLM): only a prompt with no room at all is refused
        room = self.runner.max_model_len - len(req.prompt_token_ids)
        self.check_request(req.prompt_token_ids, max_tokens=min(req.params.max_tokens, max(room, 1)),
                           loss_mask=req.loss_mask)

    # -- execution ----------------------------------------------------------------------------------------------------
    def _output(self, r: Request) -> RequestOutput:
        text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True) if r.output_ids else ""
        if r.stop_hit:
            text = self._stopping.cut_at_stop(r, text)
        ok = r.error is None
        return RequestOutput(
            request_id=r.request_id, prompt=r.prompt, prompt_token_ids=r.prompt_token_ids,
            outputs=[CompletionOutput(0, text, list(r.output_ids), r.finish_reason if ok else None,
                                      r.stop_reason if ok else None)],
            kv_transfer_params=r.kv_transfer_params if ok else None, error=r.error,
            error_kind=None if ok else r.error_kind or "invalid",
            write_seconds=self.connector.write_seconds(r.request_id) if ok and r.writes else None,
            spec_decode=r.spec_decode)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc="requests", unit="req")
