"""P-EAGLE decoding in hsx's engine (speculative_config method "peagle", or "eagle3" with parallel_drafting on a
P-EAGLE checkpoint): per step ONE drafter forward over the newly verified entries and k-1 mask entries; the last
verified entry's output drafts token 1, mask entry d drafts token d+1."""

from __future__ import annotations

import torch

from drafters.eagle3_proposer import Eagle3Proposer
from drafters.peagle import PEagleDrafter
from extractor.proposers import Draft


class PEagleProposer(Eagle3Proposer):
    """speculative_config method "peagle" (or "eagle3" with parallel_drafting on a P-EAGLE checkpoint): k drafts
    from one drafter forward per step."""

    @classmethod
    def load(cls, model_dir: str, runner) -> PEagleDrafter:
        return PEagleDrafter.from_pretrained(model_dir, embed_tokens=runner.model.get_input_embeddings().weight)

    def __init__(self, model_dir: str, runner, num_speculative_tokens: int) -> None:
        super().__init__(model_dir, runner, num_speculative_tokens)
        depths = self.drafter.config.ttt_steps
        if num_speculative_tokens > depths:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} but the peagle drafter {model_dir} was "
                             f"trained for {depths} depths (drafts per step); lower num_speculative_tokens or train "
                             f"with --ttt-steps {num_speculative_tokens}")

    @torch.inference_mode()
    def propose(self, contexts, ks, params, generators):
        fed = list(self.fed)
        ids, hidden = self.verified_entries(contexts)
        images = [self.entry_images(b, fed[b] + 1, len(r)) for b, r in enumerate(ids)]  # before the mask entries
        positions = [self.entry_positions(b, fed[b], len(r)) for b, r in enumerate(ids)]
        rows = [b for b, k in enumerate(ks) if k > 0 and (ids[b] or self.last_output[b] is not None)]
        k_max = min(max((ks[b] for b in rows), default=1), self.k)
        masks = k_max - 1
        verified = [len(r) for r in ids]
        if masks and rows:  # k-1 mask entries after each drafting row's verified ones, in the same forward
            mask_state = self.drafter.mask_state()[None]  # [1, H]
            for b in rows:
                ids[b] = ids[b] + [self.drafter.mask_token_id] * masks
                pad = mask_state.expand(masks, -1)
                hidden[b] = pad if hidden[b] is None else torch.cat([hidden[b], pad])
        extra = [masks if b in rows else 0 for b in range(len(ids))]
        outs = self.feed_all(ids, hidden, keep=[1 + m for m in extra], images=images,
                             positions=positions)  # the last verified entry and the masks
        for b, n in enumerate(verified):
            if n:
                self.last_output[b] = outs[b][-1 - extra[b]]
                self.fed[b] += n
        drafts = [Draft([]) for _ in contexts]
        if not rows:
            return drafts
        for b in rows:
            self.drafted[b] = masks  # rolled back when the target answers
        # [B', k_max, H]: the last verified entry's output, then the mask entries' outputs
        h = torch.stack([torch.cat([self.last_output[b][None], outs[b][outs[b].shape[0] - masks:]]) if masks
                         else self.last_output[b][None] for b in rows])
        logits = self.drafter.logits(h).float()  # [B', k_max, D]
        picks = [self.pick(logits[:, j], [params[b] for b in rows], [generators[b] for b in rows])
                 for j in range(k_max)]
        for i, b in enumerate(rows):
            k = min(ks[b], k_max)
            tokens = [picks[j][i][0] for j in range(k)]
            probs = [picks[j][i][1] for j in range(k) if picks[j][i][1] is not None]
            drafts[b] = Draft(tokens, torch.stack(probs) if probs else None)
        return drafts
