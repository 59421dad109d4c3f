"""EAGLE-3 decoding in hsx's engine (speculative_config method "eagle3"): drafting with a trained head
(drafters/eagle3.py); the loop EAGLE's and P-EAGLE's proposers build on (drafters/eagle_proposer.py,
drafters/peagle_proposer.py).

    _RowCache         the drafter's own KV cache over a batch of rows, rolled back per row on rejection
    Eagle3Proposer    the extractor.proposers.Proposer of method "eagle3": fuses the target's aux-layer states of
                      the verified tokens (captured by the engine), drafts k tokens per row in the draft vocabulary
                      and maps them to the target's ids
        load(model_dir, runner)           the head (a subclass loads its own family's)
        verified_entries(contexts)        a proposal's start: rolled back, then each row's entries not fed yet
        feed_all(ids, hidden, keep)       those entries through the head, within the token budget
        pick(logits, params, generators)  one target token per row (greedy or drawn)
        fed / last_output / drafted       per row: entries in the cache, its last output, draft entries to roll back
"""

from __future__ import annotations

import logging

import torch

from drafters.eagle3 import Eagle3Drafter
from drafters.images import override_embeddings
from extractor.batch_state import BatchState
from extractor.proposers import Draft, Proposer
from extractor.sampling import sampling_probs

logger = logging.getLogger(__name__)


class _RowCache:
    """The drafter's KV cache for a batch of rows (extractor.batch_state.BatchState: cache + per-row column mask and next
    position). Column p of a row holds its entry at position p; rolled-back entries stay as masked holes."""

    def __init__(self, device: torch.device) -> None:
        from transformers import DynamicCache

        self.device = device
        self.state = BatchState(DynamicCache(), torch.zeros((0, 0), dtype=torch.long, device=device),
                                torch.zeros(0, dtype=torch.long, device=device))

    @property
    def rows(self) -> int:
        return self.state.batch_size

    def add_rows(self, n: int) -> None:
        """n empty rows after the current ones (their columns all masked)."""
        st = self.state
        for layer in getattr(st.cache, "layers", []):
            if getattr(layer, "is_initialized", False) and layer.keys.dim() == 4:
                k, v = layer.keys, layer.values
                layer.keys = torch.cat([k, k.new_zeros((n, *k.shape[1:]))])
                layer.values = torch.cat([v, v.new_zeros((n, *v.shape[1:]))])
        st.attention_mask = torch.cat([st.attention_mask, st.attention_mask.new_zeros((n, st.width))])
        st.next_position = torch.cat([st.next_position, st.next_position.new_zeros(n)])

    def feed(self, drafter: Eagle3Drafter, ids: list[list[int]], hidden: list[torch.Tensor | None],
             images: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
             positions: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """Append row b's entries (token ids[b][i] with state hidden[b][i] [H]; hidden[b] [n_b, H], n_b may be 0)
        right-aligned in W = max n_b new columns; return the pre-norm outputs [B, W, H] (row b's in its last n_b
        columns). images[b] (mask [m], embeddings [m, H], m <= n_b): row b's first m entries' token embeddings
        replaced where the mask says (an image prompt's merged embeddings, drafters.images). positions[b] ([m],
        m <= n_b, an image prompt's row): its first m entries' positions as the target had them (M-RoPE's time
        stream), the rest continuing by one; the row's next position is after its last."""
        st = self.state
        b_rows, width = len(ids), max(1, max(len(r) for r in ids))
        given = next(x for x in hidden if x is not None)  # at least one row has entries
        h, dtype = given.shape[-1], given.dtype
        tok = torch.zeros((b_rows, width), dtype=torch.long)
        new_mask = torch.zeros((b_rows, width), dtype=torch.long)
        offsets = torch.zeros((b_rows, width), dtype=torch.long)
        x = torch.zeros((b_rows, width, h), dtype=dtype, device=self.device)
        for b, r in enumerate(ids):
            n = len(r)
            if n:
                tok[b, width - n:] = torch.tensor(r, dtype=torch.long)
                new_mask[b, width - n:] = 1
                offsets[b, width - n:] = torch.arange(n)
                x[b, width - n:] = hidden[b].to(self.device, dtype)
        new_mask, offsets = new_mask.to(self.device), offsets.to(self.device)
        st.attention_mask = torch.cat([st.attention_mask, new_mask], dim=1)
        given = positions
        positions = (st.next_position[:, None] + offsets) * new_mask  # [B, W]
        for b, own in enumerate(given or []):
            n = len(ids[b])
            if own is None or not n or not len(own):
                continue
            m = min(len(own), n)  # entries past the given ones (P-EAGLE's masks) continue by one
            row = torch.cat([own[:m].to(torch.long), int(own[m - 1]) + 1 + torch.arange(n - m)])
            positions[b, width - n:] = row.to(self.device)
            st.next_position[b] = int(row[-1]) + 1 - n  # + n below: after the last
        total = st.width
        cols = torch.arange(total, device=self.device)
        q_cols = cols[total - width:]  # the new columns' indices
        causal = cols[None, :] <= q_cols[:, None]  # [W, total]
        mask = st.attention_mask.bool()[:, None, :] & causal[None]  # [B, W, total]
        mask |= (cols[None, :] == q_cols[:, None])[None]  # every query sees itself (no empty rows in holes)
        override = None
        if images is not None and any(i is not None for i in images):
            image_mask = torch.zeros((b_rows, width), dtype=torch.bool, device=self.device)
            image_values = torch.zeros((b_rows, width, h), dtype=dtype, device=self.device)
            for b, (r, given_images) in enumerate(zip(ids, images)):
                if given_images is not None:
                    m, v = given_images
                    cols0 = width - len(r)
                    image_mask[b, cols0:cols0 + m.shape[0]] = m.to(self.device)
                    image_values[b, cols0:cols0 + m.shape[0]] = v.to(self.device, dtype)
            override = (image_mask, image_values)
        with override_embeddings(getattr(drafter, "embed_tokens", None), *(override or (None, None))):
            out = drafter.decode(tok.to(self.device), x, positions, mask[:, None], st.cache)  # [B, W, H]
        st.next_position = st.next_position + new_mask.sum(-1)
        return out


class Eagle3Proposer(Proposer):
    """speculative_config method "eagle3": a trained EAGLE-3 head drafts k tokens from the target's aux states.

    Its cache holds, per row, entry p = (fc(aux states of x_p), embed x_{p+1}) for every verified p the engine has
    observed (contexts[b][:-1]). propose() feeds the entries not fed yet (always from the target's states), whose
    last output gives draft 1 (the token after contexts[b][-1]); drafts 2..k feed the head its own output and its
    previous draft at the next positions. Those k-1 draft entries are rolled back when the target answers
    (accepted): accepted positions come back through observe() with the target's states and are fed next time.
    Greedy rows take the argmax, sampled rows draw from the request's sampling distribution over the draft
    vocabulary (mapped to target ids with d2t) and return those probabilities."""

    @classmethod
    def load(cls, model_dir: str, runner) -> Eagle3Drafter:
        return Eagle3Drafter.from_pretrained(model_dir, embed_tokens=runner.model.get_input_embeddings().weight)

    def __init__(self, model_dir: str, runner, num_speculative_tokens: int) -> None:
        drafter = self.load(model_dir, runner)
        if drafter.target_hidden_size != runner.hidden_size or drafter.layer_config.vocab_size != runner.vocab_size:
            raise ValueError(f"the {drafter.kind} drafter {model_dir} was trained for a target of hidden size "
                             f"{drafter.target_hidden_size} and vocabulary {drafter.layer_config.vocab_size}, the "
                             f"target {runner.config.model} has {runner.hidden_size} and {runner.vocab_size}: train "
                             "one on a run of this target")
        bad = [i for i in drafter.aux_layer_ids if not 0 <= i <= runner.num_hidden_layers]
        if bad:
            raise ValueError(f"the {drafter.kind} drafter {model_dir} reads layers {list(drafter.aux_layer_ids)}, but the "
                             f"target has layer ids 0..{runner.num_hidden_layers} only")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.device = torch.device(runner.device)
        self.drafter = drafter.to(self.device, runner.dtype).eval().requires_grad_(False)
        self.state_dtype = runner.dtype  # of the states fed to the head
        self.capture_layer_ids = tuple(drafter.aux_layer_ids)
        self.k = int(num_speculative_tokens)
        self._draft_ids = self.drafter.draft_ids  # [D] target ids
        self._vocab = int(runner.vocab_size)
        self.budget = int(runner.config.max_num_batched_tokens)  # entries per forward over the prompt, as the target
        self.start([])

    # -- the batch's rows --------------------------------------------------------------------------------------
    def start(self, contexts) -> None:
        self._cache = _RowCache(self.device)
        self._images: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # per row: image positions, embeddings
        self._times: list[torch.Tensor | None] = []  # per row: an image prompt's positions (M-RoPE time stream)
        self._states: list[list[torch.Tensor]] = []  # observed, not yet fed: [n, A, H] chunks per row
        self._seen: list[int] = []  # states observed per row (= entries possible)
        self.fed: list[int] = []  # entries in the cache per row (positions 0..fed-1)
        self.last_output: list[torch.Tensor | None] = []  # [H] output of the row's last fed entry
        self.drafted: list[int] = []  # draft entries of the last propose per row (rolled back by accepted)
        self.join(contexts)

    def join(self, contexts) -> None:
        n = len(contexts)
        self._cache.add_rows(n)
        self._images += [None] * n
        self._times += [None] * n
        self._states += [[] for _ in range(n)]
        self._seen += [0] * n
        self.fed += [0] * n
        self.last_output += [None] * n
        self.drafted += [0] * n

    def can_join(self) -> bool:
        return True

    def media(self, rows) -> None:
        """The image prompts of the rows start/join just added: at their image tokens the head reads the target's
        merged input embeddings (the vision tower's output), as vLLM's EAGLE proposer feeds it."""
        first = len(self._images) - len(rows)
        for i, m in enumerate(rows):
            if m is not None and m.image_features.shape[0]:
                at = torch.nonzero(m.mm_token_type_ids).flatten()  # [N] prompt positions of the image tokens
                self._images[first + i] = (at, m.image_features)
                self._times[first + i] = m.positions[0]  # vLLM gives a drafter the target's time stream
        if getattr(self.drafter, "embed_tokens", None) is None and not getattr(self, "_warned_media", False):
            self._warned_media = True  # a head that embeds through something else: the placeholder's, said once
            logger.warning("%s drafts after image tokens from their placeholder's embedding (vLLM feeds EAGLE "
                           "drafters the vision embeddings there)", type(self).__name__)

    def entry_positions(self, b: int, first: int, n: int) -> torch.Tensor | None:
        """Row b's entries first..first+n-1 (entry p holds x_p's state): their positions as the target had them
        (an image prompt's M-RoPE time stream, continuing by one after the prompt), or None (0..: counted)."""
        times = self._times[b]
        if times is None or n <= 0:
            return None
        p = torch.arange(first, first + n)
        last = len(times) - 1
        return torch.where(p <= last, times[p.clamp(max=last)], times[last] + p - last)

    def entry_images(self, b: int, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Row b's entries for context positions first..first+n-1 (their token x_p): (mask [n], embeddings [n, H])
        at its image tokens, or None."""
        if self._images[b] is None or n <= 0:
            return None
        at, features = self._images[b]
        sel = (at >= first) & (at < first + n)
        if not bool(sel.any()):
            return None
        mask = torch.zeros(n, dtype=torch.bool)
        values = features.new_zeros((n, features.shape[1]))
        mask[at[sel] - first] = True
        values[at[sel] - first] = features[sel]
        return mask, values

    def observe(self, states) -> None:
        if len(states) != len(self._seen):
            raise RuntimeError(f"observe got states of {len(states)} rows, the batch has {len(self._seen)}")
        for b, s in enumerate(states):  # s: [n_b, A, H]
            if s.shape[0]:
                self._states[b].append(s)
                self._seen[b] += int(s.shape[0])

    def accepted(self, num_accepted) -> None:
        self._rollback()

    def select(self, keep) -> None:
        keep = list(keep)
        self._rollback()
        self._cache.state.select(keep)
        for name in ("_states", "_seen", "fed", "last_output", "drafted", "_images", "_times"):
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in keep])

    def _rollback(self) -> None:
        for b, n in enumerate(self.drafted):
            self._cache.state.rollback(b, n)
        self.drafted = [0] * len(self.drafted)
        self._cache.state.maybe_compact()

    def verified_entries(self, contexts) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """A proposal's start: the last draft's entries rolled back, then per row the verified entries not fed yet:
        (x_{p+1}, the fused target states of x_p) for p in fed..seen-1, as (token ids, [n, H])."""
        if len(contexts) != len(self._seen):
            raise RuntimeError(f"propose got {len(contexts)} rows, the proposer holds {len(self._seen)}: the engine "
                               "must call start/join/select for every change of its rows")
        self._rollback()
        drafter = self.drafter
        ids, hidden = [], []
        for b, ctx in enumerate(contexts):
            if self._states[b]:
                aux = torch.cat(self._states[b])  # [n, A, H]
                self._states[b] = []
                start = self.fed[b]
                ids.append([int(t) for t in ctx[start + 1:start + 1 + aux.shape[0]]])
                hidden.append(drafter.fuse(aux.to(self.device, self.state_dtype)))  # [n, H]
                if len(ids[-1]) != aux.shape[0]:
                    raise RuntimeError(f"row {b}: {self._seen[b]} states observed for a context of {len(ctx)} "
                                       "tokens; the engine must observe exactly contexts[b][:-1]")
            else:
                ids.append([])
                hidden.append(None)
        return ids, hidden

    def feed_all(self, ids: list[list[int]], hidden: list[torch.Tensor | None], keep: list[int] | None = None,
                 images: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
                 positions: list[torch.Tensor | None] | None = None) -> list[torch.Tensor | None]:
        """Feed every row's entries (the rows share max_num_batched_tokens per forward: a joining prompt over it
        goes in chunks); per row the outputs [n, H] of its last keep[b] entries (default 1), in order (None for a
        row with none). Only those are kept: a long prompt's other outputs are dropped chunk by chunk. images[b]:
        entry_images of row b's entries (from the first), or None; positions[b]: entry_positions of them, or None."""
        step = max(1, self.budget // max(1, sum(1 for r in ids if r)))
        keep = keep or [1] * len(ids)
        images = images or [None] * len(ids)
        positions = positions or [None] * len(ids)
        outs: list[torch.Tensor | None] = [None] * len(ids)
        for c0 in range(0, max(map(len, ids), default=0), step):
            piece = [r[c0:c0 + step] for r in ids]
            chunk_images = [None if im is None or im[0].shape[0] <= c0 else (im[0][c0:c0 + step], im[1][c0:c0 + step])
                            for im in images]
            chunk_positions = [None if p is None or p.shape[0] <= c0 else p[c0:c0 + step] for p in positions]
            out = self._cache.feed(self.drafter, piece,
                                   [x[c0:c0 + step] if r else None for x, r in zip(hidden, piece)],
                                   chunk_images, chunk_positions)  # [B, W, H]
            for b, r in enumerate(piece):
                if r:
                    new = out[b, out.shape[1] - len(r):]
                    tail = new if outs[b] is None else torch.cat([outs[b], new])
                    outs[b] = tail[-keep[b]:].clone()
        return outs

    # -- drafting ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, contexts, ks, params, generators):
        fed = list(self.fed)  # entry p holds x_p's state and feeds x_{p+1}
        ids, hidden = self.verified_entries(contexts)
        outs = self.feed_all(ids, hidden, images=[self.entry_images(b, fed[b] + 1, len(r)) for b, r in enumerate(ids)],
                             positions=[self.entry_positions(b, fed[b], len(r)) for b, r in enumerate(ids)])
        for b, r in enumerate(ids):
            if r:
                self.last_output[b] = outs[b][-1]
                self.fed[b] += len(r)
        drafter = self.drafter
        rows = [b for b, k in enumerate(ks) if k > 0 and self.last_output[b] is not None]
        drafts = [Draft([]) for _ in contexts]
        if not rows:
            return drafts
        k_max = min(max(ks[b] for b in rows), self.k)
        # 2. k_max drafts: the head's own output and previous draft at the next positions
        h = self.draft_state(torch.stack([self.last_output[b] for b in rows]), 0)  # [B', H]
        tokens: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        for j in range(k_max):
            logits = self.draft_logits(h, j).float()  # [B', D]
            picks = self.pick(logits, [params[b] for b in rows], [generators[b] for b in rows])
            for i, (tok, q) in enumerate(picks):
                tokens[i].append(tok)
                if q is not None:
                    probs[i].append(q)
            if j == k_max - 1:
                break
            step_ids = [[] for _ in contexts]
            step_hidden: list[torch.Tensor | None] = [None] * len(contexts)
            for i, b in enumerate(rows):
                step_ids[b] = [tokens[i][-1]]
                step_hidden[b] = h[i][None]
            out = self._cache.feed(drafter, step_ids, step_hidden)  # [B, 1, H]
            for b in rows:
                self.drafted[b] += 1
            h = self.draft_state(out[rows, -1], j + 1)
        for i, b in enumerate(rows):
            k = min(ks[b], k_max)
            drafts[b] = Draft(tokens[i][:k], torch.stack(probs[i][:k]) if probs[i] else None)
        return drafts

    def draft_state(self, out: torch.Tensor, step: int) -> torch.Tensor:
        """The state draft `step` (0-based) reads, from the head's outputs for the rows (MTP: one layer's of several)."""
        return out

    def draft_logits(self, h: torch.Tensor, step: int) -> torch.Tensor:
        """[B', D] the logits of draft `step` over its state h [B', H]."""
        return self.drafter.logits(h)

    def pick(self, logits: torch.Tensor, params, generators) -> list[tuple[int, torch.Tensor | None]]:
        """One target token per row of logits [B, D]: argmax for greedy rows, a draw from the request's sampling
        distribution over the draft vocabulary otherwise (probabilities [V] over the target's ids)."""
        greedy = self._draft_ids[logits.argmax(-1)].tolist()
        out = []
        for b, (p, gen) in enumerate(zip(params, generators)):
            if p.greedy:
                out.append((greedy[b], None))
                continue
            full = logits.new_full((self._vocab,), float("-inf"))
            full[self._draft_ids] = logits[b]
            q = sampling_probs(full, p)  # [V]
            out.append((int(torch.multinomial(q, 1, generator=gen)), q))
        return out
