"""DFlash decoding in hsx's engine (speculative_config method "dflash"): per step one forward over the block
[x_T, mask x (block_size-1)] at positions T..T+block_size-1 against the cached context keys of x_0..x_{T-1}; slot j
drafts x_{T+j}."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from drafters.base import runner_target
from drafters.dflash import DFlashDrafter
from extractor.proposers import Draft, Proposer
from extractor.sampling import sampling_probs


class DFlashProposer(Proposer):
    """speculative_config method "dflash": per step one forward over each row's block [x_T, mask...] against the
    cached context keys of x_0..x_{T-1} (every observed state, fused once: nothing is rolled back, the block's own
    keys are never kept)."""

    drafter_class = DFlashDrafter

    def __init__(self, model_dir: str, runner, num_speculative_tokens: int) -> None:
        # the runner's own embeddings and lm_head, shared: built in its dtype and on its device, nothing is copied
        drafter = self.drafter_class.from_pretrained(model_dir, target=runner_target(runner))
        kind = drafter.kind
        if drafter.target_hidden_size != runner.hidden_size or drafter.layer_config.vocab_size != runner.vocab_size:
            raise ValueError(f"the {kind} drafter {model_dir} was trained for a target of hidden size "
                             f"{drafter.target_hidden_size} and vocabulary {drafter.layer_config.vocab_size}, the "
                             f"target {runner.config.model} has {runner.hidden_size} and {runner.vocab_size}")
        bad = [i for i in drafter.aux_layer_ids if not 0 <= i <= runner.num_hidden_layers]
        if bad:
            raise ValueError(f"the {kind} drafter {model_dir} reads layers {list(drafter.aux_layer_ids)}, but the "
                             f"target has layer ids 0..{runner.num_hidden_layers} only")
        most = drafter.block_size - 1 + drafter.label_offset  # DSpark's slot 0 drafts too
        if not 1 <= num_speculative_tokens <= most:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} but the {kind} drafter {model_dir} has "
                             f"blocks of {drafter.block_size}: it drafts 1 to {most} tokens per step")
        self.device = torch.device(runner.device)
        self.drafter = drafter.to(self.device, runner.dtype).eval().requires_grad_(False)
        self.capture_layer_ids = tuple(drafter.aux_layer_ids)
        self.k = int(num_speculative_tokens)
        self.start([])

    def start(self, contexts) -> None:
        self._kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per row, per layer (k, v) [kvh, C, d]
        self._len: list[int] = []
        self.join(contexts)

    def join(self, contexts) -> None:
        self._kv += [[] for _ in contexts]
        self._len += [0] * len(contexts)

    def select(self, keep) -> None:
        self._kv = [self._kv[i] for i in keep]
        self._len = [self._len[i] for i in keep]

    @torch.inference_mode()
    def observe(self, states) -> None:
        if len(states) != len(self._len):
            raise RuntimeError(f"observe got states of {len(states)} rows, the batch has {len(self._len)}")
        d = self.drafter
        for b, s in enumerate(states):  # s [n, A, H]: the states of positions len..len+n-1
            n = int(s.shape[0])
            if not n:
                continue
            ctx = d.context(s.to(self.device))[None]  # [1, n, H]
            pos = torch.arange(self._len[b], self._len[b] + n, device=self.device)[None]
            new = [(k[0], v[0]) for k, v in d.context_kv(ctx, pos)]
            self._kv[b] = new if not self._kv[b] else [(torch.cat([k0, k1], 1), torch.cat([v0, v1], 1))
                                                       for (k0, v0), (k1, v1) in zip(self._kv[b], new)]
            self._len[b] += n

    @torch.inference_mode()
    def propose(self, contexts, ks, params, generators):
        if len(contexts) != len(self._len):
            raise RuntimeError(f"propose got {len(contexts)} rows, the proposer holds {len(self._len)}: the engine "
                               "must call start/join/select for every change of its rows")
        d = self.drafter
        rows = [b for b, k in enumerate(ks) if k > 0 and self._len[b] > 0]
        drafts = [Draft([]) for _ in contexts]
        if not rows:
            return drafts
        bs = d.block_size
        width = max(self._len[b] for b in rows)
        layers = len(d.layers)
        kv = []
        for li in range(layers):  # right-pad each row's context to `width`, masked
            ks_, vs_ = [], []
            for b in rows:
                k, v = self._kv[b][li]
                pad = width - k.shape[1]
                ks_.append(F.pad(k, (0, 0, 0, pad)))
                vs_.append(F.pad(v, (0, 0, 0, pad)))
            kv.append((torch.stack(ks_), torch.stack(vs_)))
        lengths = torch.tensor([self._len[b] for b in rows], device=self.device)
        tokens = torch.full((len(rows), bs), d.mask_token_id, dtype=torch.long, device=self.device)
        tokens[:, 0] = torch.tensor([contexts[b][-1] for b in rows], device=self.device)
        positions = lengths[:, None] + torch.arange(bs, device=self.device)  # x_T sits at position T = len
        mask = torch.ones((len(rows), bs, width + bs), dtype=torch.bool, device=self.device)
        mask[:, :, :width] = torch.arange(width, device=self.device)[None, None] < lengths[:, None, None]
        out = d.blocks(tokens, positions, kv, mask[:, None])  # [B', bs, H]
        k_max = min(max(ks[b] for b in rows), self.k)
        return self.draw(out, rows, contexts, ks, k_max, params, generators, drafts)

    def draw(self, out, rows, contexts, ks, k_max, params, generators, drafts):
        """Drafts from the block's outputs out [B', bs, H] (rows' order): slot j >= 1 drafts x_{T+j}."""
        d = self.drafter
        logits = d.logits(out[:, 1:1 + k_max]).float()  # [B', k_max, V]
        for i, b in enumerate(rows):
            k = min(ks[b], k_max)
            if params[b].greedy:
                drafts[b] = Draft(logits[i, :k].argmax(-1).tolist())
                continue
            probs = torch.stack([sampling_probs(logits[i, j], params[b]) for j in range(k)])
            toks = [int(torch.multinomial(probs[j], 1, generator=generators[b])) for j in range(k)]
            drafts[b] = Draft(toks, probs)
        return drafts
