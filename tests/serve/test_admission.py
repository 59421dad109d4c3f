"""The bound that lets `hsx serve` refuse a text prompt too long for --max-prompt-tokens without tokenizing it:
checked against real tokenization (the oracle) on real and hostile text, and refused for tokenizers where a
character can vanish (where no bound holds)."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from reference.stdlib_corpus import stdlib_corpus
from serve.engine import max_bytes_per_token


def stdlib_text(n_chars: int) -> str:
    """At least n_chars of the standard library's sources (or all of them), in the reference target's file order."""
    parts, size = [], 0
    for f in stdlib_corpus(heldout_fraction=0.0)[0]:
        parts.append(f.read())
        size += len(parts[-1])
        if size > n_chars:
            break
    return "".join(parts)


def hostile_texts(tokenizer, rng: random.Random) -> list[str]:
    vocab = [tokenizer.convert_tokens_to_string([t]) for t in tokenizer.get_vocab()]
    longest = max(vocab, key=len)
    specials = list(tokenizer.all_special_tokens)
    source = stdlib_text(400_000)
    texts = [source[i:i + rng.randint(1, 4000)] for i in (rng.randrange(len(source)) for _ in range(150))]
    texts += ["".join(rng.choice(vocab) for _ in range(rng.randint(1, 300))) for _ in range(50)]  # piece by piece
    texts += [longest * rng.randint(1, 200) for _ in range(10)]
    texts += ["".join(rng.choice(specials + [" ", "\n", "x"]) for _ in range(rng.randint(1, 500))) for _ in range(30)]
    texts += [" " * rng.randint(1, 5000), "\t\n" * 999, "\x00" * 300, "é漢🙂" * 400]
    texts += ["".join(chr(rng.randint(1, 0x2FFFF)) for _ in range(rng.randint(1, 400))) for _ in range(30)]
    return [t.encode("utf-8", "replace").decode("utf-8", "replace") for t in texts]  # no lone surrogates


def test_the_bound_never_exceeds_the_real_token_count(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    bound = max_bytes_per_token(tokenizer)
    # the local byte-level BPE: its longest added token, <|endoftext|>, is 13 bytes; no piece is longer
    assert bound == 13
    rng = random.Random(0)
    for text in hostile_texts(tokenizer, rng):
        tokens = len(tokenizer(text).input_ids)
        assert -(-len(text) // bound) <= tokens, (text[:80], len(text), tokens)


def _fast(tok: Tokenizer) -> PreTrainedTokenizerFast:
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=["<s>"])
    tok.train_from_iterator([stdlib_text(50_000)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tok


def test_a_byte_level_tokenizer_with_splits_that_keep_every_character_is_bounded():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([  # Llama-3's shape: a regex split, then bytes
        pre_tokenizers.Split(r"\s+|\w+|[^\s\w]+", behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    fast = _fast(tok)
    bound = max_bytes_per_token(fast)
    assert bound is not None
    for text in hostile_texts(fast, random.Random(1))[:120]:
        assert -(-len(text) // bound) <= len(fast(text).input_ids)


def _with_normalizer() -> Tokenizer:
    tok = _byte_level()
    tok.normalizer = normalizers.NFKC()
    return tok


def _dropping_whitespace() -> Tokenizer:
    tok = _byte_level()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel()])
    return tok


def _split_removing() -> Tokenizer:
    tok = _byte_level()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(r"\s+", behavior="removed"),
                                                 pre_tokenizers.ByteLevel(use_regex=False)])
    return tok


@pytest.mark.parametrize("build", [_with_normalizer, _dropping_whitespace, _split_removing],
                         ids=["nfkc-normalizer", "whitespace-split", "split-removed"])
def test_tokenizers_that_can_drop_characters_get_no_bound(build):
    fast = _fast(build())
    assert max_bytes_per_token(fast) is None


def test_dropping_characters_is_why_there_is_no_bound():
    """The case the refusal exists for: 20,000 characters that are four tokens (a, b, each with its prefix space)."""
    fast = _fast(_dropping_whitespace())
    assert len(fast("a" + " " * 19_998 + "b").input_ids) <= 4


def test_a_vocabulary_missing_bytes_without_an_unknown_token_gets_no_bound():
    tok = _byte_level()
    tok.train_from_iterator(["ab" * 50], trainers.BpeTrainer(vocab_size=20, show_progress=False))  # bytes a, b only
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    assert len(fast("x" * 1000 + "ab").input_ids) <= 2  # the 1000 unknown bytes vanish: no bound can hold
    assert max_bytes_per_token(fast) is None


def test_an_added_token_that_absorbs_whitespace_gets_no_bound():
    fast = _fast(_byte_level())
    assert max_bytes_per_token(fast) is not None
    fast.add_tokens([AddedToken("<mask>", lstrip=True)])
    assert max_bytes_per_token(fast) is None


def test_a_slow_tokenizer_gets_no_bound():
    class Slow:  # no backend_tokenizer: transformers' pure-Python tokenizers
        pass
    assert max_bytes_per_token(Slow()) is None
