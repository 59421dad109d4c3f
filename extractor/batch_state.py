"""A batch in the engine: its key/value cache and each row's columns, as prefill, decode, speculation and continuous
batching change them.

    Captured                                     one forward's captured rows: states [B, S, L, H] and the top-k
                                                 target's [B, S, K] tensors (Captured.row(b, lo, hi) for one row)
    BatchState.rollback(row, n)                  forget a row's last n tokens (rejected drafts)
    BatchState.merge(other) / compact()          continuous batching: add rows; squeeze masked columns out
    can_rearrange(cache)                         whether merge / compact may move a cache's columns
    forward_rows(model, state, rows, ...)        a forward of several new tokens per row on a batch's cache

Rows of one batch may advance by different numbers of tokens (speculative decoding accepts a different number of
drafts per row): `extend` left-pads each row's new tokens to the widest with masked holes, and `rollback` masks a
row's rejected positions out of its attention mask. No later token attends to those columns; positions come from
each row's own count, so holes never shift them. `compact` squeezes the holes out (each row's kept columns moved to
the right edge, in order; keys carry their rotary encoding, so moving them changes nothing), which the engine does
when they waste much of the cache.

Continuous batching: `merge` appends the rows of another BatchState (a newly prefilled group) to a running one, the
narrower side left-padded with masked columns. Both need plain per-layer key/value caches (transformers'
`DynamicLayer`); `can_rearrange(cache)` says whether a cache is one (sliding-window and other layouts are not: the
engine then runs such batches to the end before admitting more).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Captured:
    """What one forward captured for the connector: the stored layers' states and the extra per-token tensors the
    files carry (a top-k target's ids and log-probabilities), all [B, S, ...] on one device."""

    states: torch.Tensor  # [B, S, L, H]
    extra: dict[str, torch.Tensor]  # name -> [B, S, K]
    packed: bool = False
    """One packed row ([1, S, ...]) holding every prompt of the batch end to end (extractor.packing)."""

    def row(self, b: int, lo: int, hi: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Row b's columns [lo, hi): (states [hi - lo, L, H], {name: [hi - lo, ...]}); packed: columns of the one
        row."""
        r = 0 if self.packed else b
        return self.states[r, lo:hi], {name: t[r, lo:hi] for name, t in self.extra.items()}

    def take_rows(self, keep: list[int]) -> Captured:
        """Rows `keep` only, copied into tensors of their own (the batch's tensors can then go)."""
        assert not self.packed, "a packed row has no rows to take (internal error)"
        if len(keep) == self.states.shape[0]:
            return self
        idx = torch.tensor(keep, dtype=torch.long, device=self.states.device)
        return Captured(self.states.index_select(0, idx), {n: t.index_select(0, idx) for n, t in self.extra.items()})


@dataclass
class BatchState:
    """What decoding carries between steps for the rows still active."""

    cache: object
    attention_mask: torch.Tensor  # [B, S_so_far] on device
    next_position: torch.Tensor  # [B] on device

    def select(self, keep: list[int]) -> None:
        """Drop finished rows (keep = indices of rows that continue)."""
        idx = torch.tensor(keep, device=self.attention_mask.device)
        for layer in self.cache.layers:
            if hasattr(layer, "batch_select_indices"):
                layer.batch_select_indices(idx)
            else:  # linear-attention states ([B, ...] tensors): transformers has no row selection for them
                layer.reorder_cache(idx)
        self.attention_mask = self.attention_mask[idx]
        self.next_position = self.next_position[idx]

    @property
    def width(self) -> int:
        return int(self.attention_mask.shape[1])

    @torch.inference_mode()
    def merge(self, other: BatchState) -> None:
        """Append `other`'s rows after this state's rows (both must satisfy can_rearrange)."""
        width = max(self.width, other.width)
        mine, theirs = _cache_layers(self.cache), _cache_layers(other.cache)
        if mine is None or theirs is None or len(mine) != len(theirs):
            raise ValueError("these caches cannot be merged (not plain key/value caches of the same model)")
        for a, b in zip(mine, theirs):
            ref = a if _has_kv(a) else b if _has_kv(b) else None
            if ref is None:
                continue
            parts_k, parts_v = [], []
            for layer, rows in ((a, self.batch_size), (b, other.batch_size)):
                if _has_kv(layer):
                    k, v = layer.keys, layer.values
                else:  # a state that has seen no tokens yet: [rows, heads, 0, dim]
                    k = ref.keys.new_zeros((rows, ref.keys.shape[1], 0, ref.keys.shape[3]))
                    v = ref.values.new_zeros((rows, ref.values.shape[1], 0, ref.values.shape[3]))
                parts_k.append(_left_pad(k, width - k.shape[2]))
                parts_v.append(_left_pad(v, width - v.shape[2]))
            keys, values = torch.cat(parts_k), torch.cat(parts_v)
            if not a.is_initialized:
                a.lazy_initialization(keys, values)
            a.keys, a.values = keys, values
        pad = width - self.width, width - other.width
        self.attention_mask = torch.cat([_left_pad(self.attention_mask, pad[0], dim=1),
                                         _left_pad(other.attention_mask, pad[1], dim=1)])
        self.next_position = torch.cat([self.next_position, other.next_position])

    @property
    def batch_size(self) -> int:
        return int(self.attention_mask.shape[0])

    def waste(self) -> float:
        """Share of the cache's columns that no row attends to any more (holes and padding)."""
        if self.width == 0:
            return 0.0
        kept = int(self.attention_mask.sum(-1).max())
        return 1.0 - kept / self.width

    @torch.inference_mode()
    def compact(self) -> None:
        """Drop the columns no row attends to: each row's kept columns move, in order, to the right edge of a cache
        as wide as the row with the most (requires can_rearrange)."""
        layers = _cache_layers(self.cache)
        if layers is None:
            raise ValueError("this cache cannot be compacted (not a plain key/value cache)")
        mask = self.attention_mask.bool()
        counts = mask.sum(-1)  # [B]
        width = int(counts.max()) if counts.numel() else 0
        # source column of each target column: row b's kept columns, in order, in its last counts[b] slots
        order = torch.argsort(mask.to(torch.int8), dim=1, stable=True)[:, -width:] if width else \
            torch.zeros((mask.shape[0], 0), dtype=torch.long, device=mask.device)  # [B, width]
        new_mask = torch.arange(width, device=mask.device)[None, :] >= (width - counts)[:, None]  # [B, width]
        for layer in layers:
            if not _has_kv(layer):
                continue
            idx = order[:, None, :, None]
            layer.keys = layer.keys.gather(2, idx.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
            layer.values = layer.values.gather(2, idx.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
        self.attention_mask = new_mask.to(self.attention_mask.dtype)

    def maybe_compact(self, threshold: float = 0.5, min_width: int = 64) -> bool:
        """compact() when more than `threshold` of at least `min_width` columns are waste; True if it did."""
        if self.width >= min_width and self.waste() > threshold and can_rearrange(self.cache):
            self.compact()
            return True
        return False

    @torch.inference_mode()
    def rollback(self, row: int, n: int) -> None:
        """Forget row `row`'s last `n` tokens: they stay in the cache, masked, and its next position moves back."""
        if n <= 0:
            return
        real = self.attention_mask[row].nonzero().flatten()  # columns holding row's tokens, in order
        assert n <= real.numel(), (n, real.numel())
        self.attention_mask[row, real[-n:]] = 0
        self.next_position[row] -= n


def _cache_layers(cache) -> list | None:
    """The cache's per-layer key/value holders when every one is a plain DynamicLayer (full attention), else None."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if layers is None or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    return list(layers)


def can_rearrange(cache) -> bool:
    """Whether BatchState.merge / compact can rearrange this cache's rows and columns."""
    return _cache_layers(cache) is not None


def _has_kv(layer) -> bool:
    return bool(layer.is_initialized) and layer.keys.dim() == 4


def _left_pad(x: torch.Tensor, n: int, dim: int = 2) -> torch.Tensor:
    """x with n zero columns prepended along `dim`."""
    if n <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def forward_rows(model, state: BatchState, rows: list[list[int]], pad_id: int, cache_kw: str,
                 last: int | None = None) -> torch.Tensor:
    """Feed each row of `state` its new tokens `rows[b]`; return logits [B, W, V] where W is the longest row and row
    b's tokens sit in its last len(rows[b]) columns (holes before them are masked; a row may get none, in a chunk of
    a longer row's prefill). `last`: logits of the last `last` columns only ([B, last, V]) where the model supports
    `logits_to_keep`."""
    device = state.attention_mask.device
    width = max(len(r) for r in rows)
    assert width >= 1
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    new_mask = torch.zeros((len(rows), width), dtype=torch.long)
    offsets = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r):] = torch.tensor(r, dtype=torch.long)
        new_mask[b, width - len(r):] = 1
        offsets[b, width - len(r):] = torch.arange(len(r))
    new_mask, offsets = new_mask.to(device), offsets.to(device)
    state.attention_mask = torch.cat([state.attention_mask, new_mask], dim=1)
    positions = (state.next_position[:, None] + offsets) * new_mask  # holes: position 0, masked anyway
    inputs = {"input_ids": ids.to(device), "attention_mask": state.attention_mask, "position_ids": positions,
              "use_cache": True, cache_kw: state.cache}
    if last is not None and "logits_to_keep" in inspect.signature(model.forward).parameters:
        inputs["logits_to_keep"] = last
    logits = model(**inputs).logits  # [B, W, V] or [B, last, V]
    if last is not None:
        logits = logits[:, -last:]
    state.next_position = state.next_position + new_mask.sum(-1)
    return logits
