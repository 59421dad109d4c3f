"""The memory levers (drafters/memory.py) change nothing learned: every family's loss, agreement counts and gradients
with --ce-chunk-tokens (many small chunks) and --gradient-checkpointing equal the plain step's; --autocast bfloat16
stays within bf16's precision of float32; bad values are refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.drafters.helpers import family_setup
from tests.drafters.helpers import packed_batch as _batch

OPTIONS = {"eagle3": dict(draft_vocab_size=48), "peagle": dict(draft_vocab_size=48, ttt_steps=4),
           "eagle": {}, "dflash": dict(block_size=4, max_anchors=16), "medusa": {}, "mlp_speculator": {}}


def _step(drafter, target, batch, seed=5):
    torch.manual_seed(seed)
    drafter.zero_grad()
    result = drafter.training_step(batch, target)
    result.loss.backward()
    return result, {k: p.grad.clone() for k, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", sorted(OPTIONS))
def test_chunked_cross_entropy_and_recomputation_change_nothing(kind, oracle_run, tiny_llama):
    from drafters.memory import MemoryOptions
    from drafters.registry import drafter_class

    ds, target, drafter = family_setup(oracle_run, tiny_llama, drafter_class(kind), **OPTIONS[kind])
    batch = _batch(ds, [0, 1, 2], max_tokens=96)
    lean = copy.deepcopy(drafter)
    lean.use_memory(MemoryOptions(gradient_checkpointing=True, ce_chunk_tokens=7))
    assert lean.recomputable(), f"{kind} names no module for --gradient-checkpointing"
    plain, plain_grads = _step(drafter, target, batch)
    chunked, chunked_grads = _step(lean, target, batch)
    torch.testing.assert_close(chunked.loss, plain.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(chunked.correct, plain.correct) and torch.equal(chunked.counted, plain.counted)
    assert chunked_grads.keys() == plain_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_chunks_are_recomputed_not_kept(oracle_run, tiny_llama):
    """With --ce-chunk-tokens the graph keeps no [rows, vocabulary] logits: the saved tensors of the backward hold
    less than a tenth of the unchunked step's."""
    from drafters.memory import MemoryOptions
    from drafters.registry import drafter_class

    ds, target, drafter = family_setup(oracle_run, tiny_llama, drafter_class("medusa"))
    batch = _batch(ds, [0, 1, 2], max_tokens=96)

    def saved_bytes(model) -> int:
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size() if t.shape and t.shape[-1] == target.vocab_size else 0
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.training_step(batch, target)
        return total[0]

    lean = copy.deepcopy(drafter)
    lean.use_memory(MemoryOptions(ce_chunk_tokens=8))
    assert saved_bytes(lean) < saved_bytes(drafter) / 10


def test_autocast_bfloat16_trains_within_bf16_precision(oracle_run, tiny_llama):
    from drafters.memory import MemoryOptions, autocast
    from drafters.registry import drafter_class

    ds, target, drafter = family_setup(oracle_run, tiny_llama, drafter_class("eagle3"), draft_vocab_size=48)
    batch = _batch(ds, [0, 1, 2], max_tokens=96)
    plain, _ = _step(drafter, target, batch)
    options = MemoryOptions(autocast="bfloat16")
    drafter.use_memory(options)
    with autocast(options, torch.device("cpu")):
        half, grads = _step(drafter, target, batch)
    assert half.loss.dtype == torch.float32 and torch.isfinite(half.loss)
    assert float(half.loss) == pytest.approx(float(plain.loss), rel=3e-2)
    assert all(g.dtype == torch.float32 and bool(torch.isfinite(g).all()) for g in grads.values())


def test_gradient_checkpointing_turns_off_again(oracle_run, tiny_llama):
    from drafters.memory import MemoryOptions
    from drafters.registry import drafter_class

    _, _, drafter = family_setup(oracle_run, tiny_llama, drafter_class("dflash"), block_size=4)
    plain = type(drafter.layers[0]).forward
    drafter.use_memory(MemoryOptions(gradient_checkpointing=True))
    assert drafter.layers[0].forward.func.__name__ == "_recomputed"
    drafter.use_memory(MemoryOptions())
    assert drafter.layers[0].forward.__func__ is plain


@pytest.mark.parametrize("options, message", [(dict(ce_chunk_tokens=-1), "--ce-chunk-tokens must be >= 0"),
                                              (dict(autocast="float16"), "--autocast 'float16'")])
def test_bad_memory_options_are_refused(options, message):
    from drafters.memory import MemoryOptions

    with pytest.raises(ValueError, match=message):
        MemoryOptions(**options)


def test_a_chunk_too_small_to_pay_is_warned_about_and_a_useful_one_is_not(caplog):
    """--ce-chunk-tokens 1 ran 10x slower without a word: the same result, so a warning, not a refusal."""
    from drafters.memory import MIN_USEFUL_CE_CHUNK, MemoryOptions

    with caplog.at_level("WARNING", logger="drafters.memory"):
        MemoryOptions(ce_chunk_tokens=1)
        assert "--ce-chunk-tokens 1 recomputes the logits 1 rows at a time" in caplog.text
        caplog.clear()
        MemoryOptions(ce_chunk_tokens=MIN_USEFUL_CE_CHUNK)
        MemoryOptions(ce_chunk_tokens=0)
        assert caplog.text == ""


def test_chunked_teacher_keeps_states_not_vocabulary_wide_logits(oracle_run, tiny_llama):
    """Medusa's and MLPSpeculator's teacher with --ce-chunk-tokens: the [n, V] logits are never kept; each position's
    greedy token and distribution equal the unchunked teacher's."""
    from drafters.last_state import TeacherLogits
    from drafters.medusa import MedusaDrafter

    ds, target, _ = family_setup(oracle_run, tiny_llama, MedusaDrafter)
    batch = _batch(ds, [0, 1, 2], max_tokens=96)
    post = target.post_norm(batch.layer(max(batch.layer_ids)))
    whole, chunked = TeacherLogits.of(batch, post, target), TeacherLogits.of(batch, post, target, chunk=8)
    assert whole.logits is not None and chunked.logits is None and chunked.states.shape[-1] == target.hidden_size
    assert torch.equal(whole.greedy, chunked.greedy) and whole.greedy.numel() > 8
    where = torch.arange(whole.greedy.numel())
    index = torch.arange(5, 13)
    torch.testing.assert_close(chunked.distribution(where)(index), whole.distribution(where)(index))


@pytest.mark.parametrize("kind", sorted(OPTIONS))
@pytest.mark.parametrize("chunk", [0, 7])
def test_a_batch_with_nothing_trained_gives_a_zero_loss(kind, chunk, oracle_run, tiny_llama):
    """Every position loss-masked out (a prompt-only stretch): a zero loss that still backpropagates, nothing
    counted, no error, with and without --ce-chunk-tokens."""
    from drafters.memory import MemoryOptions
    from drafters.registry import drafter_class

    ds, target, drafter = family_setup(oracle_run, tiny_llama, drafter_class(kind), **OPTIONS[kind])
    drafter.use_memory(MemoryOptions(ce_chunk_tokens=chunk))
    batch = _batch(ds, [0, 1], max_tokens=64)
    batch.loss_mask = torch.zeros_like(batch.loss_mask)
    result = drafter.training_step(batch, target)
    assert float(result.loss) == 0.0 and int(result.counted.sum()) == 0
    result.loss.backward()
