"""drafters/attention.py against plain softmax attention over an explicit mask (the oracle written out here): outputs
and gradients, both layouts, grouped kv heads, packed rows of several documents and padding."""

import math

import pytest
import torch

from drafters.attention import Layout, ranged_attention


def _rows():
    # two packed rows: documents of 5, 1 and 6 tokens then padding; one of 9 and one of 3
    doc = torch.tensor([[0, 0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 2, -1, -1],
                        [3, 3, 3, 3, 3, 3, 3, 3, 3, 4, 4, 4, -1, -1]])
    return doc


def _oracle(q, row_of, keys, values, visible, extra_k, extra_v, scale):
    heads = q.shape[1]
    group = heads // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)[row_of]  # [n, H, S, d]
    v = values.repeat_interleave(group, dim=1)[row_of]
    scores = torch.einsum("nhd,nhsd->nhs", q, k) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    if extra_k is not None:
        ek = extra_k.repeat_interleave(group, dim=1)  # [n, H, E, d]
        ev = extra_v.repeat_interleave(group, dim=1)
        scores = torch.cat([scores, torch.einsum("nhd,nhed->nhe", q, ek) * scale], dim=-1)
        v = torch.cat([v, ev], dim=2)
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("nhs,nhsd->nhd", p, v)


@pytest.mark.parametrize("mode", ["at", "before"])
@pytest.mark.parametrize("extra", [0, 3])
def test_ranged_attention_equals_masked_softmax(mode, extra):
    torch.manual_seed(0)
    doc = _rows()
    r, s = doc.shape
    heads, kv_heads, d = 4, 2, 8
    scale = 1 / math.sqrt(d)
    keys = torch.randn(r, kv_heads, s, d, requires_grad=True)
    values = torch.randn(r, kv_heads, s, d, requires_grad=True)
    pos = torch.arange(s)
    if mode == "at":
        flat = torch.tensor([0, 3, 4, 5, 6, 11, 14, 17, 22, 23, 25, 12])  # one query at a padding position (12)
        row_of, at = flat // s, flat % s
        visible = (doc[row_of] == doc[row_of, at][:, None]) & (pos[None] <= at[:, None])
        layout = Layout.at_positions(doc, flat, extra)
    else:
        anchors = torch.tensor([[0, 3, 7, 11], [2, 8, 9, 11]])  # 0 and 9 start documents: nothing before them
        per = 3
        layout = Layout.before_positions(doc, anchors, per, extra)
        row_of = torch.arange(r).repeat_interleave(anchors.shape[1] * per)
        at = anchors.repeat_interleave(per, dim=1).flatten()
        visible = (doc[row_of] == doc[row_of, at][:, None]) & (pos[None] < at[:, None])
    n = row_of.numel()
    padding = doc[row_of, at] < 0
    if not extra:  # a query that sees nothing (a block at its document's start) has no softmax to compare
        padding |= ~visible.any(-1)
    q = torch.randn(n, heads, d, requires_grad=True)
    extra_k = torch.randn(n, kv_heads, extra, d, requires_grad=True) if extra else None
    extra_v = torch.randn(n, kv_heads, extra, d, requires_grad=True) if extra else None

    real = ~padding
    want = _oracle(q[real], row_of[real], keys, values, visible[real], None if extra_k is None else extra_k[real],
                   None if extra_v is None else extra_v[real], scale)
    scores = None
    if extra:
        scores = torch.einsum("nhd,nhed->nhe", q, extra_k.repeat_interleave(heads // kv_heads, dim=1)) * scale
    main, weights = ranged_attention(q, keys, values, layout, scale, scores)
    got = main if weights is None else main + torch.einsum("nhe,nhed->nhd", weights,
                                                           extra_v.repeat_interleave(heads // kv_heads, dim=1))
    assert bool((got[padding] == 0).all())  # padding, or nothing seen: zeros
    assert bool(padding.any()) == (mode == "at" or not extra)
    torch.testing.assert_close(got[real], want, rtol=1e-5, atol=1e-5)
    probe = torch.randn_like(want)
    grads = [t for t in (q, keys, values, extra_k, extra_v) if t is not None]
    g_got = torch.autograd.grad((got[real] * probe).sum(), grads)
    g_want = torch.autograd.grad((want * probe).sum(), grads)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_ranged_attention_in_bfloat16_keeps_the_extra_scores_precise():
    """In half precision a query's extra scores ride in two columns (high and low parts): scores of magnitude ~40, whose
    bf16 rounding alone moves a softmax weight by several percent, keep the weights as close to float32 as the plain
    bf16 attention keeps its own."""
    torch.manual_seed(1)
    doc = _rows()
    r, s = doc.shape
    heads, d, extra = 2, 16, 2
    scale = 1 / math.sqrt(d)
    keys, values = torch.randn(r, heads, s, d), torch.randn(r, heads, s, d)
    q = torch.randn(r * s, heads, d)
    extra_scores = 40 + torch.randn(r * s, heads, extra)  # float32, as TTTAttention and DFlash compute them
    layout = Layout.at_positions(doc, None, extra)
    ref_main, ref_w = ranged_attention(q, keys, values, layout, scale, extra_scores)
    bf = torch.bfloat16
    main, w = ranged_attention(q.to(bf), keys.to(bf), values.to(bf), layout, scale, extra_scores)
    assert (w.float() - ref_w).abs().max() < 1e-2
    assert (main.float() - ref_main).abs().max() < 2e-2
    rounded = extra_scores.to(bf).float()  # what one bf16 column would carry
    _, w_rounded = ranged_attention(q, keys, values, layout, scale, rounded)
    assert (w_rounded - ref_w).abs().max() > 2e-2  # the case the split is for


def test_a_layout_runs_only_up_to_its_last_query():
    """Documents without queries are left out, and a document's sequence ends at its last query's entry."""
    doc = _rows()
    layout = Layout.at_positions(doc, torch.tensor([1, 3]), extra=2)  # document 0 only, its positions 1 and 3
    assert [(b.docs, b.length) for b in layout.buckets] == [(1, 2 + 4)]
    assert int(layout.buckets[0].key_src.max()) == 3
    with pytest.raises(ValueError, match="given twice"):
        Layout.at_positions(doc, torch.tensor([3, 3]))


def test_layout_refuses_scores_that_do_not_fit():
    doc = _rows()
    layout = Layout.at_positions(doc, None, 2)
    q = torch.randn(doc.numel(), 2, 8)
    keys = torch.randn(2, 2, doc.shape[1], 8)
    with pytest.raises(ValueError, match="2 extra keys"):
        ranged_attention(q, keys, keys, layout, 0.3, None)


@pytest.mark.parametrize("extra", [0, 3])
def test_ranged_attention_runs_the_flash_kernel_not_the_math_one(extra):
    """No [L, L] scores are kept: SDPA takes its flash kernel (the math fallback materialises the scores; it is what
    SDPA picks when the value width differs from the query's, or a mask is given)."""
    from torch.profiler import ProfilerActivity, profile

    doc = _rows()
    r, s = doc.shape
    q = torch.randn(r * s, 4, 8, requires_grad=True)
    keys = torch.randn(r, 2, s, 8, requires_grad=True)
    layout = Layout.at_positions(doc, None, extra)
    scores = torch.randn(r * s, 4, extra, requires_grad=True) if extra else None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        main, weights = ranged_attention(q, keys, keys, layout, 0.35, scores)
        (main.sum() + (weights.sum() if extra else 0)).backward()
    names = {e.key for e in prof.key_averages()}
    assert any("flash_attention" in n for n in names), sorted(names)
    assert not any("attention_math" in n for n in names), sorted(names)
