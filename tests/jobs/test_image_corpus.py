"""A job over a corpus of chat records with image parts, on a vision-language target: each good record's file is the
offline engine's (states, mask, positions), its loss mask is the chat's (0 at image tokens), its manifest row counts
the processor's expanded tokens; a bad image, an over-length record whose cut would fall in an image, an image on a
text-only target are their own failed rows, with one line each."""

from __future__ import annotations

import json
import os

import pytest
import torch
from PIL import Image, ImageDraw

from connectors import KVTransferConfig, load_hidden_states
from connectors.format import MM_EMBEDS, MM_TOKEN_TYPE_IDS, POSITION_IDS
from corpus.tokenization import SampleTokenizer, TokenizeSettings
from reference.tiny_models import build_tiny_vl_model


def _chat(text: str, refs: list[str], answer: str = "a red ball") -> dict:
    content = [{"type": "image_url", "image_url": {"url": r}} for r in refs] + [{"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]}


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    return build_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")))


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    for name, size in {"ball.png": (84, 84), "tall.png": (56, 168)}.items():
        image = Image.new("RGB", size, "white")
        ImageDraw.Draw(image).ellipse([4, 4, size[0] - 4, size[1] - 4], fill="red")
        image.save(folder / name)
    (folder / "broken.png").write_bytes(b"\x89PNG not really")
    return str(folder)


def test_the_tokenize_stage_keeps_image_records_whole_for_the_worker(vl_model):
    tok = SampleTokenizer(TokenizeSettings(tokenizer=vl_model, max_prompt_tokens=8, images=True))
    out = tok.tokenize(json.dumps(_chat("what is it", ["ball.png", "data:image/png;base64,AAAA"])))
    assert out.images == ["ball.png", "data:image/png;base64,AAAA"] and not out.truncated  # limited after expansion
    assert out.text.count("<|image_pad|>") == 2 and len(out.ids) == len(out.mask) > 8
    learned = [t for t, m in zip(out.ids, out.mask) if m]  # the assistant's turn, as for text chats
    assert "a red ball" in tok.tokenizer.decode(learned) and "what is it" not in tok.tokenizer.decode(learned)
    text_only = SampleTokenizer(TokenizeSettings(tokenizer=vl_model, max_prompt_tokens=256))
    with pytest.raises(ValueError, match="text-only"):
        text_only.tokenize(json.dumps(_chat("what", ["ball.png"])))


@pytest.mark.ray
@pytest.mark.slow
def test_a_job_over_image_chats(ray_cluster, vl_model, media, tmp_path):
    from connectors.manifest import read_manifest
    from extractor import LLM, SamplingParams
    from jobs.config import JobConfig
    from jobs.pipeline import run_job

    records = {
        "one": _chat("what is it", ["ball.png"]),
        "two": _chat("compare", ["ball.png", f"file://{media}/tall.png"], answer="the second is taller"),
        "text": {"messages": [{"role": "user", "content": "no image here"}, {"role": "assistant", "content": "ok"}]},
        "missing": _chat("what", ["gone.png"]),
        "broken": _chat("what", ["broken.png"]),
        "escape": _chat("what", ["../" + os.path.basename(os.path.dirname(media)) + "/x.png"]),
        "long": {"messages": [{"role": "user", "content": [{"type": "text", "text": "tell me " * 30}] + [
            {"type": "image_url", "image_url": {"url": r}} for r in ("ball.png", "tall.png", "ball.png")]}]},
        "cut_after": {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "ball.png"}},
            {"type": "text", "text": "and then a long question " * 12}]}]},
    }
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": k, **v}) + "\n" for k, v in records.items()))
    output = str(tmp_path / "out")
    result = run_job(JobConfig(model=vl_model, corpus=(str(corpus),), output=output, workers=1, progress=False,
                               allowed_local_media_path=media, max_model_len=96, max_tokens=0, layers=(1, 2, 4),
                               mm_embeds=True))
    rows = {r["sample_id"]: r for r in read_manifest(output).to_pylist()}
    run_json = json.loads(open(os.path.join(output, "run.json")).read())
    assert run_json["image_processing"] == {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64, "patch_size": 14,
                                            "merge_size": 2, "temporal_patch_size": 2}
    assert run_json["mm_embeds"] is True
    failures = {"missing": "does not exist", "broken": "not an image", "escape": "must be inside",
                "long": "would cut image"}
    for sample_id, why in failures.items():
        assert rows[sample_id]["status"] == "failed" and why in rows[sample_id]["error"], rows[sample_id]
        assert "\n" not in rows[sample_id]["error"]
    assert rows["cut_after"]["status"] == "ok" and rows["cut_after"]["truncated"]
    assert rows["cut_after"]["num_prompt_tokens"] == 96
    assert result.ok == 4 and result.failed == 4

    llm = LLM(vl_model, kv_transfer_config=KVTransferConfig(kv_connector_extra_config={
        "shared_storage_path": str(tmp_path / "offline")}), allowed_local_media_path=media,
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}})
    try:
        for sample_id in ("one", "two", "text"):
            row = rows[sample_id]
            assert row["status"] == "ok", row
            got = load_hidden_states(os.path.join(output, row["path"]))
            (want,) = llm.chat(records[sample_id]["messages"], SamplingParams(max_tokens=0),
                               add_generation_prompt=False)
            ref = load_hidden_states(want.kv_transfer_params["hidden_states_path"])
            assert got["token_ids"].tolist() == ref["token_ids"].tolist() and row["num_prompt_tokens"] == len(
                ref["token_ids"])
            torch.testing.assert_close(got["hidden_states"], ref["hidden_states"], rtol=1e-4, atol=5e-5)
            for name in (MM_TOKEN_TYPE_IDS, POSITION_IDS):
                assert torch.equal(got[name], ref[name]), name
            images = got[MM_TOKEN_TYPE_IDS].bool()
            assert images.any() == (sample_id != "text")
            assert not got["loss_mask"][images].any() and got["loss_mask"][~images].any()
            assert got[MM_EMBEDS].shape == (int(images.sum()), 64) if images.any() else MM_EMBEDS not in got
    finally:
        llm.shutdown()

    # hsx report: the image-token share of every sampled sample, and its own section
    from jobs.report import collect, render
    from jobs.report_config import ReportConfig

    data = collect(ReportConfig(output=output, sample=64))
    shares = sorted(v for v in data["states"]["image_token_share"])
    expected = []
    for sample_id in ("one", "two", "text", "cut_after"):
        types = load_hidden_states(os.path.join(output, rows[sample_id]["path"]))[MM_TOKEN_TYPE_IDS]
        expected.append(float((types != 0).float().mean()))
    assert shares == pytest.approx(sorted(expected)) and shares[0] == 0.0 and shares[-1] > 0
    assert "<h2>Image tokens</h2>" in render(data)

    # the training feed: loss off at image tokens, the stored merged embeddings there (or the placeholder's)
    from training.dataset import HiddenStatesDataset

    vision = HiddenStatesDataset(output, include_sample_id=True)
    placeholder = HiddenStatesDataset(output, image_inputs="placeholder")
    for i in range(len(vision)):
        item, plain = vision[i], placeholder[i]
        got = load_hidden_states(vision.path(i), byte_range=vision.byte_range(i))
        image = got[MM_TOKEN_TYPE_IDS].bool()
        assert torch.equal(item["image_mask"].bool(), image) and torch.equal(plain["image_mask"].bool(), image)
        assert not item["loss_mask"][image].any() and torch.equal(item["loss_mask"], plain["loss_mask"])
        assert torch.equal(item["image_embeds"][image], got.get(MM_EMBEDS, torch.zeros(0, 64)))
        assert not item["image_embeds"][~image].any()
        assert "image_embeds" not in plain
        assert torch.equal(item["positions"], got[POSITION_IDS][:, 0])  # the drafter's: M-RoPE's time stream
    from training.collate import PackCollator

    packed = PackCollator(max_tokens=1024, pad_to_max=False)([vision[0], vision[1]])
    n0 = vision[0]["input_ids"].shape[0]
    assert torch.equal(packed["position_ids"][0, :n0], vision[0]["positions"])
    assert torch.equal(packed["position_ids"][0, n0:n0 + vision[1]["input_ids"].shape[0]], vision[1]["positions"])
    # a run stored without the embeddings trains EAGLE-3 only the placeholder way, said when it opens
    doc = dict(run_json)
    del doc["mm_embeds"]
    with open(os.path.join(output, "run.json"), "w") as f:
        json.dump(doc, f)
    with pytest.raises(ValueError, match="--mm-embeds"):
        HiddenStatesDataset(output)
    assert len(HiddenStatesDataset(output, image_inputs="placeholder")) == len(vision)
    from training.export.exporter import export_run  # ... and exports (it was refused: the exporter's probe read
    # the run with the vision inputs, which the peers' layouts never hold)

    export_run(output, str(tmp_path / "speculators-plain"), "speculators")
    assert len(os.listdir(tmp_path / "speculators-plain" / "hidden_states")) == len(vision)
    with open(os.path.join(output, "run.json"), "w") as f:
        json.dump(run_json, f)

    # hsx verify --recompute: the target's own vision-language class fed the stored image embeddings and M-RoPE
    # positions (it loaded the target with AutoModelForCausalLM: exit 2 with transformers' class list)
    import glob

    import transformers

    from jobs.verify import _forward_inputs, verify_run
    from jobs.verify_config import VerifyConfig

    report = verify_run(VerifyConfig(output=output, all=True, recompute=len(vision)))
    assert report.ok and len(report.recomputed) == len(vision) and not report.not_recomputed, report.lines()
    assert max(max(r["max_rel_diff"].values()) for r in report.recomputed) < 1e-4
    files = [load_hidden_states(p) for p in sorted(glob.glob(os.path.join(output, "data", "*", "*.safetensors")))]
    with_image = next(f for f in files if f[MM_TOKEN_TYPE_IDS].any())
    del with_image[MM_EMBEDS]  # a run stored without --mm-embeds: said, not failed
    model = transformers.AutoModelForImageTextToText.from_pretrained(vl_model)
    assert "without --mm-embeds" in _forward_inputs(model, with_image, "cpu")
    bare = {k: v for k, v in with_image.items() if k not in (MM_TOKEN_TYPE_IDS, POSITION_IDS)}  # as vLLM writes
    assert "no modality mask" in _forward_inputs(model, bare, "cpu")
    text = next(f for f in files if not f[MM_TOKEN_TYPE_IDS].any())
    assert set(_forward_inputs(model, {"token_ids": text["token_ids"]}, "cpu")) == {"input_ids"}

    # the peers' layouts: speculators' files and its Arrow dataset, with the loss off at image tokens
    from safetensors.torch import load_file

    export_run(output, str(tmp_path / "speculators"), "speculators")
    for i in range(len(vision)):
        exported = load_file(str(tmp_path / "speculators" / "hidden_states" / f"hs_{i}.safetensors"))
        item = vision[i]
        assert torch.equal(exported["token_ids"], item["input_ids"])
        assert torch.equal(exported["loss_mask"].long(), item["loss_mask"].long())
    tokens = {t["input_ids"].tolist().__repr__(): t["loss_mask"] for t in vision.token_items()}
    for i in range(len(vision)):
        assert torch.equal(tokens[vision[i]["input_ids"].tolist().__repr__()].long(), vision[i]["loss_mask"].long())

    # EAGLE-3 trained on the run with the vision embeddings, decoding image prompts losslessly in hsx's engine
    from training.train_config import TrainDrafterConfig
    from training_jobs.train import train_drafter

    head = str(tmp_path / "eagle3")
    train_drafter(TrainDrafterConfig(run=output, model=vl_model, out=head, kind="eagle3", steps=3, batch_tokens=256,
                                     device="cpu", progress=False))
    chats = [records[k]["messages"][:1] for k in ("one", "two", "text")]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain_llm = LLM(vl_model, allowed_local_media_path=media)
    spec_llm = LLM(vl_model, allowed_local_media_path=media,
                   speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3})
    want = plain_llm.chat(chats, greedy)
    got = spec_llm.chat(chats, greedy)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    drafts = {m.name: m.value for m in spec_llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts"}
    assert drafts["vllm:spec_decode_num_drafts"] > 0
