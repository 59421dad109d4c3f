"""What the drafter families' tests share: packed batches of a run, a few training steps, and the end-to-end check every family passes —
a head trained by `hsx train-drafter` on the target's own greedy continuations, decoded by hsx's engine two rows at
a time (the third joining), equal to transformers generate token for token, its drafts accepted."""

from __future__ import annotations

import os
import sys

import torch

PROMPTS = ("the quick model reads a batch", "one two three four five", "a small dog jumps over the river")


def packed_batch(ds, indices, max_tokens: int = 128):
    """A DrafterBatch of `ds` items `indices`, packed into rows of max_tokens (training.PackCollator)."""
    from drafters.base import DrafterBatch
    from training import PackCollator

    return DrafterBatch.from_packed(PackCollator(max_tokens)([ds[i] for i in indices]), ds.run_info.layer_ids)


def family_setup(oracle_run, tiny_llama: str, drafter_class, **options):
    """(dataset of the oracle run, the tiny Llama's TargetHead, a fresh drafter of `drafter_class` built for the run
    with k = 3 and `options` from seed 0, prepared on the dataset): what each family's tests start from."""
    from drafters.base import TargetHead
    from training import HiddenStatesDataset

    output, _, _ = oracle_run
    ds = HiddenStatesDataset(output)
    target = TargetHead.from_model_dir(tiny_llama)
    torch.manual_seed(0)
    drafter = drafter_class.for_run(ds.run_info, target, 3, **options)
    drafter.prepare(ds)
    return ds, target, drafter


def train_steps(drafter, target, batch, steps: int, lr: float = 3e-3):
    """`steps` AdamW steps of drafter.training_step on one batch (its trainable parameters only); (losses, the last
    StepResult)."""
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        result = drafter.training_step(batch, target)
        opt.zero_grad()
        result.loss.backward()
        opt.step()
        losses.append(result.loss.item())
    return losses, result


def greedy_run(oracle_model, tiny_llama: str, out: str, layers, new_tokens: int = 12) -> list[list[int]]:
    """An hsx run at `out` of PROMPTS + the tiny Llama's greedy continuations (states from a plain transformers
    forward, layers `layers`, every token trained); returns the continuations (the oracle's outputs)."""
    from connectors import HiddenStatesSpec
    from harness.runs import Sample, pre_norm_hidden_states, write_run

    model, tokenizer = oracle_model
    samples, refs = [], []
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            full = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[0]
        refs.append(full.tolist()[len(ids):])
        states = pre_norm_hidden_states(model, full)
        samples.append(Sample(f"g{i}", full, torch.stack([states[k] for k in layers], 1).contiguous(),
                              torch.ones(len(full), dtype=torch.uint8)))
    spec = HiddenStatesSpec(layer_ids=tuple(layers), num_hidden_layers=4, hidden_size=64, dtype="float32",
                            model=tiny_llama)
    write_run(out, samples, spec)
    return refs


def decode_like_generate(tiny_llama: str, speculative_config: dict, refs: list[list[int]], *,
                         min_accepted_per_draft: float):
    """LLM(speculative_config) two rows at a time over PROMPTS: outputs == refs, drafts accepted at least
    `min_accepted_per_draft` per draft (AL - 1), and a sampled row beside a greedy one leaves the greedy row as it
    was. Returns the engine's metrics by name."""
    from extractor import LLM, SamplingParams

    llm = LLM(model=tiny_llama, dtype="float32", device="cpu", max_num_seqs=2, speculative_config=speculative_config)
    outputs = llm.generate(list(PROMPTS), SamplingParams(temperature=0.0, max_tokens=len(refs[0])))
    assert [o.outputs[0].token_ids for o in outputs] == refs
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    assert drafts > 0 and accepted / drafts >= min_accepted_per_draft, (accepted, drafts)
    mixed = llm.generate(list(PROMPTS[:2]), [SamplingParams(temperature=0.8, max_tokens=12, seed=3),
                                             SamplingParams(temperature=0.0, max_tokens=12)])
    assert 0 < len(mixed[0].outputs[0].token_ids) <= 12 and mixed[1].outputs[0].token_ids == refs[1][:12]
    return metrics


def spec_decode_example():
    """examples/spec_decode.py as a module (the seed's loop)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    try:
        import spec_decode
    finally:
        sys.path.pop(0)
    return spec_decode
