"""`hsx serve` on a vision-language target: an image chat request through the real openai client answers with
kv_transfer_params, and its file is the offline engine's for the same messages (states, modality mask, M-RoPE
positions, merged embeddings); bad images get 400 naming them, and the server goes on; an image URL that drips its
bytes holds only its own request (one server for the module)."""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import openai
import pytest
import torch
from PIL import Image, ImageDraw

from connectors import KVTransferConfig, load_hidden_states
from connectors.format import MM_EMBEDS, MM_TOKEN_TYPE_IDS, POSITION_IDS
from corpus.readers import expand_corpus, read_records
from extractor import LLM, SamplingParams
from harness.serving import API_KEY, LAYERS, served
from harness.specs import spec_config
from reference.tiny_models import build_tiny_vl_model
from regeneration.config import RegenerateConfig
from regeneration.regenerate import regenerate
from tests.image_servers import LoopbackServer, drip, png_bytes
from tests.image_servers import image as served_image

FETCH_DEADLINE_S = 8


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    """One `hsx serve` of a tiny VL target for the module: local images under media/, images fetched from localhost
    only, within FETCH_DEADLINE_S."""
    tmp_path = tmp_path_factory.mktemp("vl-serve")
    model = build_tiny_vl_model(str(tmp_path / "vl"))
    media = tmp_path / "media"
    media.mkdir()
    image = Image.new("RGB", (90, 120), "white")
    ImageDraw.Draw(image).rectangle([10, 10, 70, 100], fill="purple")
    image.save(media / "box.png")
    with served(model, str(tmp_path / "out"), str(tmp_path / "serve.log"), replicas=1,
                allowed_local_media_path=str(media), limit_mm_per_prompt='{"image": 2}', mm_embeds=True,
                allow_media_fetch=True, allowed_media_domains="localhost",
                image_fetch_timeout_s=FETCH_DEADLINE_S) as server:
        yield server, model, media


@pytest.mark.ray
@pytest.mark.slow
def test_an_image_chat_request_writes_the_offline_engines_file(vl_server, tmp_path):
    server, model, media = vl_server
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), "orange").save(buf, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is here"},
                                             {"type": "image_url", "image_url": {"url": "box.png"}},
                                             {"type": "image_url", "image_url": {"url": data_url}}]}]
    client = server.client()
    reply = client.chat.completions.create(model=server.model, messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"kv_transfer_params": {}})
    got = load_hidden_states(reply.kv_transfer_params["hidden_states_path"], verify=True)
    for bad, why in [({"url": "missing.png"}, "does not exist"), ({"url": "/etc/hostname"}, "must be inside"),
                     ({"url": "http://127.0.0.1:9/x.png"}, "not in allowed_media_domains"),
                     ("http://127.0.0.1:9/y.png", "not in allowed_media_domains")]:  # the URL alone, as vLLM
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


@pytest.mark.ray
@pytest.mark.slow
def test_a_dripping_image_holds_only_its_own_request_on_a_live_server(vl_server):
    """A chat whose image URL drips its bytes is answered 400 at the fetch deadline; a text chat and an image chat
    from a well-behaved URL sent while it waits are answered meanwhile (issue 63: they timed out behind it)."""
    server, _, _ = vl_server
    client = server.client()
    slow: dict = {}
    with LoopbackServer({"/slow.png": [drip(png_bytes(56, 56), every_s=0.25)],
                         "/ok.png": [served_image(png_bytes(56, 56))]}) as images:

        def slow_request() -> None:
            start = time.monotonic()
            try:
                client.chat.completions.create(model=server.model, max_tokens=1, messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": images.url("/slow.png", host="localhost")}}]}])
            except openai.BadRequestError as e:
                slow["error"] = str(e)
            slow["seconds"] = time.monotonic() - start

        thread = threading.Thread(target=slow_request, daemon=True)
        thread.start()
        waited = time.monotonic()
        while "/slow.png" not in images.hits:  # the slow request is loading its image (or was refused at once)
            assert time.monotonic() - waited < 60 and thread.is_alive() or "/slow.png" in images.hits, slow
            time.sleep(0.05)
        start = time.monotonic()
        text = client.chat.completions.create(model=server.model, max_tokens=1,
                                              messages=[{"role": "user", "content": "hello"}])
        other = client.chat.completions.create(model=server.model, max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": images.url("/ok.png", host="localhost")}]}])
        answered_s = time.monotonic() - start
        assert thread.is_alive(), slow  # still fetching
        thread.join(60)
    assert text.choices and other.choices
    assert answered_s < FETCH_DEADLINE_S / 2, answered_s
    assert f"was not fetched within {FETCH_DEADLINE_S} s" in slow["error"], slow
    assert slow["seconds"] < FETCH_DEADLINE_S + 10, slow
