"""Method "mtp": a target's own MTP layers, read from its checkpoint by hsx, draft for it.

Oracle: the published formula of each style (vLLM's deepseek_mtp.py, glm4_moe_mtp.py, qwen3_next_mtp.py,
qwen3_5_mtp.py) written out here over the checkpoint's raw tensors, read by name with safetensors — RMSNorm by hand,
the decoder layer transformers' own class for the family — run over whole sequences without a cache. Decoding is
checked by losslessness against transformers' `generate`."""

from __future__ import annotations

import importlib
import json
import os
import shutil

import pytest
import torch

from reference.tiny_models import add_mtp_layers, build_tiny_model, randomise_norms

STYLES = ("deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_text")
_CLASSES = {"deepseek_v3": ("deepseek_v3", "DeepseekV3DecoderLayer", "DeepseekV3RotaryEmbedding"),
            "glm4_moe": ("glm4_moe", "Glm4MoeDecoderLayer", "Glm4MoeRotaryEmbedding"),
            "qwen3_next": ("qwen3_next", "Qwen3NextDecoderLayer", "Qwen3NextRotaryEmbedding"),
            "qwen3_5_text": ("qwen3_5", "Qwen3_5DecoderLayer", "Qwen3_5TextRotaryEmbedding")}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """style -> folder of a tiny target with 2 MTP layers (DeepSeek with its per-layer embedding/head copies), and
    "deepseek_v3/1": one MTP layer, as DeepSeek-V3 ships. Every norm weight random (the target's final norm too)."""
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for style in STYLES:
        out[style] = add_mtp_layers(randomise_norms(build_tiny_model(style, str(root / style), seed=3)), 2, seed=5,
                                    own_copies=style == "deepseek_v3")
    out["deepseek_v3/1"] = add_mtp_layers(randomise_norms(build_tiny_model("deepseek_v3", str(root / "ds1"), seed=4)),
                                          1, seed=6)
    return out


def _model(folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


# -- the oracle: the published formula over the raw tensors ------------------------------------------------------
def _rms(x, w, plus_one):
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
    return y * ((1.0 + w.float()) if plus_one else w.float())


class Oracle:
    def __init__(self, folder, style):
        from safetensors.torch import load_file
        from transformers import AutoConfig

        self.style, self.raw = style, load_file(os.path.join(folder, "model.safetensors"))
        self.config = AutoConfig.from_pretrained(folder)
        with open(os.path.join(folder, "config.json")) as f:
            doc = json.load(f)
        self.count = doc.get("num_nextn_predict_layers") or doc.get("mtp_num_hidden_layers")
        self.n = self.config.num_hidden_layers
        self.qwen = style.startswith("qwen")
        module, layer_name, rotary_name = _CLASSES[style]
        mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        config = self.config
        config._attn_implementation = "sdpa"
        if getattr(config, "layer_types", None) is not None:  # MTP layers attend in full (vLLM builds them so)
            config.layer_types = ["full_attention"] * (self.n + self.count)
        self.rotary = getattr(mod, rotary_name)(config=config)
        self.blocks = []
        for j in range(self.count):
            prefix = f"mtp.layers.{j}." if self.qwen else f"model.layers.{self.n + j}."
            block = getattr(mod, layer_name)(config, j if self.qwen else self.n + j)
            state = {}
            for name, p in block.state_dict().items():
                if name.endswith("experts.gate_up_proj"):  # checkpoints store experts one by one
                    stem = prefix + name[:-len("gate_up_proj")]
                    state[name] = torch.stack([torch.cat([self.raw[f"{stem}{e}.gate_proj.weight"],
                                                          self.raw[f"{stem}{e}.up_proj.weight"]])
                                               for e in range(p.shape[0])])
                elif name.endswith("experts.down_proj"):
                    stem = prefix + name[:-len("down_proj")]
                    state[name] = torch.stack([self.raw[f"{stem}{e}.down_proj.weight"] for e in range(p.shape[0])])
                else:
                    state[name] = self.raw[prefix + name]
            block.load_state_dict(state)
            self.blocks.append(block.eval())
        self.embed = self.raw["model.embed_tokens.weight"]
        self.lm_head = self.raw["lm_head.weight"]

    def layer(self, j, tokens, hidden):
        """MTP layer j over entries (tokens[p], hidden[p]) at positions 0..m-1 -> (carried [m, H], logits [m, V])."""
        pos = torch.arange(len(tokens))
        if self.qwen:
            p = "mtp."
            e = self.embed[torch.tensor(tokens)]
            u = torch.cat([_rms(e, self.raw[p + "pre_fc_norm_embedding.weight"], True),
                           _rms(hidden, self.raw[p + "pre_fc_norm_hidden.weight"], True)], -1) \
                @ self.raw[p + "fc.weight"].T
        else:
            p = f"model.layers.{self.n + j}."
            embed = self.raw.get(p + "embed_tokens.weight", self.embed)
            e = embed[torch.tensor(tokens)] * (pos != 0)[:, None]  # zeroed at position 0
            u = torch.cat([_rms(e, self.raw[p + "enorm.weight"], False),
                           _rms(hidden, self.raw[p + "hnorm.weight"], False)], -1) @ self.raw[p + "eh_proj.weight"].T
        with torch.no_grad():
            v = self.blocks[j](u[None], attention_mask=None, position_ids=pos[None],
                               position_embeddings=self.rotary(u[None], pos[None]))
        v = (v[0] if isinstance(v, tuple) else v)[0]
        if self.qwen:
            carried = _rms(v, self.raw["mtp.norm.weight"], True)
            return carried, carried @ self.lm_head.T
        normed = _rms(v, self.raw[p + "shared_head.norm.weight"], False)
        head = self.raw.get(p + "shared_head.head.weight", self.lm_head)
        carried = normed if self.style == "deepseek_v3" else v  # GLM carries the pre-norm state
        return carried, normed @ head.T

    def drafts(self, post_norm, ctx, k):
        """k greedy drafts after ctx: entries (x_{p+1}, post-norm state of x_p); step s reads layer s % L, every
        layer sees every entry (the drafts fed with the state the previous step carried)."""
        tokens, hidden = list(ctx[1:]), post_norm
        out, first_logits = [], None
        for s in range(k):
            carried, logits = self.layer(s % self.count, tokens, hidden)
            first_logits = logits[-1] if first_logits is None else first_logits
            out.append(int(logits[-1].argmax()))
            tokens.append(out[-1])
            hidden = torch.cat([hidden, carried[-1:]])
        return out, first_logits


def _runner(folder):
    from extractor.config import EngineConfig
    from extractor.runner import ModelRunner

    return ModelRunner(EngineConfig(model=folder, dtype="float32", device="cpu"))


@pytest.mark.parametrize("style", STYLES)
def test_each_styles_drafts_equal_its_published_formula_over_the_checkpoints_own_tensors(style, targets):
    from drafters.mtp_proposer import MtpProposer
    from extractor.sampling import SamplingParams

    folder = targets[style]
    model = _model(folder)
    g = torch.Generator().manual_seed(7)
    ctx = torch.randint(5, 400, (11,), generator=g).tolist()
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, a, o: captured.update(last=o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        post = model.model(torch.tensor([ctx[:-1]])).last_hidden_state[0]  # what vLLM's target hands its MTP layers
    hook.remove()
    oracle = Oracle(folder, style)
    want, want_logits = oracle.drafts(post, ctx, 5)  # k = 5 > L = 2: layers 0, 1, 0, 1, 0
    proposer = MtpProposer(folder, _runner(folder), 5)
    assert proposer.capture_layer_ids == (oracle.n,)
    proposer.start([ctx])
    proposer.observe([captured["last"][0][:, None]])  # layer N, pre-norm, as the engine captures it
    draft = proposer.propose([ctx], [5], [SamplingParams(temperature=0.0, max_tokens=8)], [None])[0]
    assert draft.token_ids == want
    got_logits = proposer.head.logits(proposer.last_output[0][0], 0)
    torch.testing.assert_close(got_logits.float(), want_logits.float(), atol=2e-4, rtol=1e-4)


def _generate(folder, prompts, n, spec):
    from extractor import LLM, SamplingParams

    llm = LLM(folder, speculative_config=spec, max_num_batched_tokens=16, dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs], llm.get_metrics()


def _prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(5, 400, (n,), generator=g).tolist() for n in (9, 21, 4)]


@pytest.mark.parametrize("style,k", [("deepseek_v3/1", 1), ("deepseek_v3/1", 2), ("deepseek_v3/1", 3),
                                     *[(s, 3) for s in STYLES]])
def test_mtp_decoding_equals_plain_greedy_decoding_with_vllms_metrics(style, k, targets):
    folder = targets[style]
    model, prompts = _model(folder), _prompts()
    try:
        got, metrics = _generate(folder, prompts, 20, {"method": "mtp", "num_speculative_tokens": k})
    except ValueError as e:  # transformers < 5.25 records no per-token linear-attention states (docs/families.md)
        if "are rolled back with transformers >= 5.25" not in str(e):
            raise
        pytest.skip(str(e))
    for p, out in zip(prompts, got):
        assert out == model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p):].tolist()
    by_name = {m.name: m for m in metrics}
    assert by_name["vllm:spec_decode_num_drafts"].value > 0
    assert by_name["vllm:spec_decode_num_draft_tokens"].value >= by_name["vllm:spec_decode_num_drafts"].value
    assert len(by_name["vllm:spec_decode_num_accepted_tokens_per_pos"].values) == k


# -- refusals ---------------------------------------------------------------------------------------------------
def _llm_error(folder, spec):
    from extractor import LLM

    with pytest.raises(ValueError) as e:
        LLM(folder, speculative_config=spec, dtype="float32")
    message = str(e.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_a_target_without_mtp_layers_is_refused_in_one_line_naming_what_is_missing(targets, tmp_path):
    llama = build_tiny_model("llama", str(tmp_path / "llama"))
    message = _llm_error(llama, {"method": "mtp", "num_speculative_tokens": 2})
    assert "declares no MTP layers" in message and "llama" in message
    # declared (transformers' DeepSeek-V3 default num_nextn_predict_layers = 1) but the tensors are not there
    bare = build_tiny_model("deepseek_v3", str(tmp_path / "bare"))
    message = _llm_error(bare, {"method": "mtp", "num_speculative_tokens": 2})
    assert "lacks" in message and "model.layers.4." in message


def _damaged(targets, tmp_path, change):
    from safetensors.torch import load_file, save_file

    folder = str(tmp_path / "damaged")
    shutil.copytree(targets["deepseek_v3/1"], folder)
    raw = load_file(os.path.join(folder, "model.safetensors"))
    change(raw)
    save_file(raw, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_misshapen_or_non_finite_mtp_tensors_are_refused_naming_the_tensor(targets, tmp_path):
    folder = _damaged(targets, tmp_path, lambda raw: raw.update({"model.layers.4.eh_proj.weight": torch.zeros(64, 96)}))
    message = _llm_error(folder, {"method": "mtp", "num_speculative_tokens": 1})
    assert "model.layers.4.eh_proj.weight" in message and "shape" in message
    shutil.rmtree(folder)

    def nan(raw):
        raw["model.layers.4.mlp.experts.1.up_proj.weight"][0, 0] = float("nan")

    folder = _damaged(targets, tmp_path, nan)
    message = _llm_error(folder, {"method": "mtp", "num_speculative_tokens": 1})
    assert "non-finite" in message and "experts.gate_up_proj" in message
    shutil.rmtree(folder)
    folder = _damaged(targets, tmp_path, lambda raw: None)
    with open(os.path.join(folder, "config.json")) as f:
        doc = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:  # an fp8 checkpoint: weights with their own scales
        json.dump({**doc, "quantization_config": {"quant_method": "fp8"}}, f)
    assert "quantized ('fp8'" in _mtp_error(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(doc, f)
    with open(os.path.join(folder, "model.safetensors"), "r+b") as f:  # a truncated download
        f.truncate(1000)
    message = _mtp_error(folder)
    assert "model.safetensors" in message and ("not a readable" in message or "cannot read" in message)


def _mtp_error(folder):
    """MtpHead.from_folder's one-line refusal (the engine would fail loading the truncated target first)."""
    from transformers import AutoConfig

    from drafters.mtp import MtpHead

    config = AutoConfig.from_pretrained(folder)
    with pytest.raises(ValueError) as e:
        MtpHead.from_folder(folder, hf_config=config, embed_tokens=torch.zeros(512, 64), lm_head=torch.zeros(512, 64))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_speculative_configs_for_mtp_are_refused(targets, tmp_path):
    folder = targets["deepseek_v3/1"]
    assert "integer >= 1" in _llm_error(folder, {"method": "mtp", "num_speculative_tokens": 0})
    assert "parallel_drafting" in _llm_error(folder, {"method": "mtp", "num_speculative_tokens": 2,
                                                       "parallel_drafting": True})
    other = add_mtp_layers(build_tiny_model("deepseek_v3", str(tmp_path / "wide"), hidden_size=96), 1)
    message = _llm_error(folder, {"method": "mtp", "model": other, "num_speculative_tokens": 2})
    assert "hidden_size 96" in message


def test_the_method_and_k_are_inferred_from_a_target_folder_with_mtp_layers_as_vllm_does(targets):
    from extractor.config import SpeculativeConfig, speculative_config_from_dict

    spec, _ = speculative_config_from_dict({"model": targets["qwen3_next"]})
    assert (spec.method, spec.num_speculative_tokens) == ("mtp", 2)  # vLLM's default k: the number of MTP layers
    # the same folder is still a causal LM a draft_model may name
    assert SpeculativeConfig("draft_model", 2, model=targets["deepseek_v3/1"]).method == "draft_model"


def test_the_seed_script_runs_method_mtp_through_hsx(targets, capsys):
    import examples.spec_decode as seed

    al = seed.main(["--method", "mtp", "--model", targets["deepseek_v3/1"], "--num-spec-tokens", "2",
                    "--num-prompts", "3", "--output-len", "12"])
    out = capsys.readouterr().out
    assert "mean acceptance length" in out and "acceptance at token 1" in out and al >= 1.0


def test_hsx_eval_drafter_measures_mtp_on_a_target_folder_and_refuses_one_without_mtp_layers(targets, tmp_path,
                                                                                               capsys):
    from cli.main import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "the cat jumps over the lazy dog"}) + "\n")
    out = tmp_path / "results.json"
    folder = targets["deepseek_v3/1"]
    assert main(["eval-drafter", "--model", folder, "--drafter", folder, "--prompts", str(prompts), "--max-tokens",
                 "8", "-k", "2", "--no-ngram", "--json", str(out)]) == 0  # the method read from the folder
    rows = json.loads(out.read_text())
    assert [r["method"] for r in rows] == ["none", "mtp (ds1) k=2"] and all(r["lossless"] for r in rows)
    llama = build_tiny_model("llama", str(tmp_path / "llama"))
    capsys.readouterr()
    assert main(["eval-drafter", "--model", llama, "--drafter", f"mtp:{llama}", "--prompts", str(prompts),
                 "--max-tokens", "4", "--no-ngram"]) == 1
    printed = capsys.readouterr()
    assert "NOT EVALUATED" in printed.out + printed.err and "declares no MTP layers" in printed.out + printed.err
    assert "Traceback" not in printed.out + printed.err
    twin = add_mtp_layers(randomise_norms(build_tiny_model("deepseek_v3", str(tmp_path / "twin"), seed=8)), 1, seed=6)
    assert main(["eval-drafter", "--model", folder, "--drafter", f"mtp:{twin}", "--prompts", str(prompts),
                 "--max-tokens", "4", "--no-ngram"]) == 1  # another target's MTP layers of the same shape
    printed = capsys.readouterr()
    assert "NOT EVALUATED" in printed.out + printed.err and "belongs to another target" in printed.out + printed.err
    assert "Traceback" not in printed.out + printed.err


# -- fine-tuning (hsx train-drafter --kind mtp) and merging back --------------------------------------------------
def _states(model, ids):
    """(pre-norm layer N [T, H] as a run stores it, post-norm [T, H] as transformers returns it)."""
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, a, o: captured.update(last=o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        post = model.model(torch.tensor([ids])).last_hidden_state[0]
    hook.remove()
    return captured["last"][0], post


def _packed(model, docs, holes):
    """A DrafterBatch of one row holding `docs` back to back (layer N only), loss mask 0 at `holes` (row
    positions)."""
    from drafters.base import DrafterBatch

    ids = [t for d in docs for t in d]
    pre = torch.cat([_states(model, d)[0] for d in docs])
    mask = torch.ones(len(ids), dtype=torch.bool)
    mask[list(holes)] = False
    n = model.config.num_hidden_layers
    return DrafterBatch(torch.tensor([ids]), pre[None, :, None], mask[None],
                        torch.tensor([[p for d in docs for p in range(len(d))]]),
                        torch.tensor([[i for i, d in enumerate(docs) for _ in d]]), (n,))


@pytest.mark.parametrize("style", ["deepseek_v3", "qwen3_next"])
def test_mtp_training_loss_equals_the_chained_objective_written_out_over_the_checkpoints_tensors(style, targets):
    """loss = sum_s w_s * mean over chains t trained at s of CE(MTP layer s % L's logits after s chained steps,
    softmax of the target's logits for x_{t+2+s}); w_s = 0.6^s normalised; chain t's step s sees its document's
    entries 0..t and its own earlier steps, as decoding does."""
    import torch.nn.functional as F

    from drafters.base import TargetHead
    from drafters.mtp import MtpDrafter

    folder = targets[style]
    model, oracle = _model(folder), Oracle(folder, style)
    g = torch.Generator().manual_seed(12)
    docs = [torch.randint(5, 400, (n,), generator=g).tolist() for n in (10, 8)]
    batch = _packed(model, docs, holes=(4, 13))
    spec = type("Spec", (), {"num_hidden_layers": oracle.n, "layer_ids": (oracle.n,), "target_top_k": None})()
    drafter = MtpDrafter.for_run(spec, TargetHead.from_model_dir(folder), 3, ttt_steps=3)
    got = drafter.training_step(batch, None)
    weights = [0.6 ** s / sum(0.6 ** j for j in range(3)) for s in range(3)]
    per_step: list[list[torch.Tensor]] = [[], [], []]
    mask, start = batch.loss_mask[0], 0
    for d in docs:
        post = _states(model, d)[1]
        teacher = torch.softmax(post @ oracle.lm_head.T, -1)  # [T, V]: row p is the target's x_{p+1}
        for t in range(len(d) - 2):
            tokens, hidden = list(d[1:t + 2]), post[:t + 1]  # entries 0..t: (x_{p+1}, state of x_p)
            for s in range(3):
                if t + 2 + s >= len(d):
                    break
                carried, logits = oracle.layer(s % oracle.count, tokens, hidden)
                if mask[start + t + 2 + s]:
                    per_step[s].append(-(teacher[t + 1 + s] * F.log_softmax(logits[-1].float(), -1)).sum())
                tokens.append(d[t + 2 + s])  # teacher forcing: the chain's next entry is the corpus token
                hidden = torch.cat([hidden, carried[-1:]])
        start += len(d)
    assert got.counted.tolist() == [len(x) for x in per_step] and len(per_step[2]) > 0
    want = sum(w * torch.stack(x).mean() for w, x in zip(weights, per_step))
    torch.testing.assert_close(got.loss.detach().float(), want.float(), atol=1e-4, rtol=1e-4)
    trainable = [n for n, p in drafter.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith(("head.parts.", "head.blocks.")) for n in trainable)
    grads = torch.autograd.grad(got.loss, [p for p in drafter.parameters() if p.requires_grad], allow_unused=True)
    assert sum(int(g is not None and bool(g.abs().sum() > 0)) for g in grads) > len(grads) // 2


def _sha(folder):
    import hashlib

    return {name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(folder)) if os.path.isfile(os.path.join(folder, name))}


def test_tuned_mtp_layers_save_in_the_checkpoints_own_layout_decode_and_merge_into_a_new_target(targets, tmp_path,
                                                                                               capsys):
    from safetensors.torch import load_file

    from cli.main import main
    from drafters.base import TargetHead
    from drafters.mtp import MtpDrafter
    from extractor.config import SpeculativeConfig, checkpoint_method
    from tests.drafters.helpers import train_steps

    folder = targets["deepseek_v3"]  # two MTP layers, each with its own embedding / head copies
    before = _sha(folder)
    model = _model(folder)
    g = torch.Generator().manual_seed(13)
    batch = _packed(model, [torch.randint(5, 400, (n,), generator=g).tolist() for n in (12, 9)], holes=())
    spec = type("Spec", (), {"num_hidden_layers": 4, "layer_ids": (4,), "target_top_k": None})()
    drafter = MtpDrafter.for_run(spec, TargetHead.from_model_dir(folder), 3)
    losses, _ = train_steps(drafter, None, batch, 3, lr=1e-2)
    assert losses[-1] < losses[0]
    tuned = str(tmp_path / "tuned")
    drafter.save_pretrained(tuned, verifier=folder)
    assert checkpoint_method(tuned) == "mtp"
    native = {k: v for k, v in load_file(os.path.join(folder, "model.safetensors")).items()
              if k.startswith(("model.layers.4.", "model.layers.5."))}
    saved = load_file(os.path.join(tuned, "model.safetensors"))
    assert saved.keys() == native.keys()  # the checkpoint's own key names, experts one by one
    assert all(saved[k].shape == native[k].shape for k in saved)
    frozen = [k for k in saved if k.endswith(("embed_tokens.weight", "shared_head.head.weight"))]
    assert len(frozen) == 4 and all(torch.equal(saved[k], native[k]) for k in frozen)
    assert not torch.equal(saved["model.layers.4.eh_proj.weight"], native["model.layers.4.eh_proj.weight"])
    with pytest.raises(ValueError, match="use method 'mtp' for it"):  # MTP tensors alone are no draft model
        SpeculativeConfig("draft_model", 2, model=tuned)
    back = MtpDrafter.from_pretrained(tuned)
    ours, theirs = drafter.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    prompts = _prompts()
    refs = [model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
    standalone, m1 = _generate(folder, prompts, 16, {"method": "mtp", "model": tuned, "num_speculative_tokens": 3})
    assert standalone == refs
    merged = str(tmp_path / "merged")
    assert main(["merge-mtp", "--model", folder, "--drafter", tuned, "--out", merged]) == 0
    assert _sha(folder) == before  # the original is never written
    after, theirs = _sha(merged), load_file(os.path.join(merged, "model.safetensors"))
    assert {k: v for k, v in after.items() if k != "model.safetensors"} == \
        {k: v for k, v in before.items() if k != "model.safetensors"}
    original = load_file(os.path.join(folder, "model.safetensors"))
    assert theirs.keys() == original.keys()
    assert all(torch.equal(theirs[k], saved[k] if k in saved else original[k]) for k in theirs)
    in_place, m2 = _generate(merged, prompts, 16, {"method": "mtp", "num_speculative_tokens": 3})
    assert in_place == refs  # and the same drafts: the same acceptance, count for count
    assert {m.name: getattr(m, "value", getattr(m, "values", None)) for m in m1 if m.name.startswith("vllm:spec")} \
        == {m.name: getattr(m, "value", getattr(m, "values", None)) for m in m2 if m.name.startswith("vllm:spec")}
    # refused, nothing written: an --out that is not empty or lies inside --model / --drafter, layers tuned for
    # another target (of another shape, or of the same shape: another seed)
    twin = add_mtp_layers(randomise_norms(build_tiny_model("deepseek_v3", str(tmp_path / "twin"), seed=9)), 2, seed=5,
                          own_copies=True)
    twin_before = _sha(twin)
    capsys.readouterr()
    for argv, message in ((["--out", merged], "holds a model"),
                          (["--out", os.path.join(folder, "inside")], "lies inside the --model folder"),
                          (["--out", os.path.join(tuned, "inside")], "lies inside the --drafter folder"),
                          (["--drafter", targets["glm4_moe"], "--out", str(tmp_path / "x")], "another target"),
                          (["--model", twin, "--out", str(tmp_path / "x")], "was tuned for another target")):
        args = ["merge-mtp", "--model", folder, "--drafter", tuned, "--out", str(tmp_path / "y"), *argv]
        with pytest.raises(SystemExit) as e:
            main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")
    assert not os.path.exists(os.path.join(folder, "inside")) and not os.path.exists(os.path.join(tuned, "inside"))
    assert _sha(folder) == before and _sha(twin) == twin_before
    # decoding the twin with layers tuned for `folder`, or with `folder`'s own layers: refused, not a silent wrong draft
    for model in (tuned, folder):
        assert "another target" in _llm_error(twin, {"method": "mtp", "model": model, "num_speculative_tokens": 2})


def _recast(folder: str, out: str, dtype: torch.dtype) -> str:
    """A copy of the target at `folder` with every floating tensor stored in `dtype` (as `save_pretrained(dtype=...)`
    or a requantizing tool writes it): the same target, other bytes."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    path = os.path.join(out, "model.safetensors")
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        doc = json.load(f)
    doc["dtype"] = doc["torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(doc, f)
    return out


def _bytes_digest(folder: str) -> str:
    """The target digest an earlier hsx recorded, written out here: sha256 over each shared tensor's (shape, dtype)
    and its bytes as stored (input embeddings, lm_head, final norm)."""
    import hashlib

    from drafters.base import TargetHead

    head = TargetHead.from_model_dir(folder)
    digest = hashlib.sha256()
    for tensor in (head.embed_tokens, head.lm_head, *head.norm.module.state_dict().values()):
        digest.update(str((tuple(tensor.shape), tensor.dtype)).encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy())
    return "sha256:" + digest.hexdigest()[:32]


def _refusal(call) -> str:
    with pytest.raises(ValueError) as e:
        call()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_the_target_check_holds_across_storage_dtypes_reads_old_digests_and_has_an_override(targets, tmp_path,
                                                                                            capsys):
    """MTP layers tuned for a bfloat16 target are taken by the same target stored in float16 or float32 (its
    embeddings hold a value float16 cannot keep, a tiny one: values under 2^-14 count as 0), by merge-mtp,
    from_pretrained and the speculative_config check; a target folder's own layers too. Another target of the same shape is still
    refused, each refusal naming its override, which then takes it. A checkpoint of an earlier hsx (its digest over
    the bytes as stored) is still taken by its own target; a re-cast copy of it needs the override."""
    from cli.main import main
    from drafters.base import TargetHead
    from drafters.mtp import MtpDrafter
    from drafters.mtp_checkpoint import check_source

    base = targets["deepseek_v3/1"]
    bf16 = _recast(base, str(tmp_path / "bf16"), torch.bfloat16)
    copies = {"float16": _recast(bf16, str(tmp_path / "fp16"), torch.float16),
              "float32": _recast(bf16, str(tmp_path / "fp32"), torch.float32)}
    embed = TargetHead.from_model_dir(bf16).embed_tokens
    lost = (embed.float() != embed.to(torch.float16).float()).sum()
    assert lost > 0  # the float16 copy's bytes, and values, differ from the target's
    spec = type("Spec", (), {"num_hidden_layers": 4, "layer_ids": (4,), "target_top_k": None})()
    tuned = str(tmp_path / "tuned")
    MtpDrafter.for_run(spec, TargetHead.from_model_dir(bf16), 2).save_pretrained(tuned, verifier=bf16)
    with open(os.path.join(tuned, "config.json")) as f:
        assert json.load(f)["hsx"]["target_digest"].startswith("sha256-bf16:")
    for name, copy in copies.items():
        assert MtpDrafter.from_pretrained(tuned, target_dir=copy).verifier == copy, name
        check_source(tuned, copy, "speculative_config method 'mtp'")
        check_source(bf16, copy, "speculative_config method 'mtp'")  # a target folder's own layers
        assert main(["merge-mtp", "--model", copy, "--drafter", tuned, "--out", str(tmp_path / f"merged-{name}")]) \
            == 0, name
    # another target of the same shape (another seed): refused, the override named, then taken
    twin = _recast(add_mtp_layers(randomise_norms(build_tiny_model("deepseek_v3", str(tmp_path / "t"), seed=8)), 1,
                                  seed=6), str(tmp_path / "twin"), torch.bfloat16)
    refused = _refusal(lambda: MtpDrafter.from_pretrained(tuned, target_dir=twin))
    assert "was tuned for another target" in refused and "pass allow_target_mismatch=True" in refused, refused
    assert MtpDrafter.from_pretrained(tuned, target_dir=twin, allow_target_mismatch=True).verifier == twin
    served = _refusal(lambda: check_source(tuned, twin, "speculative_config method 'mtp'"))
    assert "hsx merge-mtp" in served and "--allow-target-mismatch" in served, served
    assert "belongs to another target" in _refusal(lambda: check_source(bf16, twin, "x"))
    capsys.readouterr()
    merge = ["merge-mtp", "--model", twin, "--drafter", tuned, "--out", str(tmp_path / "forced")]
    with pytest.raises(SystemExit) as e:
        main(merge)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "was tuned for another target" in err and "--allow-target-mismatch" in err, err
    assert len(err.strip().splitlines()) == 1 and not os.path.exists(tmp_path / "forced")
    assert main([*merge, "--allow-target-mismatch"]) == 0 and os.path.isdir(tmp_path / "forced")
    # a checkpoint written before: its digest over the bytes as stored
    old = str(tmp_path / "old")
    shutil.copytree(tuned, old)
    with open(os.path.join(old, "config.json")) as f:
        doc = json.load(f)
    doc["hsx"]["target_digest"] = _bytes_digest(bf16)
    with open(os.path.join(old, "config.json"), "w") as f:
        json.dump(doc, f)
    assert MtpDrafter.from_pretrained(old).verifier == bf16
    check_source(old, bf16, "speculative_config method 'mtp'")
    for other in (copies["float16"], twin):
        refused = _refusal(lambda other=other: MtpDrafter.from_pretrained(old, target_dir=other))
        assert "bytes as stored" in refused and "pass allow_target_mismatch=True" in refused, refused
    assert MtpDrafter.from_pretrained(old, target_dir=copies["float16"], allow_target_mismatch=True)


def test_hsx_train_drafter_kind_mtp_tunes_a_targets_own_layers_from_a_run(targets, tmp_path, capsys):
    from cli.main import main
    from connectors import HiddenStatesSpec
    from extractor.config import checkpoint_method
    from harness.runs import Sample, write_run

    folder = targets["deepseek_v3/1"]
    model = _model(folder)
    g = torch.Generator().manual_seed(14)
    samples = []
    for i, n in enumerate((14, 11, 17)):
        ids = torch.randint(5, 400, (n,), generator=g)
        samples.append(Sample(f"s{i}", ids, _states(model, ids.tolist())[0][:, None].contiguous(),
                              torch.ones(n, dtype=torch.uint8)))
    run = str(tmp_path / "run")
    write_run(run, samples, HiddenStatesSpec(layer_ids=(4,), num_hidden_layers=4, hidden_size=64, dtype="float32",
                                             model=folder))
    out = str(tmp_path / "tuned")
    assert main(["train-drafter", "--kind", "mtp", "--run", run, "--model", folder, "--out", out, "--steps", "3",
                 "--ttt-steps", "2", "--num-speculative-tokens", "2"]) == 0
    assert "trained mtp for 3 steps" in capsys.readouterr().out
    assert checkpoint_method(out) == "mtp"
    with open(os.path.join(out, "config.json")) as f:
        hsx = json.load(f)["hsx"]
    assert (hsx["kind"], hsx["ttt_steps"], hsx["num_speculative_tokens"]) == ("mtp", 2, 2)
    bare = build_tiny_model("deepseek_v3", str(tmp_path / "bare"))  # declares an MTP layer, ships no tensors
    bare_run = str(tmp_path / "bare-run")
    write_run(bare_run, samples, HiddenStatesSpec(layer_ids=(4,), num_hidden_layers=4, hidden_size=64,
                                                  dtype="float32", model=bare))
    with pytest.raises(SystemExit) as e:  # a target without MTP tensors: one line, nothing written
        main(["train-drafter", "--kind", "mtp", "--run", bare_run, "--model", bare, "--out", str(tmp_path / "no"),
              "--steps", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and "lacks" in err and "MTP layer" in err, err
    assert not os.path.exists(tmp_path / "no")
