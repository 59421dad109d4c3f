"""`VllmEngine`: real vLLM behind the engine API hsx's workers use (`extractor.LLM`'s `generate` / `spec` /
`shutdown`), writing through hsx's connector plug-in; `hsx run --engine vllm` builds one per worker.

    VllmEngine(config, connector, settings)
        config      extractor.EngineConfig: model, layer ids, dtype, lengths as the job resolved them (run.json's)
        connector   connectors' HiddenStatesConnectorConfig: where and how files are written (kv_connector_extra_config)
        settings    vllm_engine.options.VllmSettings: tensor / pipeline / expert parallelism, further vLLM arguments
    engine.generate(prompts, params, request_ids) -> [extractor.llm.RequestOutput]   in prompt order
    engine.spec     the file spec the plug-in writes (compared with run.json's before any work)

One vLLM `LLM` with the `extract_hidden_states` method and hsx's plug-in (vllm_engine/connector.py). vLLM's
processes live inside the caller's: with T x P > 1 ranks vLLM's multiprocessing executor starts one process per
rank (on CPU each rank is bound to its share of this process's cores, `VLLM_CPU_OMP_THREADS_BIND`, unless set).

What a worker may rely on, as with hsx's engine: `generate` returns once every file it reports is durable. vLLM
returns a request's output when the request finishes, a step before the plug-in writes its file, so each request
carries a ticket (vllm_engine/outcomes.py) and `generate` asks vLLM's workers for the tickets' outcomes
(`collective_rpc`) until every file is durable or has failed; a file refused by hsx's checks (NaN/Inf states, a
custom path outside the allowed roots) comes back as that request's error, with hsx's error kinds.
Prompt-only requests (hsx's max_tokens 0) run with vLLM's max_tokens 1: the file holds the prompt's states, the
output no token. Prefix caching is off: a cached prefix would not be captured again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from connectors.extra_config import HiddenStatesConnectorConfig
from extractor.config import EngineConfig
from extractor.llm import CompletionOutput, RequestOutput
from extractor.sampling import SamplingParams
from vllm_engine import outcomes
from vllm_engine.options import INSTALL_HINT, VllmSettings

logger = logging.getLogger(__name__)

CONNECTOR = ("HsxHiddenStatesConnector", "vllm_engine.connector")
"""The plug-in's class and module (KVTransferConfig's kv_connector, kv_connector_module_path)."""
OUTCOME_WAIT_S = 600.0
"""How long `generate` waits for the plug-in to report a file it was handed (the write's own retries included)."""


class VllmMissing(RuntimeError):
    """vLLM cannot be imported here (the message says how to install it)."""


def thread_binding(cores: Sequence[int], ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` ranks over `cores`: an equal share each, "0-3|4-7" ("0|1" for 2)."""
    cores = sorted(cores)
    if len(cores) < ranks:
        raise ValueError(f"{ranks} vLLM ranks on CPU need a core each; this worker may run on {len(cores)} "
                         f"({cores}): lower --tensor-parallel-size / --pipeline-parallel-size")
    share = len(cores) // ranks
    groups = [cores[i * share:(i + 1) * share] for i in range(ranks)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 and g[-1] - g[0] == len(g) - 1 else ",".join(map(str, g))
                    for g in groups)


def import_vllm():
    """The vllm package; VllmMissing saying how to install it when it cannot be imported."""
    try:
        import vllm
    except ImportError as e:
        raise VllmMissing(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from None
    return vllm


def on_cpu() -> bool:
    """Whether vLLM runs on CPU here (its CPU build)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def platform_args() -> dict[str, Any]:
    """vllm.LLM arguments this platform needs by default: on CPU enforce_eager (no minutes of compiling per start)."""
    return {"enforce_eager": True} if on_cpu() else {}


def vllm_sampling_params(params: SamplingParams, kv_transfer_params: dict[str, Any] | None = None):
    """vLLM's SamplingParams for hsx's (prompt-only, hsx's max_tokens 0, becomes vLLM's minimum of 1), with
    `kv_transfer_params` as vLLM takes them (extra_args)."""
    from vllm import SamplingParams as VllmParams

    return VllmParams(max_tokens=max(params.max_tokens, 1), temperature=params.temperature, top_p=params.top_p,
                      top_k=params.top_k or 0, seed=params.seed, stop=params.stop,
                      stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
                      include_stop_str_in_output=params.include_stop_str_in_output,
                      extra_args=None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params})


def shutdown_llm(llm) -> None:
    """Stop a vllm.LLM's engine core (and its workers) now, not when it is collected."""
    llm.llm_engine.engine_core.shutdown()


def extra_config(connector: HiddenStatesConnectorConfig) -> dict[str, Any]:
    """kv_connector_extra_config for the plug-in: the connector's settings as plain values."""
    out = dataclasses.asdict(connector)
    if out.get("allowed_roots") is not None:
        out["allowed_roots"] = list(out["allowed_roots"])
    return out


class VllmEngine:
    """See the module docstring."""

    def __init__(self, config: EngineConfig, connector: HiddenStatesConnectorConfig,
                 settings: VllmSettings | None = None) -> None:
        vllm = import_vllm()
        from vllm.config import KVTransferConfig

        settings = settings or VllmSettings()
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
            raise ValueError("VLLM_ENABLE_V1_MULTIPROCESSING=0 runs vLLM's engine core inside this process, where it "
                             "steps only while generate() runs: the plug-in's last files would never be written and "
                             "reported. Unset it for --engine vllm")
        if config.speculative is not None:
            raise ValueError("VllmEngine extracts hidden states; decode speculatively with vllm.LLM itself")
        if config.target:
            raise ValueError(f"--target {config.target} needs the final norm and lm_head applied to layer N inside "
                             "the engine; --engine vllm stores layer states only: use --engine hsx for it")
        args: dict[str, Any] = platform_args()
        if on_cpu() and settings.devices > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = thread_binding(os.sched_getaffinity(0), settings.devices)
        args["max_num_seqs"] = config.max_num_seqs
        args.update(settings.engine_args)  # --vllm-args win over these defaults (max_num_seqs, enforce_eager, ...)
        if config.max_model_len is not None:
            args["max_model_len"] = config.max_model_len
        if settings.devices > 1:
            args["distributed_executor_backend"] = "mp"  # vLLM's ranks inside this worker's reservation
        layer_ids = [int(i) for i in config.layer_ids or ()]
        self.connector = connector
        self._llm = vllm.LLM(
            model=config.model, tokenizer=config.tokenizer or config.model, revision=config.revision,
            dtype=config.dtype, max_num_batched_tokens=config.max_num_batched_tokens,
            trust_remote_code=config.trust_remote_code,
            tensor_parallel_size=settings.tensor_parallel_size, pipeline_parallel_size=settings.pipeline_parallel_size,
            enable_expert_parallel=settings.enable_expert_parallel, enable_prefix_caching=False,
            worker_extension_cls=outcomes.EXTENSION,
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}},
            kv_transfer_config=KVTransferConfig(kv_connector=CONNECTOR[0], kv_connector_module_path=CONNECTOR[1],
                                                kv_role="kv_producer", kv_connector_extra_config=extra_config(connector)),
            **args)
        from vllm_engine.connector import file_spec

        spec = file_spec(self._llm.llm_engine.vllm_config)
        self.spec = dataclasses.replace(spec, storage_dtype=connector.storage_dtype)

    # -- the engine API hsx's workers use -----------------------------------------------------------------------
    def generate(self, prompts: Sequence[Mapping[str, Any] | str], sampling_params: Sequence[SamplingParams],
                 request_ids: Sequence[str] | None = None) -> list[RequestOutput]:
        """One output per prompt, in order, once every reported file is durable (see the module docstring)."""
        prompts, params = list(prompts), list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one per prompt")
        ids = [str(r) for r in request_ids] if request_ids is not None else [str(i) for i in range(len(prompts))]
        tickets = [uuid.uuid4().hex for _ in prompts]
        results = self._llm.generate([_prompt(p) for p in prompts],
                                     [self._params(p, sp, t) for p, sp, t in zip(prompts, params, tickets)],
                                     use_tqdm=False)
        handed = [t for t, r in zip(tickets, results) if (r.kv_transfer_params or {}).get("hidden_states_path")]
        told = self._outcomes(handed)
        return [self._output(rid, r, sp, told.get(t, ("engine", None)) if t in handed else None)
                for rid, r, sp, t in zip(ids, results, params, tickets)]

    def shutdown(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is not None:
            shutdown_llm(llm)
            self._llm = None

    # -- pieces -------------------------------------------------------------------------------------------------
    @staticmethod
    def _params(prompt, params: SamplingParams, ticket: str):
        """vLLM's SamplingParams for hsx's, the request's kv_transfer_params tagged with its ticket and carrying
        the sample id and loss mask the file records."""
        kv = dict(params.kv_transfer_params or {})
        kv[outcomes.TICKET] = ticket
        if isinstance(prompt, Mapping):
            for key in ("sample_id", "loss_mask"):
                if prompt.get(key) is not None:
                    kv[key] = list(prompt[key]) if key == "loss_mask" else str(prompt[key])
        return vllm_sampling_params(params, kv)

    def _outcomes(self, tickets: list[str]) -> dict[str, tuple[str | None, str | None]]:
        """Each ticket's outcome as the plug-in reported it; a ticket unanswered after OUTCOME_WAIT_S is missing."""
        told: dict[str, tuple[str | None, str | None]] = {}
        wait, deadline = 0.005, time.monotonic() + OUTCOME_WAIT_S + (self.connector.write_retry_s or 0)
        while len(told) < len(tickets) and time.monotonic() < deadline:
            pending = [t for t in tickets if t not in told]
            for answer in self._llm.collective_rpc("hsx_outcomes", args=(pending,)):
                told.update(answer or {})
            if len(told) < len(tickets):
                time.sleep(wait)
                wait = min(wait * 2, 0.2)
        return told

    def _output(self, rid: str, result, params: SamplingParams,
                outcome: tuple[str | None, str | None] | None) -> RequestOutput:
        kv = dict(result.kv_transfer_params or {})
        kind, error = outcome if outcome is not None else ("invalid", None)
        if outcome is None:  # never handed to the plug-in's worker: refused on the scheduler side (its path)
            error = kv.get("error") or "the engine wrote no hidden states for it (aborted)"
        elif kind == "engine" and error is None:
            error = f"vLLM's workers did not report its file within {OUTCOME_WAIT_S:.0f} s"
        ok = kind is None
        completion = result.outputs[0] if result.outputs else None
        prompt_only = params.max_tokens == 0
        tokens = [] if prompt_only or completion is None else list(completion.token_ids)
        return RequestOutput(
            request_id=rid, prompt=result.prompt, prompt_token_ids=list(result.prompt_token_ids or []),
            outputs=[CompletionOutput(0, "" if prompt_only or completion is None else completion.text, tokens,
                                      ("length" if prompt_only else completion.finish_reason) if ok and completion
                                      else None, completion.stop_reason if ok and completion else None)],
            kv_transfer_params={"hidden_states_path": kv["hidden_states_path"]} if ok else None,
            error=error, error_kind=kind)


def _prompt(prompt: Mapping[str, Any] | str) -> Mapping[str, Any] | str:
    """vLLM's prompt for hsx's: text, or {"prompt_token_ids"} (hsx's own keys go into kv_transfer_params)."""
    if isinstance(prompt, str):
        return prompt
    if "prompt_token_ids" in prompt:
        return {"prompt_token_ids": list(prompt["prompt_token_ids"])}
    return {"prompt": str(prompt["prompt"])}
