"""The reference target's corpus: the standard library's Python sources, split by a hash, and what is cut from them.

    CorpusFile                                 one .py file (relative path, path, size); .read()
    stdlib_corpus(heldout_fraction) -> (train, heldout)   the corpus split, by a hash of each file's relative path
    is_heldout(rel, heldout_fraction)          the split rule for one relative path
    build_tokenizer(texts, vocab_size, out_dir)   a byte-level BPE (the `tokenizers` library) trained on texts
    token_stream(tokenizer, texts), token_blocks(stream, length)   each text followed by <|endoftext|>, cut into
                                               fixed-length blocks
    heldout_blocks(...), heldout_prompts(...)  what the held-out files give: blocks to measure the loss over, prompts

Corpus: every .py file under the interpreter's stdlib folder (sysconfig "stdlib"), skipping site-packages, test
folders and test_*.py files. A file is held out when sha256(relative path) falls under `heldout_fraction`, so the split
is the same on every machine with the same Python, and held-out prompts come from files the target never read.

Python source ships with every Python (no downloads). reference/target.py trains on it; reference/vl_target.py
trains its tokenizer with build_tokenizer too.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import sysconfig
from dataclasses import dataclass

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class CorpusFile:
    rel: str
    """Path relative to the stdlib folder (posix separators)."""
    path: str
    size: int

    def read(self) -> str:
        with open(self.path, encoding="utf-8", errors="replace") as f:
            return f.read()


# -- the split ----------------------------------------------------------------------------------------------------


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_heldout(rel: str, heldout_fraction: float) -> bool:
    """The split: sha256 of the relative path, as a number in [0, 1), under the held-out share."""
    digest = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction


def stdlib_corpus(heldout_fraction: float, root: str | None = None) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """(train, heldout) .py files of the standard library, sorted by relative path."""
    root = root or stdlib_root()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("test"))
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith("test_"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            files.append(CorpusFile(rel, path, os.path.getsize(path)))
    if not files:
        raise RuntimeError(f"no .py files under the standard library folder {root!r}; the reference target trains on "
                           "them (a Python installed without its sources cannot build it)")
    files.sort(key=lambda f: f.rel)
    train = [f for f in files if not is_heldout(f.rel, heldout_fraction)]
    heldout = [f for f in files if is_heldout(f.rel, heldout_fraction)]
    return train, heldout


# -- tokens -------------------------------------------------------------------------------------------------------


def build_tokenizer(texts: list[str], vocab_size: int, out_dir: str):
    """A byte-level BPE trained on `texts` (HF-loadable, eos and pad set), saved to out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN, PAD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, bos_token=None,
                                 unk_token=None, model_max_length=10**6)
    hf.save_pretrained(out_dir)
    return hf


def token_stream(tokenizer, texts: list[str]):
    """Every text's ids followed by eos, end to end."""
    import torch

    ids: list[int] = []
    for batch_start in range(0, len(texts), 64):
        for row in tokenizer(texts[batch_start:batch_start + 64])["input_ids"]:
            ids.extend(row)
            ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.int64)  # [total tokens]


def token_blocks(stream, length: int):
    """The stream cut into whole blocks of `length` (the rest dropped)."""
    n = stream.numel() // length
    return stream[:n * length].view(n, length)  # [n, length]


# -- what the held-out files give ---------------------------------------------------------------------------------


def heldout_blocks(tokenizer, heldout: list[CorpusFile], context_length: int, count: int, seed: int):
    """`count` blocks of `context_length` tokens spread over the held-out files: from each file (in an order drawn
    with seed + 1) a stretch of about two blocks starting at a random line, until there are `count` blocks."""
    rng = random.Random(seed + 1)
    files = list(heldout)
    rng.shuffle(files)
    blocks = []
    for f in files:
        text = f.read()
        span = 2 * context_length * 8  # characters: a token is 2-5 of them, so this fills two blocks
        if len(text) > span:
            start = text.find("\n", rng.randrange(len(text) - span)) + 1
            text = text[start:start + span]
        ids = token_stream(tokenizer, [text])[:2 * context_length]
        blocks += list(token_blocks(ids, context_length))
        if len(blocks) >= count:
            break
    if not blocks:
        raise ValueError("the held-out files are shorter than one block; lower context_length")
    import torch

    return torch.stack(blocks[:count])  # [n, S]


def end_prompt(text: str) -> str:
    """A prompt ends at the last non-blank character: the BPE merges a newline with the next line's indentation, so
    a prompt ending in newlines would end in tokens the target rarely saw there (its greedy output then degenerates)."""
    return text.rstrip()


def heldout_prompts(tokenizer, heldout: list[CorpusFile], count: int, prompt_tokens: int, seed: int) -> list[str]:
    """`count` snippets of held-out files, whole lines from a non-blank line on (ending at the last non-blank
    character), between half and all of `prompt_tokens` tokens long, chosen with `seed` (a few per file, files in a
    seeded order)."""
    rng = random.Random(seed)
    files = list(heldout)
    rng.shuffle(files)
    per_file = max(1, math.ceil(count / len(files)))
    prompts: list[str] = []
    for f in files:
        lines = f.read().splitlines(keepends=True)
        starts = [i for i, ln in enumerate(lines) if ln.strip()]
        if not starts:
            continue
        costs = [len(ids) for ids in tokenizer(lines)["input_ids"]]
        taken = 0
        for start in rng.sample(starts, len(starts)):
            n, end = 0, start
            while end < len(lines) and n + costs[end] <= prompt_tokens:
                n, end = n + costs[end], end + 1
            if n >= prompt_tokens // 2:
                prompts.append(end_prompt("".join(lines[start:end])))
                taken += 1
            if taken == per_file:
                break
        if len(prompts) >= count:
            break
    return prompts[:count]
