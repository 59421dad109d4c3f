"""`hsx serve` on a vision-language target: an image chat request through the real openai client answers with
kv_transfer_params, and its file is the offline engine's for the same messages (states, modality mask, M-RoPE
positions, merged embeddings); bad images get 400 naming them, and the server goes on."""

from __future__ import annotations

import base64
import io
import json

import openai
import pytest
import torch
from PIL import Image, ImageDraw

from connectors import KVTransferConfig, load_hidden_states
from connectors.format import MM_EMBEDS, MM_TOKEN_TYPE_IDS, POSITION_IDS
from extractor import LLM, SamplingParams
from jobs.corpus import expand_corpus, read_records
from jobs.regenerate import regenerate
from jobs.regenerate_config import RegenerateConfig
from jobs.tiny_models import build_tiny_vl_model
from tests.extractor.conftest import spec_config
from tests.serving import API_KEY, LAYERS, served


@pytest.mark.ray
@pytest.mark.slow
def test_an_image_chat_request_writes_the_offline_engines_file(tmp_path):
    model = build_tiny_vl_model(str(tmp_path / "vl"))
    media = tmp_path / "media"
    media.mkdir()
    image = Image.new("RGB", (90, 120), "white")
    ImageDraw.Draw(image).rectangle([10, 10, 70, 100], fill="purple")
    image.save(media / "box.png")
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), "orange").save(buf, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is here"},
                                             {"type": "image_url", "image_url": {"url": "box.png"}},
                                             {"type": "image_url", "image_url": {"url": data_url}}]}]
    out = tmp_path / "out"
    with served(model, str(out), str(tmp_path / "serve.log"), replicas=1, allowed_local_media_path=str(media),
                limit_mm_per_prompt='{"image": 2}', mm_embeds=True) as server:
        client = server.client()
        reply = client.chat.completions.create(model=server.model, messages=messages, max_tokens=4, temperature=0,
                                               extra_body={"kv_transfer_params": {}})
        got = load_hidden_states(reply.kv_transfer_params["hidden_states_path"], verify=True)
        for bad, why in [({"url": "missing.png"}, "does not exist"), ({"url": "/etc/hostname"}, "must be inside"),
                         ({"url": "http://127.0.0.1:9/x.png"}, "fetching image URL")]:
            with pytest.raises(openai.BadRequestError, match=why):
                client.chat.completions.create(model=server.model, max_tokens=1, messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": bad}]}])
        with pytest.raises(openai.BadRequestError, match="at most 2 image"):
            client.chat.completions.create(model=server.model, max_tokens=1, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "box.png"}}] * 3}])
        again = client.chat.completions.create(model=server.model, messages=messages, max_tokens=4, temperature=0)
        assert again.choices[0].message.content == reply.choices[0].message.content

        # hsx regenerate sends image parts to the server as they are and keeps them in the regenerated record
        corpus = tmp_path / "corpus.jsonl"
        corpus.write_text(json.dumps({"id": "img", "messages": messages}) + "\n")
        result = regenerate(RegenerateConfig(server=(server.url,), corpus=(str(corpus),), output=str(tmp_path / "re"),
                                             api_key=API_KEY, max_tokens=4, concurrency=1, progress=False))
        assert result.ok == 1, result
        (file,) = expand_corpus([str(tmp_path / "re")])
        (regenerated,) = [json.loads(r.payload) for block in read_records(file) for r in block]

    llm = LLM(model=model, speculative_config=spec_config(LAYERS), allowed_local_media_path=str(media),
              kv_transfer_config=KVTransferConfig(kv_connector_extra_config={
                  "shared_storage_path": str(tmp_path / "offline"), "mm_embeds": True}))
    try:
        (want,) = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0))
        ref = load_hidden_states(want.kv_transfer_params["hidden_states_path"])
    finally:
        llm.shutdown()
    assert reply.choices[0].message.content == want.outputs[0].text
    assert regenerated["messages"][0] == messages[0] and "input_ids" not in regenerated  # images: text kept
    assert regenerated["messages"][1] == {"role": "assistant", "content": want.outputs[0].text}
    assert got["token_ids"].tolist() == ref["token_ids"].tolist()
    assert int(got[MM_TOKEN_TYPE_IDS].sum()) == got[MM_EMBEDS].shape[0] > 0
    for name in (MM_TOKEN_TYPE_IDS, POSITION_IDS):
        assert torch.equal(got[name], ref[name]), name
    torch.testing.assert_close(got["hidden_states"], ref["hidden_states"], rtol=1e-4, atol=5e-5)
    torch.testing.assert_close(got[MM_EMBEDS], ref[MM_EMBEDS], rtol=1e-5, atol=1e-5)
