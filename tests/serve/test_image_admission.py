"""`hsx serve`'s replica admits other requests while one request's image is still loading: an image on a loopback
server that drips its bytes holds only its own request (refused, 400, at the fetch deadline), and a text prompt and
a text chat sent after it are admitted meanwhile. The replica's Engine is built in this process as a replica builds
it, and its admission (Engine._admitted: the image pool, then the admission thread) runs on this event loop; the
batches need Ray Serve and are not run. Also: an image_url part given as a plain string is taken, as vLLM takes
it."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.image_servers import LoopbackServer, drip, image, png_bytes

FETCH_DEADLINE_S = 6.0


@pytest.fixture(scope="module")
def vl_engine(tmp_path_factory):
    from reference.tiny_models import build_tiny_vl_model
    from serve.config import ServeConfig
    from serve.engine import Engine

    model = build_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")))
    out = tmp_path_factory.mktemp("engine-out")
    engine = Engine(ServeConfig(model=model, output=str(out), layers=(1, 2, 4), device="cpu", api_key="k",
                                allow_media_fetch=True, image_fetch_timeout_s=FETCH_DEADLINE_S))
    yield engine
    engine.llm.shutdown()


def _image_chat(rid: str, part) -> object:
    from serve.engine import PromptRequest

    return PromptRequest(rid, messages=[{"role": "user", "content": [part, {"type": "text", "text": "what is it"}]}],
                         max_tokens=1)


def test_a_dripping_image_holds_only_its_own_request(vl_engine):
    from serve.engine import EngineReply, PromptRequest

    async def scenario(server: LoopbackServer):
        slow = asyncio.ensure_future(vl_engine._admitted(_image_chat(
            "slow", {"type": "image_url", "image_url": {"url": server.url("/slow.png")}})))
        while "/slow.png" not in server.hits:  # the slow request is loading its image
            await asyncio.sleep(0.05)
        start = time.monotonic()
        text = await vl_engine._admitted(PromptRequest("text", prompt="hello there", max_tokens=1))
        chat = await vl_engine._admitted(PromptRequest("chat", messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=1))
        admitted_s = time.monotonic() - start
        assert not slow.done()  # still loading its image
        return text, chat, admitted_s, await slow, time.monotonic() - start

    with LoopbackServer({"/slow.png": [drip(png_bytes(56, 56), every_s=0.25)]}) as server:
        text, chat, admitted_s, slow, slow_s = asyncio.run(asyncio.wait_for(scenario(server), 60))
    assert not isinstance(text, EngineReply) and not isinstance(chat, EngineReply), (text, chat)
    assert text.prompt_token_ids and chat.prompt_token_ids
    assert admitted_s < FETCH_DEADLINE_S / 2, admitted_s
    assert isinstance(slow, EngineReply)
    assert slow.status == 400 and slow.code == "invalid_image", slow
    assert "was not fetched within 6 s" in slow.message and "\n" not in slow.message
    assert slow_s < FETCH_DEADLINE_S + 3, slow_s


def test_a_request_whose_client_left_keeps_its_image_slot_until_its_load_ends(vl_engine):
    """A cancelled request's images are still being fetched on the pool: its slot is given back when that work
    ends, not when the client leaves (four clients opening and dropping dripping requests would otherwise let any
    number of loads pile up), and every slot comes back."""
    from serve.engine import IMAGE_LOADERS

    async def scenario(server: LoopbackServer):
        gone = [asyncio.ensure_future(vl_engine._admitted(_image_chat(
            f"gone{i}", {"type": "image_url", "image_url": {"url": server.url(f"/slow{i}.png")}})))
            for i in range(IMAGE_LOADERS)]
        while sum(h.startswith("/slow") for h in server.hits) < IMAGE_LOADERS:
            await asyncio.sleep(0.05)
        for task in gone:
            task.cancel()
        await asyncio.sleep(0.3)
        held = vl_engine._image_slots.locked()
        waited = time.monotonic()
        while vl_engine._image_slots.locked() and time.monotonic() - waited < 3 * FETCH_DEADLINE_S:
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.2)  # the last release is scheduled from the pool thread
        return held, vl_engine._image_slots._value

    pages = {f"/slow{i}.png": [drip(png_bytes(56, 56), every_s=0.25)] for i in range(IMAGE_LOADERS)}
    with LoopbackServer(pages) as server:
        held, free = asyncio.run(asyncio.wait_for(scenario(server), 60))
    assert held, "a slot was given back while its images were still loading"
    assert free == IMAGE_LOADERS


def test_each_image_of_a_request_is_decoded_and_converted_once(vl_engine, monkeypatch):
    """The replica loads a request's images on its image pool, and its admission thread processes those very images:
    per image, PIL decodes the file once and makes as many RGB copies (Image.convert, counted by a wrapper that calls
    PIL's own) as the offline engine's prepare_media on the same URLs, which loads each image once. Before, the
    admission thread loaded the pool's images again: one more full-size copy of each, twice the memory bound."""
    from PIL import Image, ImageFile

    from serve.engine import PromptRequest

    sizes = ((57, 43), (61, 47))
    seen: list[tuple[str, tuple[int, int]]] = []
    convert, load = Image.Image.convert, ImageFile.ImageFile.load

    def counted_convert(self, *args, **kwargs):
        seen.append(("convert", self.size))
        return convert(self, *args, **kwargs)

    def counted_load(self):
        if self.tile:  # not decoded yet: this call runs the decoder
            seen.append(("decode", self.size))
        return load(self)

    monkeypatch.setattr(Image.Image, "convert", counted_convert)
    monkeypatch.setattr(ImageFile.ImageFile, "load", counted_load)
    pages = {f"/{w}x{h}.png": [image(png_bytes(w, h))] for w, h in sizes}
    with LoopbackServer(pages) as server:
        parts = [{"type": "image_url", "image_url": {"url": server.url(path)}} for path in pages]
        request = PromptRequest("two", messages=[{"role": "user", "content": [*parts, {"type": "text",
                                                                                       "text": "what"}]}],
                                max_tokens=1)
        item = asyncio.run(vl_engine._admitted(request))
        served, seen[:] = list(seen), []
        offline = vl_engine.llm.prepare_media(item.prompt_text, {"image": [server.url(path) for path in pages]})
    assert item.media is not None and item.media.image_features.equal(offline.image_features), item
    for size in sizes:
        assert served.count(("decode", size)) == 1, served
        assert served.count(("convert", size)) == seen.count(("convert", size)), (served, seen)


def test_an_image_url_part_may_be_a_plain_string(vl_engine):
    from serve.protocol import ChatBody

    body = ChatBody.model_validate({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": "http://127.0.0.1:9/a.png"}, {"type": "text", "text": "what"}]}]})
    assert body.messages[0].has_images
    with LoopbackServer({"/a.png": [image(png_bytes(56, 56))]}) as server:
        plain = asyncio.run(vl_engine._admitted(_image_chat("plain", {"type": "image_url",
                                                                      "image_url": server.url("/a.png")})))
        wrapped = asyncio.run(vl_engine._admitted(_image_chat("wrapped", {"type": "image_url",
                                                                          "image_url": {"url": server.url("/a.png")}})))
    assert plain.media is not None and wrapped.media is not None, (plain, wrapped)
    assert plain.prompt_token_ids == wrapped.prompt_token_ids
    assert plain.media.image_features.equal(wrapped.media.image_features)
