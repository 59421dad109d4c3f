"""Measure drafters on a target: greedy decoding per speculative method, acceptance, tokens/s, losslessness.

    evaluate_speculation(target, prompts, methods, max_tokens) -> [EvalResult]
        methods: {name: speculative_config dict, or None for plain decoding}. Each method decodes the same prompts
        greedily with extractor.LLM(model=target, speculative_config=cfg): a warm-up, then `repeats` timed
        generate() calls, methods interleaved (so a noisy shared CPU slows them alike), median wall time.
        Every output is compared token for token with the reference (plain decoding, or `reference_token_ids`
        from an oracle): speculation must be lossless under greedy decoding; a mismatch is logged as an error,
        marked on the result and, with strict=True, raised as LossyOutputError after all methods ran. The results,
        the counters and the comparison (EvalResult, SpecDecodeCounts, check_lossless) are training/eval_result.py's.
    spec_decode_lines(total_output_tokens, counts) -> [str]   the lines vLLM's offline spec_decode.py prints
    result_lines(result) -> [str]         a method's block: its config, those lines, tokens/s, a lossless warning
    comparison_table(results) -> [str]    method | AL | acceptance per position | tokens/s | speedup | lossless
    infer_method(drafter_dir)             the drafter family of a checkpoint, from its config.json
    load_prompts(path) -> [{"prompt", "category"?}]   a JSONL file of prompts, each with an optional category

    EvalDrafterConfig / run_eval(config)  `hsx eval-drafter` (flags map one to one onto the config's fields); --out
                                          DIR writes training/acceptance.py's files: the numbers (and --json)
                                          first, the plot last (a plot that fails is a warning)

Figures as vLLM computes them from get_metrics(): mean acceptance length AL = 1 + accepted / drafts (the bonus
token included), acceptance at position i = drafts whose i-th token was accepted / drafts. Counters are read before
and after the timed calls, so the warm-up does not count. vLLM counts only the steps that had a draft, so beside AL:
steps drafted = drafts / target steps and tokens per target step = decoded tokens / target forwards over every step
(what speculation saves; equal to AL for a drafter that always drafts, lower for ngram when it finds no match).
Prompts given as {"prompt": ..., "category": name} are also counted per category, from each request's own counts
(RequestOutput.spec_decode) over the same timed calls: the rows of acceptance.csv.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from connectors.outputs import OutputFolder, check_output_file, within_output, write_output_file
from extractor.config import MAX_SPECULATIVE_TOKENS, checkpoint_method, drafter_methods
from extractor.engines import DEFAULT, engine_kind
from reference.target import build_reference_target
from training.acceptance import RESULTS_JSON_STARTS, results_json, write_eval_outputs, write_eval_plot
from training.eval_result import (
    EvalResult,
    LossyOutputError,
    SpecDecodeCounts,
    check_lossless,
    spec_decode_counts,
)

logger = logging.getLogger(__name__)

NONE_METHOD = "none"
UNCATEGORIZED = "uncategorized"
"""The category of a prompt without one, when other prompts have one."""
ALL_CATEGORIES = "all"
"""Reserved: the name of the row over every prompt (training/acceptance.py)."""
def evaluate_speculation(target_path: str, prompts: Sequence[str | Mapping[str, Any]],
                         methods: Mapping[str, Mapping[str, Any] | None], max_tokens: int, temperature: float = 0.0,
                         *, repeats: int = 1, warmup_prompts: int = 2, warmup_tokens: int = 8, ignore_eos: bool = True,
                         reference_token_ids: Sequence[Sequence[int]] | None = None, device: str | None = None,
                         threads: int | None = None, strict: bool = True, errors: str = "raise",
                         progress: bool = False, max_num_seqs: int | None = None,
                         engine: str = DEFAULT) -> list[EvalResult]:
    """Decode `prompts` with every method; figures per method, outputs checked against the reference.

    A prompt is text or a dict for LLM.generate; a dict's "category" (a string) is taken out of it and counts the
    prompt's drafts under that name too (EvalResult.category_counts; prompts without one: "uncategorized").
    The reference is `reference_token_ids` when given (e.g. transformers generate's), else the method whose config is
    None (a "none" method is added first when `methods` has none). Greedy only: `temperature` must be 0, where
    speculation is exactly lossless. The warm-up decodes warmup_prompts prompts x warmup_tokens tokens per method,
    uncounted and untimed. ignore_eos (default) makes every method generate max_tokens per prompt.
    errors="record" keeps going when a method's engine cannot be built (its result carries `error`).
    max_num_seqs: how many requests decode together (the engine's max_num_seqs; default the engine's, 256: every
    prompt at once, as vLLM's offline example submits them). 1 is the latency regime speculative decoding is for:
    each step costs about the same at any width on a small model, so a wide batch runs until its slowest row is
    done, while one request at a time gains its own acceptance length.
    engine: the engine kind that decodes (extractor.engines, its speculative_engine()): "hsx" its own, "vllm" real
    vLLM for every method (vllm_engine/speculative.py: a family's checkpoint served with the method vLLM serves it
    with), its own counters read; per-category counts need hsx's engine.
    """
    import torch  # deferred, like extractor.LLM below (extractor/llm.py imports torch): the CLI reads this module

    from extractor import SamplingParams  # torch: the CLI's parser must stay cheap

    _check_arguments(temperature, prompts, max_tokens, repeats, max_num_seqs, errors)
    kind = engine_kind(engine, flag="engine")
    methods = dict(methods)
    if not any(cfg is None for cfg in methods.values()):
        methods = {NONE_METHOD: None, **methods}
    prompts, categories = _split_categories(prompts)
    decoding = _Decoding(errors, progress)
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        decoding.build(kind.speculative_engine(), target_path, methods, len(prompts), device, max_num_seqs)
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        warm = SamplingParams(temperature=0.0, max_tokens=min(warmup_tokens, max_tokens), ignore_eos=ignore_eos)
        for name in list(decoding.engines):
            decoding.generate(name, warm, prompts[:max(1, warmup_prompts)], use_tqdm=False)
        before = {name: spec_decode_counts(llm.get_metrics()) for name, llm in decoding.engines.items()}
        times = decoding.timed_runs(sp, prompts, categories, repeats)
        decoding.finish(before, times)
    finally:
        torch.set_num_threads(previous_threads)
    plain = next((decoding.results[n] for n, cfg in methods.items() if cfg is None and n in decoding.engines), None)
    return _compare(list(decoding.results.values()), plain, reference_token_ids, len(prompts), strict)


def _check_arguments(temperature: float, prompts: Sequence, max_tokens: int, repeats: int, max_num_seqs: int | None,
                     errors: str) -> None:
    """evaluate_speculation's arguments, each ValueError naming the value and what it must be."""
    if temperature != 0:
        raise ValueError(f"temperature={temperature}: the evaluation decodes greedily (temperature 0), where "
                         "speculative decoding must reproduce plain decoding token for token")
    if not prompts:
        raise ValueError("no prompts to evaluate on")
    if max_tokens < 1 or repeats < 1:
        raise ValueError(f"max_tokens ({max_tokens}) and repeats ({repeats}) must be >= 1")
    if max_num_seqs is not None and max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs}: must be >= 1 (or None: every prompt at once)")
    if errors not in ("raise", "record"):
        raise ValueError(f"errors={errors!r}: use 'raise' or 'record'")


class _Decoding:
    """The methods' engines over one evaluation, in call order: build, generate (the warm-up), timed_runs, finish.
    With errors="record" a method whose engine cannot be built or whose requests fail is dropped, its result
    carrying the error; with errors="raise" that raises."""

    def __init__(self, errors: str, progress: bool) -> None:
        self.errors, self.progress = errors, progress
        self.results: dict[str, EvalResult] = {}
        self.engines: dict[str, Any] = {}
        """The methods still running, name -> engine (a dropped method leaves)."""

    def build(self, llm_class, target_path: str, methods: Mapping[str, Mapping[str, Any] | None], num_prompts: int,
              device: str | None, max_num_seqs: int | None) -> None:
        """An engine and an empty result per method."""
        for name, cfg in methods.items():
            self.results[name] = EvalResult(name, dict(cfg) if cfg is not None else None, num_prompts=num_prompts,
                                            max_num_seqs=max_num_seqs or 0)
            try:
                batching = {"max_num_seqs": max_num_seqs} if max_num_seqs else {}
                self.engines[name] = llm_class(model=target_path, speculative_config=cfg, device=device, **batching)
            except Exception as e:  # noqa: BLE001 - recorded for the report when asked to, else re-raised
                if self.errors == "raise":
                    raise
                self.results[name].error = f"{type(e).__name__}: {e}"
                logger.warning("method %s skipped: %s", name, self.results[name].error)

    def generate(self, name: str, params, batch: list, use_tqdm: bool) -> list | None:
        """One generate(); a method whose requests fail raises, or with errors="record" is dropped (None)."""
        outs = self.engines[name].generate(batch, params, use_tqdm=use_tqdm)
        failed = [o.error for o in outs if o.error]
        if not failed:
            return outs
        message = f"method {name}: {len(failed)} of {len(outs)} requests failed, first: {failed[0]}"
        if self.errors == "raise":
            raise RuntimeError(message)
        logger.warning("%s", message)
        self.results[name].error = message
        self.engines.pop(name).shutdown()
        return None

    def timed_runs(self, params, prompts: list, categories: Sequence[str | None], repeats: int
                   ) -> dict[str, list[float]]:
        """`repeats` rounds, each method once per round, the order rotated round by round (a noisy shared CPU slows
        them alike); each method's wall times, its outputs and its per-category counts kept."""
        times: dict[str, list[float]] = {name: [] for name in self.engines}
        names = list(self.engines)
        for rep in range(repeats):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                if name not in self.engines:
                    continue
                t0 = time.perf_counter()
                outs = self.generate(name, params, prompts, use_tqdm=self.progress)
                if outs is not None:
                    times[name].append(time.perf_counter() - t0)
                    self.results[name].token_ids = [list(o.outputs[0].token_ids) for o in outs]
                    _count_categories(self.results[name].category_counts, outs, categories)
        return times

    def finish(self, before: dict[str, SpecDecodeCounts], times: dict[str, list[float]]) -> None:
        """Each running method's figures (counters since `before`, the median time), then its engine shut down."""
        for name, llm in self.engines.items():
            r = self.results[name]
            r.counts = spec_decode_counts(llm.get_metrics()) - before[name]
            r.seconds = statistics.median(times[name])
            r.timed_calls = len(times[name])
            r.num_output_tokens = sum(len(t) for t in r.token_ids)
            llm.shutdown()


def _compare(results: list[EvalResult], plain: EvalResult | None, reference_token_ids: Sequence[Sequence[int]] | None,
             num_prompts: int, strict: bool) -> list[EvalResult]:
    """Each result checked against the reference (`reference_token_ids`, else plain decoding's outputs) and its
    speedup over plain decoding; with strict, LossyOutputError when one is not lossless."""
    reference = reference_token_ids if reference_token_ids is not None else (plain.token_ids if plain else None)
    for r in results:
        if r.error is None and reference is not None:
            r.mismatches = check_lossless(reference, r.token_ids, r.method)
            if r.mismatches:
                logger.error("method %s is NOT lossless: %d of %d prompts differ from the reference; first: %s",
                             r.method, len(r.mismatches), num_prompts, r.mismatches[0])
        if r.error is None and plain is not None and plain.tokens_per_s:
            r.speedup = r.tokens_per_s / plain.tokens_per_s
    lossy = [r for r in results if r.mismatches]
    if strict and lossy:
        detail = "; ".join(f"{r.method}: {len(r.mismatches)} prompts differ, first {r.mismatches[0]}" for r in lossy)
        raise LossyOutputError(f"greedy outputs differ from the reference ({detail}); speculative decoding must be "
                               "lossless, so the engine or the proposer is wrong", results)
    return results


def _split_categories(prompts: Sequence[str | Mapping[str, Any]]) -> tuple[list, list[str | None]]:
    """(prompts without their "category" key, each prompt's category): None for all when none has one, else
    UNCATEGORIZED for those without."""
    bare, categories = [], []
    for i, p in enumerate(prompts):
        category = p.get("category") if isinstance(p, Mapping) else None
        check_category(category, f"prompt {i}")
        bare.append({k: v for k, v in p.items() if k != "category"} if isinstance(p, Mapping) else p)
        categories.append(category)
    if any(c is not None for c in categories):
        categories = [UNCATEGORIZED if c is None else c for c in categories]
    return bare, categories


def check_category(category: Any, where: str) -> None:
    """ValueError naming `where` unless `category` is None or a string other than the reserved "all"."""
    if category is not None and not isinstance(category, str):
        raise ValueError(f"{where}: 'category' is {json.dumps(category)} ({type(category).__name__}); give a string "
                         "(the prompt's subset, e.g. \"math_reasoning\") or leave it out")
    if category == ALL_CATEGORIES:
        raise ValueError(f"{where}: category {ALL_CATEGORIES!r} is reserved for acceptance.csv's row over every "
                         "prompt; rename it")


def _count_categories(into: dict[str, SpecDecodeCounts], outputs, categories: Sequence[str | None]) -> None:
    """Add each output's own speculative counts (RequestOutput.spec_decode) to its prompt's category."""
    for out, category in zip(outputs, categories):
        if category is not None and out.spec_decode is not None:
            into[category] = into.get(category, SpecDecodeCounts()) + spec_decode_counts(out.spec_decode.metrics())


# -- printing -------------------------------------------------------------------------------------------------------


def spec_decode_lines(total_num_output_tokens: int, counts: SpecDecodeCounts) -> list[str]:
    """The lines vLLM's examples/offline_inference/spec_decode.py prints after generating."""
    drafts = counts.num_drafts
    lines = ["-" * 50,
             f"total_num_output_tokens: {total_num_output_tokens}",
             f"num_drafts: {drafts}",
             f"num_draft_tokens: {counts.num_draft_tokens}",
             f"num_accepted_tokens: {counts.num_accepted_tokens}",
             f"mean acceptance length: {counts.mean_acceptance_length:.2f}",
             "-" * 50]
    lines += [f"acceptance at token {i}: {a:.2f}" for i, a in enumerate(counts.acceptance_per_position)]
    return lines


def result_lines(result: EvalResult) -> list[str]:
    """A method's block: its name, then spec_decode.py's lines (speculative methods) and its throughput."""
    head = f"== {result.method}" + (f" {json.dumps(result.speculative_config)}" if result.speculative else "")
    if result.error:
        return [head, f"skipped: {result.error}"]
    lines = [head]
    if result.speculative:
        lines += spec_decode_lines(result.num_output_tokens, result.counts)
    lines.append(f"tokens/s: {result.tokens_per_s:.1f} ({result.num_output_tokens} tokens in {result.seconds:.2f} s)"
                 + ("" if result.lossless else f"  NOT LOSSLESS: {len(result.mismatches)} prompts differ"))
    return lines


def comparison_table(results: Sequence[EvalResult]) -> list[str]:
    """A Markdown table: method | mean acceptance length | acceptance per position | steps drafted | tokens per target
    step | drafter ms per step | tokens/s | speedup | lossless."""
    lines = ["| method | mean acceptance length | acceptance per position | steps drafted | tokens per target step "
             "| drafter ms / step | tokens/s | speedup vs none | lossless |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.error:
            lines.append(f"| {r.method} | skipped: {r.error.splitlines()[0][:80]} | | | | | | | |")
            continue
        al = f"{r.mean_acceptance_length:.2f}" if r.mean_acceptance_length is not None else "-"
        pos = " / ".join(f"{a:.2f}" for a in r.acceptance_per_position) or "-"
        speedup = f"{r.speedup:.2f}x" if r.speedup is not None else "-"
        lossless = "yes" if r.lossless else f"**NO** ({len(r.mismatches)} prompts differ)"
        drafted = f"{r.drafted_fraction:.0%}" if r.drafted_fraction is not None else "-"
        per_step = f"{r.tokens_per_target_step:.2f}" if r.tokens_per_target_step is not None else "1.00"
        ms = r.drafter_ms_per_step
        lines.append(f"| {r.method} | {al} | {pos} | {drafted} | {per_step} | {f'{ms:.2f}' if ms is not None else '-'} "
                     f"| {r.tokens_per_s:.1f} | {speedup} | {lossless} |")
    return lines


# -- drafter checkpoints --------------------------------------------------------------------------------------------

def infer_method(drafter_dir: str) -> str:
    """The speculative method of a drafter checkpoint, from its config.json (extractor.config.checkpoint_method, as
    vLLM infers it); only the trained-head methods."""
    if not os.path.isdir(drafter_dir):
        raise ValueError(f"{drafter_dir!r} is not a folder; pass a drafter checkpoint folder (hsx train-drafter --out "
                         "DIR)")
    kind = checkpoint_method(drafter_dir)
    if kind in drafter_methods():
        return kind
    raise ValueError(f"cannot tell the method of the drafter in {drafter_dir!r} (it holds "
                     f"{'a causal LM' if kind == 'draft_model' else 'no drafter checkpoint hsx recognises'}); name "
                     f"it: --drafter METHOD:DIR with METHOD one of {', '.join(drafter_methods())}")


def load_prompts(path: str, limit: int | None = None) -> list[dict[str, str]]:
    """Prompts from a JSONL file, one {"prompt": text} object a line, optionally with "category": name (a string:
    the prompt's subset, e.g. "math_reasoning"; acceptance is reported per category too). Other keys are ignored."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string 'prompt'")
            category = row.get("category")
            check_category(category, f"{path}:{lineno}")
            prompts.append({"prompt": row["prompt"]} if category is None else
                           {"prompt": row["prompt"], "category": category})
            if limit is not None and len(prompts) == limit:
                break
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


# -- hsx eval-drafter -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalDrafterConfig:
    """`hsx eval-drafter`: which drafters, on which target, over which prompts."""

    model: str | None = None
    """Target folder (default: the locally trained reference target, built and cached on first use)."""
    drafter: tuple[str, ...] = field(default=(), metadata={"cli": {"append": True, "metavar": "[METHOD:]DIR"}})
    """A drafter checkpoint; METHOD (a drafter family, as `hsx train-drafter --kind` names it) is read from its
    config.json when omitted; repeatable."""
    num_speculative_tokens: tuple[int, ...] = field(default=(3,), metadata={"cli": {"short": "-k", "nargs": "+",
                                                                                    "metavar": "K"}})
    """Draft lengths to evaluate (e.g. -k 3 5)."""
    ngram: bool = True
    """Evaluate the ngram baseline too (--no-ngram leaves it out)."""
    prompts: str | None = field(default=None, metadata={"cli": {"metavar": "JSONL"}})
    """Prompts, one {"prompt": ...} a line, optionally with "category": NAME (acceptance per category too); default
    the target folder's heldout_prompts.jsonl."""
    num_prompts: int = 32
    """At most this many prompts."""
    max_tokens: int = 128
    """Tokens generated per prompt."""
    repeats: int = 1
    """Timed runs per method (median reported)."""
    max_num_seqs: tuple[int, ...] | None = field(default=None, metadata={"cli": {"nargs": "+", "metavar": "N"}})
    """Requests decoding together, one evaluation per value (e.g. 256 1: every prompt at once, then one at a time,
    the latency regime speculation is for); default the engine's 256."""
    threads: int | None = None
    """Torch CPU threads."""
    device: str | None = None
    """Torch device (default: the engine's choice)."""
    engine: str = DEFAULT
    """What decodes: hsx (its own engine) or vllm (real vLLM, each drafter served with the method vLLM serves its
    checkpoints with; vLLM's own counters; needs vLLM installed, docs/engines.md). Per-category acceptance needs
    hsx."""
    json: str | None = field(default=None, metadata={"cli": {"metavar": "PATH"}})
    """Write the results as JSON to PATH (checked before any work like --out: never the --prompts file, the
    --model, a --drafter or a run, nor inside one)."""
    out: str | None = field(default=None, metadata={"cli": {"metavar": "DIR"}})
    """Write DIR/<method>/acceptance.csv (the layout drafter benchmarks publish: a row per prompt category and
    "all"), DIR/summary.csv (tokens per target step, tokens/s, ...), DIR/acceptance_per_position.png and
    DIR/results.json; DIR is new, empty, or an earlier --out of eval-drafter."""

    def __post_init__(self) -> None:
        if isinstance(self.drafter, str):
            object.__setattr__(self, "drafter", (self.drafter,))
        for name in ("num_speculative_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, int):
                object.__setattr__(self, name, (value,))
        if not self.num_speculative_tokens or any(not 1 <= k <= MAX_SPECULATIVE_TOKENS
                                                  for k in self.num_speculative_tokens):
            raise ValueError(f"--num-speculative-tokens must be 1 to {MAX_SPECULATIVE_TOKENS}, got "
                             f"{list(self.num_speculative_tokens)}")
        if self.num_prompts < 1 or self.max_tokens < 1 or self.repeats < 1:
            raise ValueError("--num-prompts, --max-tokens and --repeats must be >= 1")
        if self.max_num_seqs is not None and any(n < 1 for n in self.max_num_seqs):
            raise ValueError(f"--max-num-seqs must be >= 1, got {list(self.max_num_seqs)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        engine_kind(self.engine)  # ValueError listing the engines there are


def eval_methods(drafters: Sequence[tuple[str, str, str]], ks: Sequence[int], ngram: bool = True
                 ) -> dict[str, dict[str, Any] | None]:
    """none, ngram k (prompt_lookup 2..5, as vLLM's example), each (name, method, dir) drafter at each k."""
    methods: dict[str, dict[str, Any] | None] = {NONE_METHOD: None}
    for k in ks:
        if ngram:
            methods[f"ngram k={k}"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 5,
                                       "prompt_lookup_min": 2}
        for name, method, path in drafters:
            methods[f"{name} k={k}"] = {"method": method, "model": path, "num_speculative_tokens": k}
    return methods


def run_eval(args: EvalDrafterConfig) -> int:
    """`hsx eval-drafter`: 0 when every method ran losslessly, 1 when one was not or could not run (a drafter
    trained on another target, a damaged checkpoint); bad arguments raise ValueError."""
    missing = engine_kind(args.engine).missing()  # names only: no engine imported
    if missing:
        raise ValueError(f"--engine {args.engine}: {missing}")
    drafters = _drafters(args.drafter)
    model = args.model
    if model is None:
        model = build_reference_target().path
    if not os.path.isdir(model):
        raise ValueError(f"--model {model!r} is not a local folder (hsx never downloads models)")
    prompts_path = args.prompts or os.path.join(model, "heldout_prompts.jsonl")
    if not os.path.isfile(prompts_path):
        raise ValueError(f"no prompts: {prompts_path!r} does not exist; pass --prompts FILE.jsonl")
    prompts = load_prompts(prompts_path, args.num_prompts)
    # every file the evaluation reads: no output may be, hold or lie inside one of them
    inputs = {"--model": model, "--prompts": prompts_path,
              **{f"--drafter {name}": path for name, _, path in drafters}}
    out = _check_outputs(args, inputs)
    methods = eval_methods(drafters, args.num_speculative_tokens, args.ngram)
    results = []
    for width in args.max_num_seqs or [None]:
        batch = evaluate_speculation(model, prompts, methods, args.max_tokens, repeats=args.repeats,
                                     threads=args.threads, device=args.device, strict=False, errors="record",
                                     max_num_seqs=width, engine=args.engine)
        for r in batch:
            print("\n".join(result_lines(r)))
        print(f"\n{len(prompts)} prompts x {args.max_tokens} tokens, greedy, target {model}, engine {args.engine}, "
              + ("one request at a time" if width == 1 else f"max_num_seqs {width or 'default (256)'}"))
        print("\n".join(comparison_table(batch)))
        results += batch
    _write_outputs(args, out, inputs, results)
    return _verdict(results)


def _drafters(specs: Sequence[str]) -> list[tuple[str, str, str]]:
    """(name, method, folder) per --drafter [METHOD:]DIR; METHOD read from the checkpoint when not given."""
    drafters = []
    for spec in specs:
        method, sep, path = spec.partition(":")
        if not sep or method not in drafter_methods():
            method, path = infer_method(spec), spec
        if not os.path.isdir(path):
            raise ValueError(f"--drafter {spec}: {path!r} is not a folder")
        drafters.append((f"{method} ({os.path.basename(os.path.normpath(path))})", method, path))
    return drafters


def _check_outputs(args: EvalDrafterConfig, inputs: dict[str, str]) -> OutputFolder | None:
    """--json and --out checked before any work (never over the prompts, the model, a drafter or a run); the --out
    folder, or None."""
    if args.json and args.out and within_output(args.json, args.out):
        raise ValueError(f"--json {args.json} lies inside --out {args.out}, where eval-drafter writes its own files "
                         "(results.json, summary.csv, ...); put --json outside --out")
    if args.json:
        check_output_file(args.json, flag="--json", inputs=inputs, ours=RESULTS_JSON_STARTS, command="eval-drafter")
    out = None
    if args.out:
        out = OutputFolder(args.out, command="eval-drafter", flag="--out", inputs=inputs)
        out.check()
    return out


def _write_outputs(args: EvalDrafterConfig, out: OutputFolder | None, inputs: dict[str, str],
                   results: list[EvalResult]) -> None:
    """The numbers first (results.json, summary.csv, acceptance.csv, --json), the picture last: a plot that cannot be
    drawn is a warning, never a lost evaluation."""
    written, plot_error = [], None
    with out.open() if out is not None else contextlib.nullcontext():
        if out is not None:
            written += write_eval_outputs(out.path, results)
        if args.json:
            path = check_output_file(args.json, flag="--json", inputs=inputs, ours=RESULTS_JSON_STARTS,
                                     command="eval-drafter")
            write_output_file(path, results_json(results))
            written.append(path)
        if out is not None:
            try:
                if (png := write_eval_plot(out.path, results)) is not None:
                    written.append(png)
            except Exception as e:  # noqa: BLE001 - the figures are written; the picture is a warning
                plot_error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                logger.warning("the acceptance plot was not drawn (%s); the numbers are written", plot_error)
                logger.debug("the plot's failure", exc_info=True)
    if written:
        print("\nwrote " + "\n      ".join(written))
    if plot_error is not None:
        print(f"hsx eval-drafter: WARNING: acceptance_per_position.png was not drawn ({plot_error}); the numbers are "
              "in results.json, summary.csv and acceptance.csv")


def _verdict(results: list[EvalResult]) -> int:
    """1 (each reason printed) when a method was not lossless or could not be evaluated, else 0."""
    failed = 0
    lossy = list(dict.fromkeys(r.method for r in results if not r.lossless))
    if lossy:
        print(f"hsx eval-drafter: NOT LOSSLESS: {', '.join(lossy)} differ from plain greedy decoding")
        failed = 1
    skipped = {r.method: r.error for r in results if r.error}
    if skipped:
        method, error = next(iter(skipped.items()))
        print(f"hsx eval-drafter: NOT EVALUATED: {', '.join(skipped)} could not be evaluated ({method}: "
              f"{' '.join(error.split())[:300]}); fix or drop those --drafter folders")
        failed = 1
    return failed
