"""Image prompts on a vision-language target (a tiny Qwen2.5-VL built here): the stored states, token ids, modality
mask and M-RoPE positions against transformers' own forward of inputs prepared without hsx (the PIL image processor,
the placeholders expanded by hand, the model's own get_rope_index); greedy decoding against transformers' generate;
every bad image its own request's failure."""

from __future__ import annotations

import base64
import io
import os

import pytest
import torch
from PIL import Image, ImageDraw

from connectors import KVTransferConfig
from connectors.format import MM_EMBEDS, MM_TOKEN_TYPE_IDS, POSITION_IDS, HiddenStatesFileError
from connectors.reader import load_hidden_states, read_hidden_states_info
from extractor import LLM, SamplingParams
from extractor.config import EngineConfig
from extractor.media import MediaPolicy, load_image
from extractor.multimodal import check_supported
from reference.tiny_models import build_tiny_model, build_tiny_vl_model

LAYERS = [0, 1, 2, 3, 4]
PAD = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vl_model(request, tmp_path_factory):
    """A tiny Qwen2.5-VL, and a tiny Qwen3-VL (deepstack: visual features added to decoder layers 0 and 1)."""
    return build_tiny_vl_model(str(tmp_path_factory.mktemp(f"tiny_{request.param}")), family=request.param)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """A folder of small drawn images (sizes chosen so the processor resizes them to different grids)."""
    folder = tmp_path_factory.mktemp("images")
    for name, (w, h, colour) in {"red.png": (112, 84, "red"), "blue.png": (60, 150, "blue"),
                                 "green.jpg": (200, 200, "green")}.items():
        image = Image.new("RGB", (w, h), "white")
        ImageDraw.Draw(image).ellipse([4, 4, w - 4, h - 4], fill=colour)
        image.save(folder / name)
    (folder / "notes.png").write_text("this is not an image")
    return str(folder)


@pytest.fixture(scope="module")
def reference(vl_model):
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = AutoModelForImageTextToText.from_pretrained(vl_model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(vl_model), Qwen2VLImageProcessorPil.from_pretrained(vl_model)


def _engine(vl_model, out, images, **kw):
    extra = {"shared_storage_path": str(out), **kw.pop("extra", {})}
    return LLM(vl_model, kv_transfer_config=KVTransferConfig(kv_connector="ExampleHiddenStatesConnector",
                                                             kv_role="kv_producer", kv_connector_extra_config=extra),
               speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}}},
               allowed_local_media_path=images, **kw)


def _oracle_inputs(reference, text: str, paths: list[str]) -> dict:
    """The model's inputs built without hsx: the image processor, each placeholder expanded to its grid's count of
    merged patches, the tokenizer, image tokens marked 1."""
    model, tokenizer, image_processor = reference
    inputs = {}
    if paths:
        pixels = image_processor([Image.open(p).convert("RGB") for p in paths], return_tensors="pt")
        inputs = {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]}
        merge = image_processor.merge_size ** 2
        pieces = text.split("<|image_pad|>")
        assert len(pieces) == len(paths) + 1
        text = pieces[0] + "".join("<|image_pad|>" * int(g.prod() // merge) + rest
                                   for g, rest in zip(pixels["image_grid_thw"], pieces[1:]))
    ids = torch.tensor(tokenizer(text)["input_ids"])[None]
    types = (ids == model.config.image_token_id).to(torch.int64)
    return {"input_ids": ids, "mm_token_type_ids": types, **inputs}


def _oracle_states(reference, inputs: dict) -> torch.Tensor:
    """[T, L, H] for LAYERS: HF's hidden_states 0..N-1 and the last decoder layer's output before the final norm;
    for a deepstack target (Qwen3-VL), layer k's output after its deepstack add at image tokens (k = 1..deepstack
    layers), written out from the vision tower's deepstack features: what vLLM 0.32 hands its proposer."""
    model = reference[0]
    deep = []
    if "pixel_values" in inputs:
        with torch.no_grad():
            encoded = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
        deep = [torch.cat(list(d)) for d in getattr(encoded, "deepstack_features", None) or ()]
    captured = {}
    handle = model.model.language_model.layers[-1].register_forward_hook(
        lambda module, args, output: captured.setdefault("last", output[0] if isinstance(output, tuple) else output))
    try:
        with torch.no_grad():
            hidden = model(**inputs, output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    states = [h[0].clone() for h in hidden[:-1]] + [captured["last"][0]]
    image = inputs["mm_token_type_ids"][0].bool()
    for k in range(1, len(deep) + 1):
        states[k][image] += deep[k - 1]
    return torch.stack([states[k] for k in LAYERS], dim=1)


def _chat(text: str, refs: list[str]) -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": r}} for r in refs] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize("budget", [8192, 16])
def test_states_positions_and_mask_equal_transformers(vl_model, images, reference, tmp_path, budget):
    """Chat and generate prompts with 0, 1 and 2 images in one batch; budget 16 prefills in chunks that cut through
    image blocks. Every file: token ids, states at every position (image ones included), the modality mask and the
    M-RoPE positions equal transformers' forward of the same inputs built without hsx."""
    llm = _engine(vl_model, tmp_path, images, max_num_batched_tokens=budget, extra={"mm_embeds": True})
    model = reference[0]
    chats = [_chat("what is this", ["red.png"]), [{"role": "user", "content": "a text only prompt here"}],
             _chat("compare the two", [f"file://{images}/blue.png", "green.jpg"])]
    outs = llm.chat(chats, SamplingParams(max_tokens=0))
    raw = f"{PAD}describe it{PAD}"
    outs += llm.generate([{"prompt": raw, "multi_modal_data": {"image": [Image.open(f"{images}/green.jpg"),
                                                                          f"{images}/red.png"]}}])
    expected_paths = [["red.png"], [], ["blue.png", "green.jpg"], ["green.jpg", "red.png"]]
    for out, paths in zip(outs, expected_paths):
        assert out.ok, out.error
        inputs = _oracle_inputs(reference, out.prompt, [os.path.join(images, p) for p in paths])
        stored = load_hidden_states(out.kv_transfer_params["hidden_states_path"], verify=True)
        assert stored["token_ids"].tolist() == inputs["input_ids"][0].tolist() == out.prompt_token_ids
        torch.testing.assert_close(stored["hidden_states"], _oracle_states(reference, inputs), rtol=1e-4, atol=1e-4)
        assert torch.equal(stored[MM_TOKEN_TYPE_IDS], inputs["mm_token_type_ids"][0].to(torch.uint8))
        positions, _ = model.model.get_rope_index(inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                                                  image_grid_thw=inputs.get("image_grid_thw"))
        assert torch.equal(stored[POSITION_IDS], positions[:, 0].T)
        if paths:
            with torch.no_grad():
                features = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"],
                                                          return_dict=True).pooler_output
            torch.testing.assert_close(stored[MM_EMBEDS], torch.cat(list(features)), rtol=1e-5, atol=1e-5)
            assert int(stored[MM_TOKEN_TYPE_IDS].sum()) == stored[MM_EMBEDS].shape[0] > 0
            assert not torch.equal(stored[POSITION_IDS][:, 0], torch.arange(len(out.prompt_token_ids)))
        else:
            assert MM_EMBEDS not in stored
    llm.shutdown()


def test_greedy_decoding_equals_transformers_generate(vl_model, images, reference, tmp_path):
    """Image prompts decode (batched, prefilled in chunks) exactly as transformers' generate; with output tokens in
    the file, their positions continue every M-RoPE stream from the prompt's largest + 1, their mask is text."""
    model = reference[0]
    llm = _engine(vl_model, tmp_path, images, max_num_batched_tokens=16)
    chats = [_chat("what is this", ["red.png"]), _chat("two", ["blue.png", "green.jpg"]),
             [{"role": "user", "content": "only text"}]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                            extra_args={"kv_transfer_params": {"include_output_tokens": True}})
    outs = llm.chat(chats, params)
    for out, paths in zip(outs, [["red.png"], ["blue.png", "green.jpg"], []]):
        assert out.ok, out.error
        inputs = _oracle_inputs(reference, out.prompt, [os.path.join(images, p) for p in paths])
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert out.outputs[0].token_ids == ids[0, inputs["input_ids"].shape[1]:].tolist()
        stored = load_hidden_states(out.kv_transfer_params["hidden_states_path"])
        n = len(out.prompt_token_ids)
        positions = stored[POSITION_IDS]
        assert positions.shape == (n + 10 - 1, 3)  # the last generated token is never fed back: no state
        after = positions[:n].max() + 1
        assert positions[n:].tolist() == [[int(after) + i] * 3 for i in range(10 - 1)]
        assert stored[MM_TOKEN_TYPE_IDS][n:].eq(0).all()
    llm.shutdown()


def test_the_processor_tokenizes_with_the_tokenizer_the_engine_was_given(vl_model, images, tmp_path):
    """LLM(tokenizer=...) as vLLM: the image processor's text side is that tokenizer, not the model folder's (it
    ignored it for image prompts)."""
    import shutil

    given = tmp_path / "tokenizer"
    given.mkdir()
    for name in os.listdir(vl_model):
        if name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges", "added_tokens")):
            shutil.copy(os.path.join(vl_model, name), given / name)
    llm = _engine(vl_model, tmp_path / "out", images, tokenizer=str(given))
    assert llm.runner.vision.processor.tokenizer is llm.tokenizer
    assert os.path.realpath(llm.tokenizer.name_or_path) == os.path.realpath(given)
    out = llm.chat([_chat("what is this", ["red.png"])], SamplingParams(max_tokens=2, temperature=0))[0]
    assert out.ok, out.error
    llm.shutdown()
    plain = _engine(vl_model, tmp_path / "out2", images)  # no tokenizer given: the folder's, in both
    assert os.path.realpath(plain.runner.vision.processor.tokenizer.name_or_path) == os.path.realpath(vl_model)
    plain.shutdown()


def test_each_bad_image_fails_its_own_request(vl_model, images, tmp_path, tmp_path_factory):
    """Missing file, not an image, outside allowed_local_media_path (a path, ../, a symlink), more images than
    limit_mm_per_prompt, a URL that may not be fetched, a broken data: URL, an image over the pixel limit, a
    placeholder count that does not match: each its own failed request with one line; the good ones are written."""
    outside = tmp_path_factory.mktemp("outside")
    Image.new("RGB", (64, 64), "red").save(outside / "secret.png")
    if not os.path.lexists(os.path.join(images, "link.png")):  # the images folder serves both targets
        os.symlink(outside / "secret.png", os.path.join(images, "link.png"))
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), "blue").save(buf, format="PNG")
    good_data = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    config = EngineConfig(model=vl_model, layer_ids=tuple(LAYERS), max_model_len=96,
                          media=MediaPolicy({"image": 2}, images, max_image_bytes=150 * 150 * 3))
    llm = LLM.from_config(config, KVTransferConfig(kv_connector_extra_config={"shared_storage_path": str(tmp_path)}))
    cases = {
        "ok": ("red.png", None),
        "missing": ("nowhere.png", "does not exist"),
        "not_image": ("notes.png", "not an image"),
        "outside": (str(outside / "secret.png"), "must be inside allowed_local_media_path"),
        "dotdot": ("../" + os.path.basename(outside) + "/secret.png", "must be inside allowed_local_media_path"),
        "symlink": ("link.png", "must be inside allowed_local_media_path"),
        "http": ("http://127.0.0.1:9/x.png", "fetching image URL"),
        "bad_data": ("data:image/png;base64,@@@", "does not decode"),
        "too_big": ("green.jpg", "over the limit"),
        "data_ok": (good_data, None),
        "scheme": ("ftp://host/x.png", "scheme 'ftp'"),
    }
    prompts = [{"prompt": f"{PAD}look", "multi_modal_data": {"image": ref}} for ref, _ in cases.values()]
    prompts.append({"prompt": f"{PAD}{PAD}{PAD}three", "multi_modal_data": {"image": ["red.png"] * 3}})
    prompts.append({"prompt": "no placeholder", "multi_modal_data": {"image": "red.png"}})
    prompts.append({"prompt": PAD, "multi_modal_data": {"video": "clip.mp4"}})
    prompts.append({"prompt": "<|image_pad|><|image_pad|>", "multi_modal_data": {"image": ["red.png", "blue.png"]}})
    prompts.append({"prompt": f"{PAD} a bare placeholder with no image"})
    prompts.append({"prompt": f"{PAD}{PAD} too long", "multi_modal_data": {"image": ["blue.png", "blue.png"]},
                    "max": True})
    expected = [why for _, why in cases.values()] + ["at most 2 image(s)", "0 image placeholder(s)",
                                                      "hsx takes images", "not separated", "but no image",
                                                      "more than the limit"]
    for p in prompts:  # a prompt that its images make longer than the engine's limit
        if p.pop("max", False):
            p["prompt"] += " and more" * 40
    outs = llm.generate(prompts)
    for out, why, prompt in zip(outs, expected, prompts):
        if why is None:
            assert out.ok, out.error
            assert os.path.exists(out.kv_transfer_params["hidden_states_path"])
        else:
            assert not out.ok and out.error_kind == "invalid", (prompt, out.error)
            assert why in out.error and "\n" not in out.error, out.error
    llm.shutdown()


def test_text_only_target_refuses_images(tmp_path):
    model = build_tiny_model("llama", str(tmp_path / "llama"))
    llm = LLM(model, kv_transfer_config=KVTransferConfig(kv_connector_extra_config={
        "shared_storage_path": str(tmp_path / "out")}))
    outs = llm.generate([{"prompt": "hi", "multi_modal_data": {"image": "x.png"}}, "plain text"])
    assert not outs[0].ok and "text-only target" in outs[0].error
    assert outs[1].ok
    with pytest.raises(ValueError, match="text-only model"):
        llm.chat(_chat("what", ["x.png"]))
    llm.shutdown()


def test_unchecked_vl_families_are_refused():
    from transformers import LlavaConfig, Qwen3VLMoeConfig

    with pytest.raises(ValueError, match="not been checked"):
        check_supported(Qwen3VLMoeConfig(), "some/qwen3-vl-moe")
    with pytest.raises(ValueError, match="does not run"):
        check_supported(LlavaConfig(), "some/llava")


def test_load_image_policy(images, tmp_path):
    policy = MediaPolicy(allowed_local_media_path=images)
    assert load_image("red.png", policy, "x").size == (112, 84)
    assert load_image(f"file://{images}/red.png", policy, "x").mode == "RGB"
    with pytest.raises(ValueError, match="without allowed_local_media_path"):
        load_image(f"{images}/red.png", MediaPolicy(), "image 0")
    with pytest.raises(ValueError, match="cannot be fetched"):  # fetching allowed, nothing listens there
        load_image("http://127.0.0.1:9/x.png", MediaPolicy(allow_fetch=True), "image 0")
    with pytest.raises(ValueError, match="is not an existing folder"):
        MediaPolicy(allowed_local_media_path=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="count >= 0"):
        MediaPolicy({"image": -1})
    assert MediaPolicy({"image": {"count": 3}}).limit("image") == 3
    assert MediaPolicy().limit("image") == 999


def test_images_load_as_vllm_loads_them(tmp_path):
    """EXIF orientation applied, transparency laid on white, EPS never opened, only regular files under a cap."""
    from PIL import Image

    policy = MediaPolicy(allowed_local_media_path=str(tmp_path))
    rotated = Image.new("RGB", (40, 20), "red")
    exif = rotated.getexif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees to display
    rotated.save(tmp_path / "rotated.jpg", exif=exif)
    assert load_image("rotated.jpg", policy, "x").size == (20, 40)
    clear = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    clear.save(tmp_path / "clear.png")
    assert load_image("clear.png", policy, "x").getpixel((0, 0)) == (255, 255, 255)
    (tmp_path / "page.eps").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n")
    with pytest.raises(ValueError, match="not an image PIL can read"):
        load_image("page.eps", policy, "x")
    os.mkfifo(tmp_path / "pipe.png")
    with pytest.raises(ValueError, match="not a regular file"):
        load_image("pipe.png", policy, "x")
    with open(tmp_path / "huge.png", "wb") as f:
        f.truncate((64 << 20) + 1)
    with pytest.raises(ValueError, match="over the limit"):
        load_image("huge.png", policy, "x")


def test_header_refuses_misshapen_multimodal_tensors(tmp_path):
    from safetensors.torch import save_file

    base = {"token_ids": torch.arange(4), "hidden_states": torch.ones(4, 2, 8)}
    types = {MM_TOKEN_TYPE_IDS: torch.zeros(4, dtype=torch.uint8)}
    for bad, match in [({**types, POSITION_IDS: torch.zeros(3, 3, dtype=torch.int64)}, "position_ids"),
                       ({MM_TOKEN_TYPE_IDS: torch.zeros(5, dtype=torch.uint8)}, "mm_token_type_ids"),
                       ({MM_EMBEDS: torch.zeros(2, 8)}, "mm_embeds")]:
        path = str(tmp_path / "bad.safetensors")
        save_file({**base, **bad}, path)
        with pytest.raises(HiddenStatesFileError, match=match):
            read_hidden_states_info(path)
