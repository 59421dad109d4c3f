"""`hsx estimate`: what a run will produce — samples, tokens, bytes, files — before running it.

    estimate(config, limit=None) -> Estimate

Reads and tokenizes the corpus exactly as the job does (same reader, same tokenizer stage, same length policy; no
model weights, no Ray), then sizes each file with the connector's own header encoding (`connectors.format`: the same
tensors, metadata and JSON the writer produces), so prompt-only estimates match the written bytes to the byte. With generation and
--include-output-tokens the generated length is unknown; every sample is assumed to generate --max-tokens (an upper
bound). With --limit the first N records are measured and the totals scaled to the corpus's record count.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from cluster.progress import human_bytes, human_count
from connectors.format import HiddenStatesSpec
from connectors.header import file_entries, file_size, request_metadata
from connectors.manifest import settled_ids
from connectors.manifest_writer import error_kind
from connectors.run import RUN_JSON, RunDir
from corpus.readers import count_records, expand_corpus, read_records
from corpus.tokenization import SampleError, SampleTokenizer, TokenizeSettings
from extractor.config import EngineConfig
from jobs.config import JobConfig
from jobs.device_fit import DeviceFit, device_fit, parse_size
from jobs.model import ModelFacts
from jobs.plan import load_chat_template


@dataclass
class Estimate:
    records: int = 0
    """Records in the corpus (read, or counted when --limit is used)."""
    measured: int = 0
    """Records actually tokenized."""
    already_done: int = 0
    """Records the output already holds (skipped by a resume)."""
    samples: int = 0
    """Files the run will write."""
    failed: int = 0
    """Records that will become failed rows."""
    truncated: int = 0
    tokens: int = 0
    bytes: int = 0
    max_file_bytes: int = 0
    layer_ids: list[int] = field(default_factory=list)
    hidden_size: int = 0
    dtype: str = ""
    target: str = ""
    """"top_k:K" when a top-k target stands in for the last layer (K ids and log-probabilities a token)."""
    failure_kinds: dict[str, int] = field(default_factory=dict)
    assumed_generated_tokens: int = 0
    """Generated tokens assumed per sample (upper bound), when they are stored."""
    device: DeviceFit | None = None
    """What the target needs of a device (jobs.device_fit), and with --device-memory what fits it."""

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.tokens if self.tokens else 0.0

    def lines(self) -> list[str]:
        scaled = self.measured < self.records - self.already_done
        out = [f"corpus:   {self.records} records" + (f" ({self.already_done} already done)" if self.already_done
                                                      else "") + (f"; measured the first {self.measured}, scaled"
                                                                  if scaled else ""),
               f"samples:  {self.samples} files, {self.failed} would fail" +
               (f", {self.truncated} truncated" if self.truncated else ""),
               f"tokens:   {human_count(self.tokens)} ({self.tokens})",
               f"bytes:    {human_bytes(self.bytes)} ({self.bytes}); {self.bytes_per_token:.0f} bytes/token, largest "
               f"file {human_bytes(self.max_file_bytes)}",
               f"layout:   layers {self.layer_ids} x hidden {self.hidden_size} in {self.dtype}"
               + (f" + a {self.target} target" if self.target else "")]
        if self.assumed_generated_tokens:
            out.append(f"note:     assumes every sample generates {self.assumed_generated_tokens} tokens (upper bound)")
        if self.failure_kinds:
            out.append("failures: " + ", ".join(f"{k} ({n})" for k, n in self.failure_kinds.items()))
        if self.device is not None:
            out.extend(self.device.lines())
        return out


def file_bytes(spec: HiddenStatesSpec, sample_id: str, num_prompt_tokens: int, num_tokens: int,
               include_output_tokens: bool) -> int:
    """Exact size of the file the connector writes for one sample of a job (every job sample has a loss mask)."""
    metadata = request_metadata(spec.to_metadata(), request_id=sample_id, num_tokens=num_tokens,
                                num_prompt_tokens=num_prompt_tokens, include_output_tokens=include_output_tokens,
                                sample_id=sample_id)
    return file_size(file_entries(spec, num_tokens, loss_mask=True), metadata)


def _device_fit(config: JobConfig, facts: ModelFacts) -> DeviceFit:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(facts.model, revision=config.revision, trust_remote_code=config.trust_remote_code)
    engine = EngineConfig(model=facts.model)  # the engine's defaults where the job leaves them unset
    memory = config.device_memory
    return device_fit(hf, dtype=facts.dtype, max_model_len=facts.max_model_len, trust_remote_code=config.trust_remote_code,
                      max_num_batched_tokens=config.max_num_batched_tokens or engine.max_num_batched_tokens,
                      max_num_seqs=engine.max_num_seqs if config.max_tokens else 1,
                      captured_layers=len(facts.capture_layer_ids),
                      device_memory=parse_size(memory),
                      utilization=getattr(config, "gpu_memory_utilization", 0.9))


def estimate(config: JobConfig, limit: int | None = None) -> Estimate:
    config.check_required(("model", "corpus"))
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    facts = ModelFacts.resolve(config)
    files = expand_corpus(config.corpus, config.corpus_storage_options)
    override, _, _ = load_chat_template(config, facts)
    done: set[str] = set()
    if config.output:
        output = RunDir(config.output, config.storage_options)
        if output.exists(RUN_JSON):
            done = settled_ids(output, retry_failed=config.retry_failed)
    tokenizer = SampleTokenizer(TokenizeSettings(
        tokenizer=facts.model, max_prompt_tokens=facts.max_model_len - config.max_tokens, overlength=config.overlength,
        chat_template=override, revision=config.revision, trust_remote_code=config.trust_remote_code))
    spec = facts.file_spec(config.storage_dtype)
    generated = max(config.max_tokens - 1, 0) if config.include_output_tokens else 0
    est = Estimate(layer_ids=list(facts.layer_ids), hidden_size=facts.hidden_size, dtype=spec.storage_dtype or facts.dtype,
                   target=spec.target,
                   assumed_generated_tokens=config.max_tokens if config.include_output_tokens else 0,
                   device=_device_fit(config, facts) if getattr(config, "device_memory", None) else None)
    kinds: Counter[str] = Counter()
    seen: set[str] = set()
    read = 0
    for file in files:
        if limit is not None and read >= limit:
            break
        for block in read_records(file, config.id_field, config.corpus_storage_options):
            for record in block:
                if limit is not None and read >= limit:
                    break
                read += 1
                if record.sample_id in done:
                    est.already_done += 1
                    continue
                error = record.error
                if error is None and record.sample_id in seen:
                    error = "duplicate sample id"
                seen.add(record.sample_id)
                if error is None:
                    try:
                        out = tokenizer.tokenize(record.payload)
                    except SampleError as e:
                        error = str(e)
                if error is not None:
                    est.failed += 1
                    kinds[error_kind(error)] += 1
                    continue
                n = len(out.ids)
                size = file_bytes(spec, record.sample_id, n, n + generated, config.include_output_tokens)
                est.samples += 1
                est.truncated += out.truncated
                est.tokens += n + generated
                est.bytes += size
                est.max_file_bytes = max(est.max_file_bytes, size)
    est.measured = read - est.already_done
    est.failure_kinds = dict(kinds.most_common())
    est.records = read
    if limit is not None and read >= limit:
        total = sum(count_records(f, config.corpus_storage_options) for f in files)
        if total > read and est.measured:
            scale = (total - est.already_done) / est.measured
            for name in ("samples", "failed", "truncated", "tokens", "bytes"):
                setattr(est, name, round(getattr(est, name) * scale))
            est.failure_kinds = {k: round(v * scale) for k, v in est.failure_kinds.items()}
        est.records = max(total, read)
    return est
