"""Training targets are the distributions the target serves: TargetHead (read from the folder or shared with a loaded
model) and the trainer's teacher (TeacherLogits, whole and chunked) apply the family's logits transform (Gemma's
soft-cap, Granite's logits_scaling, Falcon-H1's lm_head_multiplier), checked against transformers' own logits on every
family of the matrix that has a transform."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from reference.tiny_models import FAMILIES, build_tiny_model

TRANSFORMED = {"gemma2": {}, "granite": {}, "falcon_h1": {"lm_head_multiplier": 0.5},
               "gemma3_text": {"final_logit_softcapping": 5.0}}
"""The matrix's families whose CausalLM forward transforms lm_head's output (Gemma-2's soft-cap of 30 and Granite's
logits_scaling of 2 are their tiny configs' own; Falcon-H1's multiplier and Gemma-3's cap are 1 / None by default, so
the test sets them)."""


def _oracle(model_dir: str):
    """(pre-norm last-layer states [1, T, H], transformers' logits [1, T, V]) of one forward, the states read by a hook
    on the model's final norm (its input is the last layer's output)."""
    from transformers import AutoModelForCausalLM

    from extractor.norm import FinalNorm

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen = []
    handle = FinalNorm.of_model(model).module.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    ids = torch.tensor([[3, 17, 41, 5, 99, 12, 7, 64]])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    handle.remove()
    return model, seen[-1], logits


def test_every_matrix_family_with_a_transform_is_covered():
    from extractor.head import has_logits_transform
    from reference.tiny_models import _config

    transformed = {f for f in FAMILIES if has_logits_transform(_config(f, 512, 1, 2, **TRANSFORMED.get(f, {})))}
    assert transformed == set(TRANSFORMED), transformed  # a family that gains one is added above


@pytest.mark.parametrize("config_class, extra", [("HyperCLOVAXConfig", {"logits_scaling": 0.5}),  # multiplies
                                                 ("CohereConfig", {"logit_scale": 0.25}),
                                                 ("MptConfig", {})])  # MPT's logit_scale is never applied
def test_families_outside_the_matrix_transform_as_their_forward_does(config_class, extra):
    import transformers

    from drafters.base import TargetHead
    from extractor.norm import FinalNorm

    sizes = dict(vocab_size=300)
    if config_class == "MptConfig":
        sizes.update(d_model=64, n_heads=4, n_layers=2)
    else:
        sizes.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**sizes, **extra)).eval()
    seen = []
    handle = FinalNorm.of_model(model).module.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([[3, 17, 41, 5, 99]]), use_cache=False).logits
    handle.remove()
    torch.testing.assert_close(TargetHead.of_model(model).logits(seen[-1][0]), expected[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(TRANSFORMED))
def test_target_logits_equal_transformers_logits_for_families_that_transform_them(tmp_path, family):
    from drafters.base import TargetHead
    from extractor.head import has_logits_transform

    model_dir = build_tiny_model(family, str(tmp_path), **TRANSFORMED[family])
    model, pre, expected = _oracle(model_dir)
    assert has_logits_transform(model.config)
    raw = TargetHead.from_model_dir(model_dir)
    raw.transform = None
    assert not torch.allclose(raw.logits(pre[0]), expected[0], atol=1e-3), "the transform must change the logits"
    for head in (TargetHead.from_model_dir(model_dir), TargetHead.of_model(model, model_dir)):
        torch.testing.assert_close(head.logits(pre[0]), expected[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [0, 3])
def test_the_trainers_teacher_is_the_served_distribution_whole_or_chunked(tmp_path, chunk):
    from drafters.base import DrafterBatch, TargetHead
    from drafters.last_state import TeacherLogits

    model_dir = build_tiny_model("gemma2", str(tmp_path))
    _, pre, expected = _oracle(model_dir)  # [1, T, H], [1, T, V]
    target = TargetHead.from_model_dir(model_dir)
    t = pre.shape[1]
    batch = DrafterBatch(torch.zeros(1, t, dtype=torch.long), pre[:, :, None], torch.ones(1, t, dtype=torch.bool),
                         torch.arange(t)[None], torch.zeros(1, t, dtype=torch.long), (4,))
    post = target.post_norm(pre)
    teacher = TeacherLogits.of(batch, post, target, chunk=chunk)
    rows = teacher.rows(torch.zeros(t - 1, dtype=torch.long), torch.arange(t - 1))
    got = teacher.distribution(rows)(torch.arange(t - 1))
    torch.testing.assert_close(got, F.softmax(expected[0, :-1], dim=-1), rtol=1e-5, atol=1e-6)
    assert teacher.greedy.tolist() == expected[0, :-1].argmax(-1).tolist()


def test_a_family_without_a_transform_keeps_plain_lm_head_logits(tmp_path):
    from drafters.base import TargetHead

    model_dir = build_tiny_model("llama", str(tmp_path))
    _, pre, expected = _oracle(model_dir)
    head = TargetHead.from_model_dir(model_dir)
    assert head.transform is None
    torch.testing.assert_close(head.logits(pre[0]), expected[0], rtol=1e-5, atol=1e-5)
