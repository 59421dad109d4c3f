"""A target whose acceptance lengths mean something: a small Llama trained here, on CPU, on the Python standard library.

    ReferenceTargetConfig(...)                 sizes, training length, seed, cache root (typed, validated)
    build_reference_target(config) -> ReferenceTarget
        .path            a HF Llama checkpoint folder with its tokenizer (AutoModelForCausalLM / AutoTokenizer /
                         extractor.LLM load it)
        .train_files     the stdlib files it was trained on; .train_texts() reads them
        .heldout_files   the files it never saw; .prompts are snippets of them (held-out prompts)
        .report          reference_target.json: losses, held-out perplexity, corpus and timing

Random-weight models (reference/tiny_models.py) measure machinery; a drafter's acceptance length on them says nothing.
This target has learned something real — Python source, which ships with every Python (no downloads) — so a drafter
trained on its hidden states can be accepted or not for reasons that matter.

Corpus: the standard library's .py files, split by a hash of each file's path (reference/stdlib_corpus.py: the split,
the tokenizer, the token blocks, the held-out blocks and prompts).

Build: byte-level BPE tokenizer trained on the train split -> token stream (each file followed by <|endoftext|>) cut
into fixed-length blocks -> plain AdamW with warm-up + cosine decay, seeded -> held-out loss over blocks of the
held-out files -> save_pretrained of model and tokenizer. With mtp_layers, an MTP layer (drafters.mtp.MtpHead) trains
beside the target and is written into its checkpoint in the family's own layout.

Cache: CACHE_ROOT/<name>-<digest>/, digest over the config's training fields, the corpus file list (relative paths
and sizes), this module's BUILD_VERSION and the torch / transformers / tokenizers / Python versions. The folder is
built under CACHE_ROOT/.tmp-* and renamed into place only when complete, so a folder under the final name is
complete; a temp folder left by a killed build is never read (and is removed once it is a day old). A second call
with the same config returns the cached folder without training.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field

from reference.stdlib_corpus import (
    CorpusFile,
    build_tokenizer,
    end_prompt,
    heldout_blocks,
    heldout_prompts,
    stdlib_corpus,
    token_blocks,
    token_stream,
)

logger = logging.getLogger(__name__)

BUILD_VERSION = "1"
"""Bump when the build changes what it produces for the same config (the cache digest includes it)."""
REPORT_NAME = "reference_target.json"
PROMPTS_NAME = "heldout_prompts.jsonl"
ARCHITECTURES = ("llama", "deepseek_v3", "qwen3_next")
_STALE_TEMP_S = 24 * 3600


def cache_folder(name: str) -> str:
    """$HSX_CACHE/NAME, else ~/.cache/hsx/NAME: where hsx keeps what it builds once (reference targets)."""
    base = os.environ.get("HSX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hsx")
    return os.path.join(base, name)


def default_cache_root() -> str:
    """$HSX_CACHE/reference-target, else ~/.cache/hsx/reference-target."""
    return cache_folder("reference-target")


@dataclass(frozen=True)
class ReferenceTargetConfig:
    """The reference target: model sizes, tokenizer, training length and where the result is cached.

    The default (1200 steps, 2.5M tokens: 12 CPU-minutes, ~15 min wall on a loaded 2-core machine) writes
    Python-looking code (held-out perplexity ~39); 400 steps (~5 min) still loops on its own output. Tests use a
    much smaller config."""

    hidden_size: int = 128
    """Model width."""
    num_hidden_layers: int = 8
    """Decoder layers; at least 8 so EAGLE-3's aux layers [2, N//2, N-3] are three distinct layers."""
    num_attention_heads: int = 4
    """Attention heads (hidden_size must divide by it)."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention; num_attention_heads must divide by it)."""
    intermediate_size: int = 384
    """MLP width."""
    vocab_size: int = 2048
    """BPE vocabulary size, special tokens included."""
    context_length: int = 256
    """Training block length in tokens; also the checkpoint's max_position_embeddings (prompt + output must fit)."""
    batch_size: int = 8
    """Blocks per optimizer step."""
    steps: int = 1200
    """Optimizer steps; tokens trained on = steps * batch_size * context_length."""
    learning_rate: float = 4e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay to 10%)."""
    warmup_steps: int = 30
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (matrices only)."""
    heldout_fraction: float = 0.1
    """Share of stdlib files held out (by a hash of the relative path): never trained on, source of the prompts."""
    heldout_blocks: int = 64
    """Held-out blocks (drawn from all held-out files) the final held-out loss is computed over (at most)."""
    max_train_files: int | None = None
    """Train on the first this many train files (sorted by path) only; None = all (tests use a few)."""
    num_prompts: int = 64
    """Held-out prompts to cut from held-out files."""
    prompt_tokens: int = 64
    """Approximate prompt length in tokens (a prompt starts and ends at a line boundary)."""
    seed: int = 0
    """Seeds the initialisation, the block order and the prompt choice."""
    architecture: str = "llama"
    """The target's family: "llama", or one whose checkpoints ship MTP layers in vLLM's layouts, "deepseek_v3"
    (MLA attention, MoE MLPs after the first layer) or "qwen3_next" (linear attention in 3 of 4 layers, MoE)."""
    mtp_layers: int = 0
    """1: an MTP layer trained beside the target (deepseek_v3 / qwen3_next only) and written into its checkpoint in
    the family's own layout, so that method "mtp" drafts with a native head that means something; 0: none."""
    mtp_loss_weight: float = 0.3
    """Weight of the MTP loss (cross-entropy of x_{t+2} from the target's post-norm state of x_t and the embedding of
    x_{t+1}) beside the language-model loss; DeepSeek-V3 used 0.3. The target's states reach it detached: the target
    is trained as it would be without MTP layers."""
    threads: int | None = None
    """torch CPU threads while training; None = torch's default."""
    cache_root: str = field(default_factory=default_cache_root)
    """Where built targets are kept: $HSX_CACHE/reference-target or ~/.cache/hsx/reference-target."""

    def __post_init__(self) -> None:
        if self.num_hidden_layers < 8:
            raise ValueError(f"num_hidden_layers={self.num_hidden_layers}: use at least 8, so EAGLE-3's aux layers "
                             "[2, N//2, N-3] are three distinct layers")
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                     "context_length", "batch_size", "steps", "num_prompts", "prompt_tokens", "heldout_blocks"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} does not divide by num_attention_heads="
                             f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} does not divide by "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.vocab_size < 300:
            raise ValueError(f"vocab_size={self.vocab_size}: a byte-level BPE needs at least 256 bytes + specials; "
                             "use >= 300 (default 4096)")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        if self.warmup_steps < 0 or self.learning_rate <= 0:
            raise ValueError("warmup_steps must be >= 0 and learning_rate > 0")
        if self.prompt_tokens >= self.context_length:
            raise ValueError(f"prompt_tokens={self.prompt_tokens} leaves no room to generate within context_length="
                             f"{self.context_length}")
        if self.max_train_files is not None and self.max_train_files < 1:
            raise ValueError(f"max_train_files must be >= 1 or None, got {self.max_train_files}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r}: choose one of {list(ARCHITECTURES)}")
        if self.mtp_layers not in (0, 1) or (self.mtp_layers and self.architecture == "llama"):
            raise ValueError(f"mtp_layers={self.mtp_layers}: one MTP layer (1) or none (0), as the targets that "
                             "ship them; MTP layers need architecture deepseek_v3 or qwen3_next (their checkpoints' "
                             "layouts)")
        if self.mtp_loss_weight <= 0:
            raise ValueError(f"mtp_loss_weight must be > 0, got {self.mtp_loss_weight}")

    def training_fields(self) -> dict:
        """What determines the checkpoint (everything but where it is cached and how many threads build it); the
        architecture and MTP fields only when they differ from a plain Llama's (so a Llama keeps its cache key)."""
        out = asdict(self)
        out.pop("cache_root")
        out.pop("threads")
        if self.architecture == "llama" and not self.mtp_layers:
            for name in ("architecture", "mtp_layers", "mtp_loss_weight"):
                out.pop(name)
        return out


@dataclass(frozen=True)
class ReferenceTarget:
    path: str
    """The checkpoint folder: config.json, model.safetensors, tokenizer files, reference_target.json."""
    train_files: tuple[CorpusFile, ...]
    heldout_files: tuple[CorpusFile, ...]
    prompts: tuple[str, ...]
    """Held-out prompts: snippets of held-out files (also in heldout_prompts.jsonl)."""
    report: dict
    cached: bool
    """True when this call found the folder built already."""

    def train_texts(self) -> list[str]:
        """The train split's file contents, in path order (what the target and its tokenizer were trained on)."""
        return [f.read() for f in self.train_files]


# -- cache --------------------------------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    """Versions that change what a build produces; read from package metadata (no imports: a cache hit stays fast)."""
    from importlib.metadata import version

    return {"build": BUILD_VERSION, "python": sys.version.split()[0], "torch": version("torch"),
            "transformers": version("transformers"), "tokenizers": version("tokenizers")}


def cache_key(config: ReferenceTargetConfig, train: list[CorpusFile], heldout: list[CorpusFile]) -> str:
    doc = {"config": config.training_fields(), "versions": _versions(),
           "train": [[f.rel, f.size] for f in train], "heldout": [[f.rel, f.size] for f in heldout]}
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
    c = config
    mtp = f"-mtp{c.mtp_layers}" if c.mtp_layers else ""
    return f"{c.architecture}-h{c.hidden_size}-l{c.num_hidden_layers}-v{c.vocab_size}-s{c.steps}{mtp}-{digest}"


def _complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, REPORT_NAME)) and os.path.isfile(os.path.join(folder, "config.json"))


def _remove_stale_temps(root: str) -> None:
    now = time.time()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith(".tmp-") and os.path.isdir(path) and now - os.path.getmtime(path) > _STALE_TEMP_S:
            shutil.rmtree(path, ignore_errors=True)


def build_reference_target(config: ReferenceTargetConfig | None = None, *, progress: bool = True) -> ReferenceTarget:
    """The reference target for `config`: from the cache, or trained now (minutes on CPU) and cached."""
    config = config or ReferenceTargetConfig()
    train, heldout = stdlib_corpus(config.heldout_fraction)
    if config.max_train_files is not None:
        train = train[:config.max_train_files]
    if not heldout:
        raise ValueError(f"heldout_fraction={config.heldout_fraction} holds out no file; raise it")
    name = cache_key(config, train, heldout)
    final = os.path.join(config.cache_root, name)
    if _complete(final):
        return _load(final, train, heldout, cached=True)
    os.makedirs(config.cache_root, exist_ok=True)
    _remove_stale_temps(config.cache_root)
    tmp = os.path.join(config.cache_root, f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        _build(config, train, heldout, tmp, progress=progress)
        if os.path.isdir(final) and not _complete(final):  # not ours and not complete: set it aside
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _complete(final):  # a concurrent build's folder that finished first is as good as ours
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _load(final, train, heldout, cached=False)


def _load(folder: str, train, heldout, *, cached: bool) -> ReferenceTarget:
    with open(os.path.join(folder, REPORT_NAME)) as f:
        report = json.load(f)
    with open(os.path.join(folder, PROMPTS_NAME)) as f:
        prompts = tuple(end_prompt(json.loads(line)["prompt"]) for line in f if line.strip())  # also older folders'
    return ReferenceTarget(path=folder, train_files=tuple(train), heldout_files=tuple(heldout), prompts=prompts,
                           report=report, cached=cached)


# -- build --------------------------------------------------------------------------------------------------------


def _lr(step: int, config: ReferenceTargetConfig) -> float:
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _build(config: ReferenceTargetConfig, train: list[CorpusFile], heldout: list[CorpusFile], out_dir: str, *,
           progress: bool) -> None:
    import torch

    started = time.perf_counter()
    previous_threads = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        train_texts = [f.read() for f in train]
        tokenizer = build_tokenizer(train_texts, config.vocab_size, out_dir)
        tokenizer_s = time.perf_counter() - started
        train_blocks = token_blocks(token_stream(tokenizer, train_texts), config.context_length)  # [n, S]
        test_blocks = heldout_blocks(tokenizer, heldout, config.context_length, config.heldout_blocks, config.seed)
        if len(train_blocks) == 0 or len(test_blocks) == 0:
            raise ValueError("the corpus is shorter than one block; lower context_length or raise max_train_files")
        g = torch.Generator().manual_seed(config.seed)

        model, mtp, optimizer = _new_model(config, tokenizer)
        train_started = time.perf_counter()
        losses, epochs = _train(model, optimizer, train_blocks, g, config, progress, mtp)
        train_s = time.perf_counter() - train_started

        model.eval()
        with torch.no_grad():
            heldout_loss = sum(float(model(input_ids=b[None], labels=b[None]).loss) for b in test_blocks) \
                / len(test_blocks)
        mtp_report = _mtp_heldout(model, mtp, test_blocks) if mtp is not None else {}
        prompts = heldout_prompts(tokenizer, heldout, config.num_prompts, config.prompt_tokens, config.seed)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(out_dir)
        if mtp is not None:
            _write_mtp(out_dir, mtp)
        with open(os.path.join(out_dir, PROMPTS_NAME), "w") as f:
            for p in prompts:
                f.write(json.dumps({"prompt": p}) + "\n")
        tail = losses[-max(1, len(losses) // 10):]
        report = {
            "config": config.training_fields(), "versions": _versions(),
            "parameters": sum(p.numel() for p in model.parameters()),
            "train_files": len(train), "heldout_files": len(heldout),
            "train_tokens_available": int(train_blocks.numel()),
            "train_tokens_seen": config.steps * config.batch_size * config.context_length, "epochs": epochs,
            "first_loss": losses[0], "final_train_loss": sum(tail) / len(tail),
            "loss_curve": losses[::max(1, len(losses) // 50)],
            "heldout_loss": heldout_loss, "heldout_perplexity": math.exp(heldout_loss),
            "heldout_tokens": int(test_blocks.numel()), "num_prompts": len(prompts),
            "tokenizer_seconds": round(tokenizer_s, 2), "train_seconds": round(train_s, 2),
            "build_seconds": round(time.perf_counter() - started, 2), "threads": torch.get_num_threads(),
            **mtp_report,
        }
        with open(os.path.join(out_dir, REPORT_NAME), "w") as f:  # written last: marks the folder complete
            json.dump(report, f, indent=2)
        logger.info("reference target: train loss %.3f, held-out loss %.3f (perplexity %.1f), %.0f s",
                    report["final_train_loss"], heldout_loss, report["heldout_perplexity"], report["build_seconds"])
    finally:
        torch.set_num_threads(previous_threads)


def _model_config(config: ReferenceTargetConfig, tokenizer):
    """The transformers config of the target: the config's sizes in its architecture (MoE experts a third of the MLP
    width each (a multiple of 8), two of four routed per token; DeepSeek's MLA latent half the width)."""
    import transformers

    common = dict(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        max_position_embeddings=config.context_length, rms_norm_eps=1e-5, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        attention_dropout=0.0)
    head_dim = config.hidden_size // config.num_attention_heads
    expert = max(8, config.intermediate_size // 3 // 8 * 8)  # grouped matmuls want 16-byte strides
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=expert)
    if config.architecture == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **common, **moe, num_key_value_heads=config.num_attention_heads, n_routed_experts=4, n_shared_experts=1,
            first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=config.hidden_size // 2, q_lora_rank=None,
            qk_rope_head_dim=head_dim // 2, qk_nope_head_dim=head_dim, v_head_dim=head_dim,
            num_nextn_predict_layers=config.mtp_layers)
    if config.architecture == "qwen3_next":
        return transformers.Qwen3NextConfig(
            **common, **moe, num_key_value_heads=config.num_key_value_heads, head_dim=head_dim, num_experts=4,
            shared_expert_intermediate_size=expert,
            linear_num_value_heads=config.num_attention_heads, linear_num_key_heads=config.num_key_value_heads,
            linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, num_nextn_predict_layers=config.mtp_layers)
    return transformers.LlamaConfig(**common, num_key_value_heads=config.num_key_value_heads)


def _new_model(config: ReferenceTargetConfig, tokenizer):
    """An untrained target of the config's architecture and sizes (weights drawn from config.seed), its MTP layers
    (drafters.mtp.MtpHead; None without mtp_layers) and one AdamW over both (no weight decay on norms and biases)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(config.seed)
    model = AutoModelForCausalLM.from_config(_model_config(config, tokenizer), dtype=torch.float32)
    params = list(model.named_parameters())
    mtp = None
    if config.mtp_layers:
        from drafters.mtp import MtpHead
        from drafters.mtp_styles import STYLES

        mtp = MtpHead(model.config, STYLES[config.architecture], config.mtp_layers,
                      model.get_input_embeddings().weight, model.get_output_embeddings().weight)
        for module in mtp.modules():  # transformers' own initialisation (experts start as torch.empty)
            model._init_weights(module)
        mtp.train()
        params += [(f"mtp.{n}", p) for n, p in mtp.named_parameters()]
    decay = [p for n, p in params if p.ndim >= 2]
    no_decay = [p for n, p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=config.learning_rate, betas=(0.9, 0.95))
    return model, mtp, optimizer


def _losses(model, mtp, batch):
    """(language-model loss, MTP loss or None) of a batch [B, S]: MTP layer 0 reads (x_{t+1}, the target's post-norm
    state of x_t, detached) and predicts x_{t+2}, attending causally over the row."""
    import torch
    import torch.nn.functional as F

    if mtp is None:
        return model(input_ids=batch, labels=batch).loss, None
    hidden = model.model(input_ids=batch).last_hidden_state  # [B, S, H] after the final norm
    logits = model.lm_head(hidden)
    lm = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
    b, s = batch.shape
    positions = torch.arange(s - 1).expand(b, -1)
    carried = mtp.layer_forward(0, batch[:, 1:], hidden[:, :-1].detach(), positions, None, None)
    mtp_logits = mtp.logits(carried[:, :-1], 0)
    return lm, F.cross_entropy(mtp_logits.flatten(0, 1), batch[:, 2:].flatten())


def _mtp_heldout(model, mtp, blocks) -> dict:
    """The MTP layer's held-out loss and how often its argmax is x_{t+2} (what a draft accepted at position 1
    needs), over the held-out blocks."""
    import torch

    mtp.eval()
    with torch.no_grad():
        losses, hits, total = [], 0, 0
        for b in blocks:
            _, loss = _losses(model, mtp, b[None])
            losses.append(float(loss))
            hidden = model.model(input_ids=b[None]).last_hidden_state
            carried = mtp.layer_forward(0, b[None, 1:], hidden[:, :-1], torch.arange(len(b) - 1)[None], None, None)
            hits += int((mtp.logits(carried[:, :-1], 0).argmax(-1) == b[None, 2:]).sum())
            total += len(b) - 2
    return {"mtp_heldout_loss": sum(losses) / len(losses), "mtp_heldout_top1": hits / total}


def _write_mtp(out_dir: str, mtp) -> None:
    """The MTP layers into the saved checkpoint, under the family's own keys (drafters.mtp.checkpoint_tensors)."""
    from safetensors.torch import load_file, save_file

    from drafters.mtp import checkpoint_tensors

    path = os.path.join(out_dir, "model.safetensors")
    weights = load_file(path)
    dtype = next(iter(weights.values())).dtype
    weights.update({k: v.to(dtype).contiguous() for k, v in checkpoint_tensors(mtp).items()})
    save_file(weights, path, metadata={"format": "pt"})


def _train(model, optimizer, train_blocks, g, config: ReferenceTargetConfig, progress: bool,
           mtp=None) -> tuple[list[float], int]:
    """config.steps optimizer steps over the blocks [n, S] in an order drawn from `g`, drawn again each epoch: the
    language-model loss of every step and the epochs completed (with MTP layers, their loss is added, weighted
    mtp_loss_weight)."""
    import torch
    from tqdm.auto import tqdm

    order = torch.randperm(len(train_blocks), generator=g)
    cursor, epochs = 0, 0
    losses: list[float] = []
    model.train()
    bar = tqdm(range(config.steps), desc="reference target", disable=not progress, unit="step")
    for step in bar:
        if cursor + config.batch_size > len(order):
            order, cursor, epochs = torch.randperm(len(train_blocks), generator=g), 0, epochs + 1
        idx = order[cursor:cursor + config.batch_size]
        cursor += config.batch_size
        batch = train_blocks[idx]  # [B, S]
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, config)
        loss, mtp_loss = _losses(model, mtp, batch)
        (loss if mtp_loss is None else loss + config.mtp_loss_weight * mtp_loss).backward()
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *(mtp.parameters() if mtp is not None else ())], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    return losses, epochs


def main(argv: list[str] | None = None) -> None:
    """python -m reference.target [--steps N] [--threads T]: build (or find) the default target, print it."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--steps", type=int, default=ReferenceTargetConfig.steps)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cache-root", default=None)
    args = p.parse_args(argv)
    kwargs = {"steps": args.steps, "threads": args.threads}
    if args.cache_root:
        kwargs["cache_root"] = args.cache_root
    target = build_reference_target(ReferenceTargetConfig(**kwargs))
    report = {k: v for k, v in target.report.items() if k != "loss_curve"}
    print(json.dumps({"path": target.path, "cached": target.cached, **report}, indent=2))


if __name__ == "__main__":
    main()
