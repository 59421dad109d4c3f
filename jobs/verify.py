"""`hsx verify`: check a run's committed files, recompute some with a plain transformers forward, and mark what is
bad so that re-running the same `hsx run` command re-extracts exactly those samples.

    VerifyConfig(output, ...)           one verification (jobs/verify_config.py); the CLI's flags map onto it
    verify_run(config) -> VerifyReport  checks, recomputes, marks; writes OUTPUT/verify/report-<attempt>.json
    latest_report(run) -> dict | None   the newest report, for `hsx status`

Per checked sample (every committed one, or `sample` drawn at random): the file exists and is a regular file; its
size equals the manifest row's bytes; its header is valid (connectors.format) and matches the run's file spec; its
token count and sample id equal the row's; its data matches the checksum in its header and the one in the row; its
hidden states are finite (connectors.reader.verify_hidden_states streams the file once).

Recompute (`recompute` samples drawn from the checked ones that passed): the target model runs a plain transformers
forward over the stored token ids (output_hidden_states for ids below N, a hook on the last decoder layer for id N,
which is stored pre-norm) and the largest difference per stored layer, relative to that layer's largest magnitude,
must stay within `tolerance`. For runs that stored generated tokens, the stored last layer through the model's
final norm and lm_head must pick each generated token (greedy runs) or give it a probability of at least 1e-6
(sampled runs).

Marking: each failed sample gets an "invalid" manifest row with its reason (under the run's writer lease); such a
sample is no longer committed (connectors.manifest.committed_rows), so the next `hsx run` of the same command extracts it
again. The report lists every failure; the CLI exits 1 when there is one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from connectors.format import (
    MM_EMBEDS,
    MM_TOKEN_TYPE_IDS,
    POSITION_IDS,
    TARGET_TOPK_IDS,
    TARGET_TOPK_LOGPROBS,
    HiddenStatesFileError,
)
from connectors.lease import WriterLease
from connectors.manifest import (
    INVALID,
    committed_rows,
    new_attempt_id,
    read_manifest,
    row_file_problem,
    row_path_problem,
    sample_range,
    write_manifest_part,
)
from connectors.outputs import check_output_file, write_output_file
from connectors.run import RUN_JSON, RunDir, RunFormatError, RunSpec, read_run_spec
from jobs.verify_config import VerifyConfig

logger = logging.getLogger(__name__)

VERIFY_DIR = "verify"
REPORT_FORMAT = "hsx.verify-report"
REPORT_STARTS = (b'{\n  "format": "hsx.verify-report"', b'{\n  "output": ')
"""How a verify report begins (this hsx's; an older one's, first key "output"): --report replaces only those."""
MIN_SAMPLED_PROB = 1e-6
DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 5e-2}


@dataclass
class VerifyReport:
    output: str
    attempt: str
    started_at: str
    committed: int = 0
    """Committed samples in the run."""
    checked: int = 0
    failures: list[dict[str, str]] = field(default_factory=list)
    """{"sample_id", "path", "problem"} per failed sample."""
    kinds: dict[str, int] = field(default_factory=dict)
    recomputed: list[dict[str, Any]] = field(default_factory=list)
    """{"sample_id", "max_rel_diff": {layer id: x}, "tokens_checked", "token_mismatches"} per recomputed sample."""
    not_recomputed: list[dict[str, str]] = field(default_factory=list)
    """{"sample_id", "reason"} per drawn sample no forward can recompute from its file (an image sample stored
    without --mm-embeds, or of a deepstack target): not a failure, said."""
    tolerance: float | None = None
    marked: int = 0
    """Samples marked invalid (re-extracted by the next `hsx run`)."""
    seconds: float = 0.0
    report_url: str = ""

    @property
    def ok(self) -> bool:
        return not self.failures

    def lines(self) -> list[str]:
        out = [f"hsx verify {self.output}: checked {self.checked} of {self.committed} committed samples, "
               f"{len(self.failures)} failed" + (f" ({', '.join(f'{k} {n}' for k, n in self.kinds.items())})"
                                                 if self.kinds else "") + f", {self.seconds:.1f}s"]
        if self.recomputed:
            worst = max((max(r["max_rel_diff"].values(), default=0.0) for r in self.recomputed), default=0.0)
            mismatches = sum(r["token_mismatches"] for r in self.recomputed)
            out.append(f"  recomputed {len(self.recomputed)} with transformers: largest relative difference "
                       f"{worst:.2e} (tolerance {self.tolerance:.0e})" +
                       (f", {mismatches} generated tokens the stored states do not reproduce" if mismatches else ""))
        if self.not_recomputed:
            out.append(f"  not recomputed: {len(self.not_recomputed)} image samples "
                       f"({self.not_recomputed[0]['reason']})")
        for f in self.failures[:10]:
            out.append(f"  {f['sample_id']}: {f['problem']}")
        if len(self.failures) > 10:
            out.append(f"  ... {len(self.failures) - 10} more in the report")
        if self.marked:
            out.append(f"  marked {self.marked} samples invalid: re-run the same `hsx run` command to re-extract them")
        out.append(f"  report: {self.report_url}")
        return out


def verify_run(config: VerifyConfig) -> VerifyReport:
    """Verify the run at config.output; see the module docstring. ValueError for what the user must fix."""
    run = RunDir(config.output, config.storage_options)
    spec = read_run_spec(run)
    if spec is None:
        raise ValueError(f"{run.url} holds no hsx run (no run.json); check the path")
    if config.report:  # checked before any work: the copy may not overwrite the run, its model or another one
        check_output_file(config.report, flag="--report", inputs={"OUTPUT": config.output,
                                                                  "--model-dir": config.model_dir},
                          ours=REPORT_STARTS, command="verify")
    started = time.monotonic()
    report = VerifyReport(output=run.url, attempt=new_attempt_id(),
                          started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    rows = committed_rows(read_manifest(run)).to_pylist()
    report.committed = len(rows)
    rng = random.Random(config.seed)
    chosen = rows if config.sample is None else rng.sample(rows, min(config.sample, len(rows)))
    chosen.sort(key=lambda r: r["sample_id"])
    passed = []
    for row in chosen:
        problem = _check_file(run, spec, row)
        if problem is None:
            passed.append(row)
        else:
            _fail(report, row, problem)
    report.checked = len(chosen)
    spec_problems = {f["problem"] for f in report.failures if f["kind"] == "spec"}
    if len(chosen) >= 2 and not passed and len(spec_problems) == 1 and len(report.failures) == len(chosen):
        # every file agrees with every other and none with run.json: run.json is what changed, not the data
        raise ValueError(f"every one of the {len(chosen)} checked files disagrees with {run.url_of(RUN_JSON)} in "
                         f"the same way ({next(iter(spec_problems)).split(': ', 1)[-1]}); run.json was edited or "
                         "damaged, not the data: put its values back as the files' headers record them, then verify "
                         "again (nothing was marked)")
    if config.recompute and passed:
        report.tolerance = config.tolerance or _default_tolerance(spec)
        _recompute(run, spec, config, rng.sample(passed, min(config.recompute, len(passed))), report)
    report.kinds = dict(Counter(f["kind"] for f in report.failures).most_common())
    if report.failures and config.mark:
        _mark(run, report, {r["sample_id"]: r for r in chosen})
    report.seconds = time.monotonic() - started
    _write_report(run, report, config.report)
    return report


def _default_tolerance(spec: RunSpec) -> float:
    """The model dtype's tolerance; a coarser storage dtype's when the run stores one, plus fp8's own rounding."""
    from connectors.quant import FP8_RELATIVE_ERROR  # torch: hsx status reads latest_report from here

    tolerance = DEFAULT_TOLERANCE.get(spec.dtype, 5e-2)
    if spec.storage_dtype:
        tolerance = max(tolerance, DEFAULT_TOLERANCE.get(spec.storage_dtype, 0.0))
    return tolerance + (FP8_RELATIVE_ERROR if spec.file_spec().scaled else 0.0)


def _fail(report: VerifyReport, row: dict, problem: str, kind: str | None = None) -> None:
    if any(f["sample_id"] == row["sample_id"] for f in report.failures):
        return
    kind = kind or problem.split(":", 1)[0]
    report.failures.append({"sample_id": row["sample_id"], "path": row["path"], "kind": kind, "problem": problem})


def _check_file(run: RunDir, spec: RunSpec, row: dict) -> str | None:
    """Why the committed file of `row` is bad, or None."""
    from connectors.reader import verify_hidden_states  # torch: hsx status reads latest_report from here

    if (problem := row_path_problem(row.get("path"))) is not None:
        return f"path: {problem}"
    url = run.url_of(row["path"])
    try:
        where = _range(row)
    except RunFormatError as e:
        return f"damaged: {e}"
    try:
        info = verify_hidden_states(url, storage_options=run.storage_options, wait_timeout=0, byte_range=where)
    except FileNotFoundError:
        return "missing: the file is gone"
    except HiddenStatesFileError as e:
        reason = e.reason or str(e)
        return f"{'checksum' if 'checksum' in reason else 'damaged'}: {reason}"
    except (OSError, TimeoutError) as e:
        return f"unreadable: {type(e).__name__}: {e}"
    mismatch = row_file_problem(info, row["sample_id"], row["num_tokens"], row.get("checksum"), size=row.get("bytes"))
    if mismatch is not None:
        return f"{mismatch[0]}: {mismatch[1]}"
    if (problem := spec.file_spec().file_problem(info)) is not None:
        return f"spec: the file is not one of the run's: {problem}"
    return None


# -- recompute --------------------------------------------------------------------------------------------------


def _recompute(run: RunDir, spec: RunSpec, config: VerifyConfig, rows: list[dict], report: VerifyReport) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from connectors.reader import load_hidden_states  # torch: hsx status reads latest_report from here
    from extractor.layers import find_decoder_layers  # torch: hsx status reads latest_report from here
    from extractor.norm import FinalNorm  # torch: hsx status reads latest_report from here

    model_dir = config.model_dir or (spec.model if os.path.isfile(os.path.join(spec.model, "config.json")) else None)
    if model_dir is None:
        raise ValueError(f"--recompute needs the target model's local folder; the run records {spec.model!r}, "
                         "which is not one. Pass --model-dir")
    dtype = spec.torch_dtype
    vision = bool(spec.image_processing)  # a vision-language target: its own class, fed the stored image embeddings
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=dtype).to(config.device).eval()
    n = int(model.config.get_text_config().num_hidden_layers)
    last_layer = find_decoder_layers(model, n)[-1]
    norm = FinalNorm.from_model_dir(model_dir).to(dtype) if spec.max_tokens and spec.include_output_tokens else None
    lm_head = model.get_output_embeddings()
    greedy = spec.sampling is None or spec.sampling.temperature == 0
    captured: dict[str, torch.Tensor] = {}  # the last decoder layer's output: id N, pre-norm

    def keep_last(module, args, out) -> None:
        captured["n"] = out[0] if isinstance(out, tuple) else out

    for row in rows:
        stored = load_hidden_states(run.url_of(row["path"]), storage_options=run.storage_options,
                                    byte_range=_range(row))
        ids = stored["token_ids"]  # [T]
        states = stored["hidden_states"]  # [T, L, H]
        inputs = _forward_inputs(model, stored, config.device) if vision else {"input_ids": ids[None].to(config.device)}
        if isinstance(inputs, str):
            report.not_recomputed.append({"sample_id": row["sample_id"], "reason": inputs})
            continue
        handle = last_layer.register_forward_hook(keep_last)
        try:
            with torch.no_grad():
                out = model(**inputs, output_hidden_states=True)
        finally:
            handle.remove()
        hs = out.hidden_states
        diffs: dict[str, float] = {}
        for pos, layer in enumerate(spec.layer_ids):
            ref = (captured["n"] if layer == n and not spec.last_layer_normalized else hs[layer])[0].float().cpu()
            got = states[:, pos].float()
            diffs[str(layer)] = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        if spec.target_top_k is not None:  # the model's own logits, against the stored top-K
            diffs[TARGET_TOPK_LOGPROBS] = _topk_difference(out.logits[0].float().log_softmax(-1).cpu(),
                                                           stored[TARGET_TOPK_IDS].long(),
                                                           stored[TARGET_TOPK_LOGPROBS])
        entry = {"sample_id": row["sample_id"], "max_rel_diff": diffs, "tokens_checked": 0, "token_mismatches": 0}
        bad = [layer for layer, d in diffs.items() if not d <= report.tolerance]
        if bad:
            _fail(report, row, f"recompute: layers {bad} differ from a transformers forward by up to "
                               f"{max(diffs[b] for b in bad):.2e} (tolerance {report.tolerance:.0e})", "recompute")
        if norm is not None and spec.layer_ids[-1] == n:
            entry.update(_check_generated(states[:, -1], ids, row.get("num_prompt_tokens") or _prompt_tokens(run, row), norm, lm_head, greedy,
                                          config.device))
            if entry["token_mismatches"]:
                _fail(report, row, f"generated: {entry['token_mismatches']} of {entry['tokens_checked']} generated "
                                   "tokens are not what the stored last layer predicts", "generated")
        report.recomputed.append(entry)


def _forward_inputs(model, stored: dict, device: str) -> dict | str:
    """A vision-language sample's forward arguments as hsx's engine fed its language model: the token embeddings with
    the stored merged image embeddings at image tokens (mm_embeds) and the stored M-RoPE positions [3, 1, T]; or why
    its file cannot be recomputed (image tokens whose embeddings were not stored, a deepstack target's)."""
    import torch

    ids = stored["token_ids"][None].to(device)  # [1, T]
    if MM_TOKEN_TYPE_IDS not in stored or POSITION_IDS not in stored:  # vLLM's plug-in writes neither
        if bool((ids == int(model.config.image_token_id)).any()):
            return "the file holds no modality mask or M-RoPE positions (written by --engine vllm)"
        return {"input_ids": ids}  # a text prompt: its positions are plain
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)  # [1, T, H]
    image = stored[MM_TOKEN_TYPE_IDS].bool().to(device)  # [T]
    if bool(image.any()):
        if getattr(getattr(model.config, "vision_config", None), "deepstack_visual_indexes", None):
            return "a deepstack target's image samples need the vision tower's deepstack features, not stored"
        if MM_EMBEDS not in stored:
            return "stored without --mm-embeds: the image tokens' embeddings are not in the file"
        embeds[0, image] = stored[MM_EMBEDS].to(device, embeds.dtype)
    return {"inputs_embeds": embeds, "position_ids": stored[POSITION_IDS].T[:, None, :].to(device)}


def _topk_difference(ref, ids, logprobs) -> float:
    """How far a stored top-K target ([T, K] ids and log-probabilities) is from the reference log-probabilities
    [T, V], relative to their largest magnitude: the larger of the stored values' own error, and how much better
    than the stored K-th any token left out is (0 when the stored ids are the reference's top K, ties aside)."""
    at_ids = ref.gather(-1, ids)  # [T, K] the reference's log-probabilities of the stored ids
    scale = at_ids.abs().max().clamp_min(1e-12)
    value_error = (at_ids - logprobs).abs().max()
    left_out = ref.scatter(-1, ids, float("-inf")).amax(-1)  # [T] the best token not stored
    rank_error = (left_out - at_ids.amin(-1)).clamp_min(0).max()
    return float(max(value_error, rank_error) / scale) if ids.numel() else 0.0


def _prompt_tokens(run: RunDir, row: dict) -> int:
    """For manifests that leave num_prompt_tokens out (hsx's rows record it): the file's own metadata."""
    from connectors.reader import read_hidden_states_info  # torch: hsx status reads latest_report from here

    info = read_hidden_states_info(run.url_of(row["path"]), storage_options=run.storage_options,
                                   byte_range=_range(row))
    return int(info.metadata.get("num_prompt_tokens") or info.num_tokens)


def _range(row: dict) -> tuple[int, int] | None:
    """The row's sample range in its shard (--layout sharded), or None for a file of its own."""
    return sample_range(row.get("offset"), row.get("bytes"))


def _check_generated(last, ids, num_prompt: int, norm, lm_head, greedy: bool, device: str) -> dict[str, int]:
    """Stored states of positions num_prompt-1 .. T-2 predict the generated tokens num_prompt .. T-1."""
    import torch

    lo, hi = num_prompt - 1, ids.shape[0] - 1
    if hi <= lo:
        return {"tokens_checked": 0, "token_mismatches": 0}
    with torch.no_grad():
        logits = lm_head(norm(last[lo:hi]).to(device)).float()  # [G, V]
    target = ids[lo + 1:hi + 1].to(logits.device)
    if greedy:
        wrong = int((logits.argmax(-1) != target).sum())
    else:
        logp = torch.log_softmax(logits, -1).gather(-1, target[:, None])[:, 0]
        wrong = int((logp < math.log(MIN_SAMPLED_PROB)).sum())
    return {"tokens_checked": int(target.numel()), "token_mismatches": wrong}


# -- marking and the report ----------------------------------------------------------------------------------------


def _mark(run: RunDir, report: VerifyReport, rows: dict[str, dict]) -> None:
    lease = WriterLease.acquire(run, report.attempt)  # a writer like any job: never beside a running one
    try:
        marks = [{"sample_id": f["sample_id"], "status": INVALID, "path": f["path"], "num_tokens": 0,
                  "num_prompt_tokens": rows[f["sample_id"]].get("num_prompt_tokens"), "bytes": 0,
                  "error": f"hsx verify: {f['problem']}", "source": rows[f["sample_id"]].get("source"),
                  "truncated": False} for f in report.failures]
        write_manifest_part(run, pa.Table.from_pylist(marks), report.attempt, 0)
        report.marked = len(marks)
    finally:
        lease.release()


def _write_report(run: RunDir, report: VerifyReport, local_copy: str | None) -> None:
    rel = f"{VERIFY_DIR}/report-{report.attempt}.json"
    report.report_url = run.url_of(rel)
    body = (json.dumps({"format": REPORT_FORMAT, **asdict(report), "ok": report.ok}, indent=2, ensure_ascii=False)
            + "\n").encode("utf-8")
    run.put(rel, body)
    if local_copy:
        write_output_file(check_output_file(local_copy, flag="--report", ours=REPORT_STARTS, command="verify"), body)


def latest_report(run: RunDir) -> dict | None:
    """The newest verify report of the run (reports sort by attempt id, i.e. by time), or None."""
    names = [n for n in run.list(VERIFY_DIR) if n.startswith("report-") and n.endswith(".json")]
    if not names:
        return None
    try:
        doc = json.loads(run.read_bytes(f"{VERIFY_DIR}/{names[-1]}"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return None
    shapes = {"failures": list, "recomputed": list, "kinds": dict}
    if not isinstance(doc, dict) or any(not isinstance(doc.get(k) or t(), t) for k, t in shapes.items()):
        logger.warning("the verify report %s is damaged; it is ignored (run hsx verify again)",
                       run.url_of(f"{VERIFY_DIR}/{names[-1]}"))
        return None
    return doc
