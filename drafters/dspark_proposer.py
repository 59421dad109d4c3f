"""DSpark decoding in hsx's engine (speculative_config method "dspark"): DFlash's block forward (drafters/
dflash_proposer.py), every slot drafting, then the Markov correction slot by slot — each draft conditions the next —
and, with the checkpoint's confidence_threshold > 0, the block cut before the first slot whose confidence is below it.
"""

from __future__ import annotations

import torch

from drafters.dflash_proposer import DFlashProposer
from drafters.dspark import DSparkDrafter
from extractor.proposers import Draft
from extractor.sampling import sampling_probs


class DSparkProposer(DFlashProposer):
    """speculative_config method "dspark": per step one forward over each row's block [x_T, mask...] against the
    cached context keys of x_0..x_{T-1}; slot k drafts x_{T+k+1} from base_k + W2 W1[the token before it]."""

    drafter_class = DSparkDrafter

    def draw(self, out, rows, contexts, ks, k_max, params, generators, drafts):
        d = self.drafter
        h = d.norm(out[:, :k_max])  # [B', k, H] slot k drafts x_{T+k+1}
        base = (h @ d.target_lm_head.to(h.dtype).T).float()  # [B', k, V]
        prev = torch.tensor([contexts[b][-1] for b in rows], device=self.device)  # slot 0's: the anchor x_T
        threshold = d.config.confidence_threshold
        tokens = [[] for _ in rows]
        probs = [[] for _ in rows]
        live = [True] * len(rows)
        state = None
        for k in range(k_max):
            logits = base[:, k]
            if d.markov_head is not None:
                x, state = d.markov_head.step_inputs(d.markov_head.embed(prev).to(h.dtype), h[:, k], state)
                logits = logits + d.markov_head.markov_w2(x).float()
            conf = d.confidence(h[:, k], prev) if threshold > 0 else None
            picked = []
            for i, b in enumerate(rows):
                if not live[i] or k >= min(ks[b], k_max) or (conf is not None and
                                                             float(torch.sigmoid(conf[i])) < threshold):
                    live[i] = False
                    picked.append(0)
                    continue
                if params[b].greedy:
                    picked.append(int(logits[i].argmax()))
                else:
                    q = sampling_probs(logits[i], params[b])
                    picked.append(int(torch.multinomial(q, 1, generator=generators[b])))
                    probs[i].append(q)
                tokens[i].append(picked[-1])
            prev = torch.tensor(picked, device=self.device)
        for i, b in enumerate(rows):
            drafts[b] = Draft(tokens[i], torch.stack(probs[i]) if probs[i] else None)
        return drafts
