"""Attention over the documents of packed rows with no [T, T] term: each query sees a prefix of its document's keys
plus a few keys of its own, computed by torch's SDPA with is_causal over one document at a time, with no mask tensor
(on CPU its flash kernel keeps memory linear in the tokens; on CUDA the flash or memory-efficient kernels do where
the dtype and head size allow them, bf16 / fp16 with padded head sizes up to 256 for flash).

    Layout.at_positions(document_ids, positions, extra)   queries at key positions: query at p sees the keys <= p of
                                                          its document (the TTT families' step 0 and later steps)
    Layout.before_positions(document_ids, anchors, per_anchor, extra)   per anchor a, `per_anchor` queries that see
                                                          the keys < a of a's document (DFlash's blocks)
    ranged_attention(q, keys, values, layout, scale, extra_scores)   -> (main, weights): the attention output over
                                                          the ranges, and the softmax weight of each query's own extra
                                                          keys (the caller adds weights @ its extra values)
    TTTAttention                                          the test-time-training unroll's cache and mask in one object
                                                          (EAGLE-3, EAGLE, P-EAGLE): transformers' Llama layers call
                                                          it through the attention implementation ATTN_IMPLEMENTATION

How a query's own keys join its range without a mask: every document's sequence starts with E "sink" entries, one per
extra key, visible to every query of the document under is_causal. A sink's key is a unit vector in a column of its
own, and each query carries, in that column, its own score for its extra key divided by the scale (two columns, a
high and a low part, in half precision): so the sink's score is exactly that query's score. A sink's value is a unit
vector in a value column of its own: the output there is the softmax weight of the extra key, normalised together with
the range's keys. Queries placed between keys ("before" layouts) sit in entries of their own whose key scores -1e4
for every real query (exp underflows to 0). A document's sequence ends at its last query (a step that runs few chains
attends over the keys before them only) and documents without queries are left out; documents are padded to a length
per bucket (powers of two), so padding costs at most 2x the tokens, and packed rows never attend across documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "hsx_ranged"
"""The name the draft layers' configs give their attention (drafters/llama_layers.with_ranged_attention): a
TTTAttention mask goes through ranged_attention, a tensor mask (decoding) through transformers' sdpa."""

_SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)
"""SDPA takes grouped kv heads (enable_gqa) from torch 2.5 (pyproject allows 2.4)."""

_INVISIBLE = -1.0e4
"""The score of a query-only entry's key for every real query: exp(-1e4 - max) is 0 in every float type."""


@dataclass
class _Bucket:
    """The documents padded to one length: entries g * length + e of the [G * length] sequence."""

    docs: int
    length: int
    key_src: torch.Tensor  # [K] flat key index (row * S + position) of each key entry
    key_dst: torch.Tensor  # [K] its entry
    query_src: torch.Tensor  # [M] index of each query (into the layout's queries)
    query_dst: torch.Tensor  # [M] its entry
    sink_dst: torch.Tensor  # [G * E] entry of each sink, document-major
    hidden_dst: torch.Tensor  # [I] entries holding a query only (their keys are invisible)


@dataclass
class Layout:
    """Where each query and key of a packed batch sits in its document's sequence (see the module docstring)."""

    extra: int
    """Extra keys of each query (its sinks)."""
    buckets: list[_Bucket]

    @classmethod
    def at_positions(cls, document_ids: torch.Tensor, positions: torch.Tensor | None = None, extra: int = 0
                     ) -> Layout:
        """Queries at key positions: query i at flat position positions[i] (row * S + p; None = every position)
        sees the keys <= p of its document and `extra` keys of its own. Padding (document id < 0) sees nothing."""
        r, s = document_ids.shape
        if positions is None:
            positions = torch.arange(r * s, device=document_ids.device)
        elif torch.unique(positions).numel() != positions.numel():
            raise ValueError("Layout.at_positions: a position is given twice; each query shares its position's entry, "
                             "so positions must be distinct")
        return cls._build(document_ids, positions, None, extra)

    @classmethod
    def before_positions(cls, document_ids: torch.Tensor, anchors: torch.Tensor, per_anchor: int, extra: int = 0
                         ) -> Layout:
        """anchors [R, n] row positions: queries (r, i, j), j < per_anchor (row-major [R * n * per_anchor]), see the
        keys < anchors[r, i] of its document and `extra` keys of their own."""
        r, s = document_ids.shape
        flat = (anchors + torch.arange(r, device=anchors.device)[:, None] * s).repeat_interleave(per_anchor, dim=1)
        return cls._build(document_ids, None, flat.flatten(), extra)

    @classmethod
    def _build(cls, document_ids: torch.Tensor, at: torch.Tensor | None, before: torch.Tensor | None, extra: int
               ) -> Layout:
        dev = document_ids.device
        r, s = document_ids.shape
        doc = document_ids.flatten()
        valid = doc >= 0
        starts = valid.clone()
        starts[1:] &= (doc[1:] != doc[:-1]) | (torch.arange(1, r * s, device=dev) % s == 0)
        doc_of = starts.long().cumsum(0) - 1  # [R*S] document index of each position (valid ones)
        n_docs = int(starts.sum())
        key_pos = valid.nonzero().squeeze(1)  # [K]
        key_doc = doc_of[key_pos]
        queries_src = at if at is not None else before
        q_idx = torch.arange(queries_src.numel(), device=dev)
        q_ok = valid[queries_src]
        q_pos, q_idx = queries_src[q_ok], q_idx[q_ok]
        q_doc = doc_of[q_pos]
        # the order of entries in each document: a query placed before key p comes before it (kind 0 < 1)
        if before is not None:
            pos = torch.cat([q_pos, key_pos])
            kind = torch.cat([torch.zeros_like(q_pos), torch.ones_like(key_pos)])
            owner = torch.cat([q_doc, key_doc])
        else:
            pos, kind, owner = key_pos, torch.ones_like(key_pos), key_doc
        order = torch.sort(owner * (2 * r * s + 2) + pos * 2 + kind, stable=True).indices
        sizes = torch.bincount(owner, minlength=n_docs)  # entries per document, sinks aside
        first = sizes.cumsum(0) - sizes
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=dev)
        entry = rank - first[owner] + extra  # [items] each item's entry in its document's sequence
        if before is not None:
            q_entry, k_entry = entry[:q_pos.numel()], entry[q_pos.numel():]
        else:
            k_entry = entry
            q_entry = k_entry[torch.searchsorted(key_pos, q_pos)]  # a query shares its key position's entry
        # a document's sequence ends at its last query's entry (no query sees past it); one without queries is dropped
        lengths = torch.zeros(n_docs, dtype=torch.long, device=dev).scatter_reduce(0, q_doc, q_entry + 1, "amax")
        # buckets: documents whose sequences round up to the same power of two, padded to their longest
        bucket_of = torch.ceil(torch.log2(lengths.clamp(min=1).double())).long()
        bucket_of[lengths == 0] = -1
        buckets = []
        for b in torch.unique(bucket_of[lengths > 0]).tolist():
            members = (bucket_of == b).nonzero().squeeze(1)  # [G] documents
            local = torch.full((n_docs,), -1, dtype=torch.long, device=dev)
            local[members] = torch.arange(members.numel(), device=dev)
            length = int(lengths[members].max())
            k_in = (local[key_doc] >= 0) & (k_entry < lengths[key_doc])
            q_in = local[q_doc] >= 0
            sink_dst = (local[members][:, None] * length + torch.arange(extra, device=dev)).flatten()
            hidden = (q_entry[q_in] + local[q_doc[q_in]] * length) if before is not None else \
                torch.zeros(0, dtype=torch.long, device=dev)
            buckets.append(_Bucket(
                docs=int(members.numel()), length=length, key_src=key_pos[k_in],
                key_dst=local[key_doc[k_in]] * length + k_entry[k_in], query_src=q_idx[q_in],
                query_dst=local[q_doc[q_in]] * length + q_entry[q_in], sink_dst=sink_dst,
                hidden_dst=torch.unique(hidden)))
        return cls(extra, buckets)


def ranged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: Layout, scale: float,
                     extra_scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [n, H, d] the layout's queries; keys [R, Hkv, S, d] / values [R, Hkv, S, dv] the rows' keys (H a multiple of
    Hkv); extra_scores [n, H, E] each query's scores for its own E extra keys (scaled, as softmax reads them; float32
    for half-precision queries, so they are as exact as the range's own scores), None when E = 0. Returns main
    [n, H, dv] (sum over the range's keys of softmax weight x value) and weights [n, H, E] (each extra key's softmax
    weight; None when E = 0): the attention output is main + weights @ extra values. Queries outside every document
    (padding) get zeros."""
    n, heads, d = q.shape
    r, kv_heads, s, _ = keys.shape
    dv = values.shape[-1]
    e = layout.extra
    if (extra_scores is None) != (e == 0) or (extra_scores is not None and extra_scores.shape[-1] != e):
        raise ValueError(f"the layout has {e} extra keys per query, the scores given "
                         f"{None if extra_scores is None else tuple(extra_scores.shape)}")
    split = q.dtype != torch.float32  # half precision: a score's high and low parts in two columns
    score_cols = e * (2 if split else 1)
    # one width for queries, keys and values: SDPA's flash kernels (CPU and CUDA) take equal head sizes only, and
    # fall back to the math kernel, which keeps the [L, L] scores, otherwise
    width = -(-max(d + score_cols + 1, dv + e) // 8) * 8
    width_v = width
    qx = [q]
    if e:
        x = extra_scores.float() / scale
        hi = x.to(q.dtype)
        qx.append(hi)
        if split:
            qx.append((x - hi.float()).to(q.dtype))
    qx.append(q.new_ones(n, heads, 1))
    qx = F.pad(torch.cat(qx, dim=-1), (0, width - d - score_cols - 1))  # [n, H, width]
    kf = F.pad(keys.transpose(1, 2).reshape(r * s, kv_heads, d), (0, width - d))
    vf = F.pad(values.transpose(1, 2).reshape(r * s, kv_heads, dv), (0, width_v - dv))
    out = q.new_zeros(n, heads, width_v)
    group = heads // kv_heads
    # grouped kv heads stay grouped where the flash kernel takes them (CPU; CUDA in half precision), else repeated
    gqa = group > 1 and _SDPA_GQA and (q.device.type == "cpu" or q.dtype in (torch.float16, torch.bfloat16))
    invisible = max(_INVISIBLE / scale, -torch.finfo(q.dtype).max / 2)
    for b in layout.buckets:
        size = b.docs * b.length
        k_const = q.new_zeros(size, 1, width)
        v_const = q.new_zeros(size, 1, width_v)
        if e:
            col = torch.arange(e, device=q.device).repeat(b.docs)
            k_const[b.sink_dst, 0, d + col] = 1.0
            if split:
                k_const[b.sink_dst, 0, d + e + col] = 1.0
            v_const[b.sink_dst, 0, dv + col] = 1.0
        k_const[b.hidden_dst, 0, d + score_cols] = invisible
        kb = q.new_zeros(size, kv_heads, width).index_put((b.key_dst,), kf[b.key_src]) + k_const
        vb = q.new_zeros(size, kv_heads, width_v).index_put((b.key_dst,), vf[b.key_src]) + v_const
        qb = q.new_zeros(size, heads, width).index_put((b.query_dst,), qx[b.query_src])
        if group > 1 and not gqa:
            kb, vb = kb.repeat_interleave(group, dim=1), vb.repeat_interleave(group, dim=1)
        qb, kb, vb = (x.view(b.docs, b.length, x.shape[1], -1).transpose(1, 2) for x in (qb, kb, vb))  # [G, h, L, w]
        ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale,
                                            **({"enable_gqa": True} if gqa else {}))
        ob = ob.transpose(1, 2).reshape(size, heads, width_v)
        out = out.index_put((b.query_src,), ob[b.query_dst])
    return out[..., :dv], (out[..., dv:dv + e] if e else None)


class TTTAttention:
    """The test-time-training unroll's attention, as the draft layers' cache and attention mask in one object.

    Step 0 runs every position of the packed rows ([R, S]) and stores its keys per layer: the causal keys. Step s >= 1
    runs the chains `begin(s, chains)` names (flat positions, nested: a chain run at s was run at 1..s-1; all when
    None) as rows [1, n]: each sees the step-0 keys <= its position in its document and its own keys of steps 1..s
    (the diagonal of EAGLE-3's mask, drafters/ttt.py), exactly as the dense mask did, with no [T, T] term."""

    def __init__(self, document_ids: torch.Tensor) -> None:
        self.document_ids = document_ids
        self.step = 0
        self.chains: torch.Tensor | None = None
        self._keys: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # layer -> per step (k, v) [n, Hkv, d]
        self._index: list[torch.Tensor] = []  # per step >= 1: [R*S] row of each chain in that step's keys, -1 none
        self._layout: Layout | None = None

    def begin(self, step: int, chains: torch.Tensor | None = None) -> None:
        """Start step `step` (0, 1, ... in order) over `chains` (flat positions; None: every position)."""
        r, s = self.document_ids.shape
        if step != len(self._index) or (step == 0 and chains is not None):
            raise ValueError("TTTAttention steps run 0, 1, ... in order, step 0 over every position")
        if step:
            chains = torch.arange(r * s, device=self.document_ids.device) if chains is None else chains
            index = torch.full((r * s,), -1, dtype=torch.long, device=chains.device)
            index[chains] = torch.arange(chains.numel(), device=chains.device)
            self._index.append(index)
        else:
            self._index.append(torch.zeros(0, dtype=torch.long))  # unused placeholder for step 0
        self.step, self.chains = step, chains
        self._layout = Layout.at_positions(self.document_ids, chains, extra=step)

    # the Cache interface transformers' attention calls: the step's own states pass through unchanged; what they
    # attend with is kept by attend(), from the keys and values the attention function gets (an MLA layer caches
    # latents, expanded only after the cache: keys are what reaches the attention function)
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return key_states, value_states

    def attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
               scale: float) -> torch.Tensor:
        """query [B, H, n, d], key / value [B, Hkv, n, d / dv] of the current step (kept for later steps) ->
        [B, n, H, dv] (what transformers' attention functions return)."""
        per_step = self._keys.setdefault(layer_idx, [])
        if len(per_step) != self.step:
            raise RuntimeError(f"layer {layer_idx} stored {len(per_step)} steps' keys at step {self.step}")
        per_step.append(tuple(x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1]) for x in (key, value)))
        r, s = self.document_ids.shape
        b, heads, n, d = query.shape
        q = query.transpose(1, 2).reshape(b * n, heads, d)
        per_step = self._keys[layer_idx]
        k0, v0 = per_step[0]
        keys = k0.view(r, s, *k0.shape[1:]).transpose(1, 2)
        values = v0.view(r, s, *v0.shape[1:]).transpose(1, 2)
        extra = []  # per step 1..s: this step's chains' own keys and values [n, Hkv, d]
        for j in range(1, self.step + 1):
            rows = self._index[j][self.chains]
            if bool((rows < 0).any()):
                raise ValueError(f"a chain run at step {self.step} was not run at step {j}: chains must be nested")
            kj, vj = per_step[j]
            extra.append((kj[rows], vj[rows]))
        kv_heads = k0.shape[1]
        grouped = q.view(b * n, kv_heads, heads // kv_heads, d)  # each kv head's group of query heads
        extra_scores = torch.stack([(grouped.float() * kj[:, :, None].float()).sum(-1).reshape(b * n, heads)
                                    for kj, _ in extra], dim=-1) * scale if extra else None  # [n, H, E] in float32
        main, weights = ranged_attention(q, keys, values, self._layout, scale, extra_scores)
        for j, (_, vj) in enumerate(extra):
            w = weights[..., j].view(b * n, kv_heads, heads // kv_heads, 1)
            main = main + (w * vj[:, :, None]).reshape(b * n, heads, -1)
        return main.view(b, n, heads, -1)


def _attention_function(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function interface: a TTTAttention mask -> ranged attention; else sdpa's."""
    if isinstance(attention_mask, TTTAttention):
        return attention_mask.attend(module, query, key, value, module.layer_idx, scaling), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  **kwargs)


def register() -> None:
    """Make ATTN_IMPLEMENTATION known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention_function)


register()
