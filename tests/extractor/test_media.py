"""extractor.media against hostile images and servers: real loopback HTTP servers (a dripping one, redirects to
other ports and schemes, flaky ones), a decompression bomb, oversized data: URLs, and local folders whose entries
are swapped for FIFOs and symlinks while images load. Every refusal is one line naming the image."""

from __future__ import annotations

import base64
import io
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from PIL import Image

from extractor.media import MAX_DATA_URL_CHARS, ImageUnavailable, MediaPolicy, load_image, load_images
from tests.image_servers import (
    ListeningSocket,
    LoopbackServer,
    drip,
    encoded,
    hang_up,
    image,
    png_bytes,
    redirect,
    self_signed_cert,
    status,
)

PNG = png_bytes(16, 12)


def _fetching(**kw) -> MediaPolicy:
    return MediaPolicy(allow_fetch=True, **kw)


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


# -- 1. the deadline ------------------------------------------------------------------------------------------------
def test_a_dripping_server_is_cut_off_at_the_fetch_deadline():
    with LoopbackServer({"/slow.png": [drip(PNG, every_s=0.2)]}) as server:
        start = time.monotonic()
        with pytest.raises(ImageUnavailable) as e:
            load_image(server.url("/slow.png"), _fetching(image_fetch_timeout_s=1.0), "image 0")
        took = time.monotonic() - start
    assert 0.9 < took < 4, took
    text = _one_line(e)
    assert text.startswith("image 0:") and server.url("/slow.png") in text and "within 1 s" in text, text


def test_a_name_server_that_does_not_answer_is_cut_off_at_the_fetch_deadline(monkeypatch):
    """aiohttp resolves host names in its loop's executor, which asyncio.run waits for at its end: a 5 s lookup held
    a 1 s fetch for 6 s. The slow name server is a getaddrinfo that sleeps before answering."""
    real = socket.getaddrinfo

    def slow(host, *args, **kwargs):
        if host == "slow-name.test":
            time.sleep(5)
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    start = time.monotonic()
    with pytest.raises(ImageUnavailable, match="was not fetched within 1 s"):
        load_image("http://slow-name.test:9/x.png", _fetching(image_fetch_timeout_s=1.0), "image 0")
    assert time.monotonic() - start < 3


def test_the_fetch_deadline_comes_from_vllms_environment_variable(monkeypatch):
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "7")
    assert MediaPolicy().image_fetch_timeout_s == 7.0
    assert MediaPolicy(image_fetch_timeout_s=2).image_fetch_timeout_s == 2.0  # the setting wins
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="VLLM_IMAGE_FETCH_TIMEOUT must be a number"):
        MediaPolicy()
    monkeypatch.delenv("VLLM_IMAGE_FETCH_TIMEOUT")
    assert MediaPolicy().image_fetch_timeout_s == 30.0


# -- 2, 3. redirects and allowed hosts ----------------------------------------------------------------------------
def test_a_redirect_is_not_followed_without_allowed_media_domains():
    with LoopbackServer({"/internal-secret": [image(PNG)]}) as inner, \
            LoopbackServer({"/a.png": [redirect(inner.url("/internal-secret"))]}) as outer:
        with pytest.raises(ValueError, match="not followed") as e:
            load_image(outer.url("/a.png"), _fetching(), "image 0")
        assert inner.hits == [] and outer.hits == ["/a.png"]
    assert "internal-secret" not in _one_line(e)


def test_a_redirect_to_another_scheme_opens_no_connection():
    listener = ListeningSocket()
    try:
        with LoopbackServer({"/a.png": [redirect(f"ftp://127.0.0.1:{listener.port}/x.png")]}) as server:
            with pytest.raises(ValueError, match="not an http.s. host in allowed_media_domains") as e:
                load_image(server.url("/a.png"), _fetching(allowed_media_domains=["127.0.0.1"]), "image 0")
        assert listener.connections() == 0
        socket.create_connection(("127.0.0.1", listener.port)).close()  # the count can see one
        assert listener.connections() == 1
    finally:
        listener.close()
    assert "ftp://127.0.0.1" in _one_line(e)


def test_redirects_are_followed_only_to_allowed_hosts():
    with LoopbackServer({"/real.png": [image(PNG)]}) as target, LoopbackServer({
            "/to-ip.png": [redirect(target.url("/real.png"))],
            "/to-name.png": [redirect(target.url("/real.png", host="localhost"))],
            "/relative.png": [redirect("/real.png")], "/real.png": [image(PNG)],
            "/loop.png": [redirect("/loop.png")]}) as server:
        policy = _fetching(allowed_media_domains=["LOCALHOST"])
        with pytest.raises(ValueError, match="a redirect to http://127.0.0.1, which is not an http.s. host"):
            load_image(server.url("/to-ip.png", host="localhost"), policy, "image 0")
        assert target.hits == []
        assert load_image(server.url("/to-name.png", host="localhost"), policy, "image 0").size == (16, 12)
        assert target.hits == ["/real.png"]
        assert load_image(server.url("/relative.png", host="localhost"), policy, "image 0").size == (16, 12)
        with pytest.raises(ValueError, match="redirects more than 5 times"):
            load_image(server.url("/loop.png", host="localhost"), policy, "image 0")


def test_only_hosts_in_allowed_media_domains_are_fetched():
    with LoopbackServer({"/a.png": [image(PNG)]}) as server:
        with pytest.raises(ValueError, match="host '127.0.0.1', which is not in allowed_media_domains") as e:
            load_image(server.url("/a.png"), _fetching(allowed_media_domains="localhost, img.example"), "image 3")
        assert server.hits == []
        assert _one_line(e).startswith("image 3:")
        assert load_image(server.url("/a.png", host="localhost"), _fetching(allowed_media_domains=("localhost",)),
                          "image 0").size == (16, 12)


def test_fetch_errors_say_no_more_than_cannot_be_fetched():
    listener = ListeningSocket()
    port = listener.port
    listener.close()  # nothing listens there now
    with LoopbackServer({}) as server:
        with pytest.raises(ValueError) as missing:
            load_image(server.url("/nothing.png"), _fetching(), "image 0")
    with pytest.raises(ValueError) as refused:
        load_image(f"http://127.0.0.1:{port}/x.png", _fetching(), "image 1")
    assert _one_line(missing).endswith("cannot be fetched (HTTP 404)")
    assert "cannot be fetched (connection failed; 3 tries)" in _one_line(refused)
    assert "refused" not in str(refused.value).lower() and "errno" not in str(refused.value).lower()


# -- 8. transient failures are tried again ----------------------------------------------------------------------
def test_a_transient_failure_is_tried_again_and_a_lasting_one_is_marked_unavailable():
    with LoopbackServer({"/flaky.png": [status(503), hang_up(), image(PNG)], "/busy.png": [status(429)],
                         "/gone.png": [status(410)]}) as server:
        assert load_image(server.url("/flaky.png"), _fetching(), "image 0").size == (16, 12)
        assert server.hits.count("/flaky.png") == 3
        with pytest.raises(ImageUnavailable, match=r"cannot be fetched \(HTTP 429; 3 tries\)"):
            load_image(server.url("/busy.png"), _fetching(), "image 0")
        with pytest.raises(ValueError) as gone:  # a 410 is the same every time: not tried again
            load_image(server.url("/gone.png"), _fetching(), "image 0")
        assert not isinstance(gone.value, ImageUnavailable) and server.hits.count("/gone.png") == 1


def test_a_certificate_that_fails_verification_is_refused_at_once_naming_the_host(tmp_path):
    """A loopback https server with a self-signed certificate: the same answer every time, so one try, a plain
    ValueError (a job records it as settled, retry=false), one line naming the host and the certificate. The server
    itself works: a client that trusts the certificate gets the image."""
    import ssl
    import urllib.request

    cert, key = self_signed_cert(str(tmp_path))
    with LoopbackServer({"/a.png": [image(PNG)]}, tls=(cert, key)) as server:
        trusting = ssl.create_default_context(cafile=cert)
        with urllib.request.urlopen(server.url("/a.png"), context=trusting, timeout=10) as r:
            assert r.read() == PNG
        before = server.connections
        with pytest.raises(ValueError) as e:
            load_image(server.url("/a.png"), _fetching(image_fetch_timeout_s=20), "image 0")
        tries = server.connections - before
    assert not isinstance(e.value, ImageUnavailable)
    assert tries == 1, tries
    text = _one_line(e)
    assert text.startswith("image 0:") and "host '127.0.0.1'" in text and "certificate" in text, text
    assert "failed verification" in text and "self-signed" in text and "SSL_CERT_FILE" in text, text


def _gzip_of_zeros(n: int) -> bytes:
    """gzip of n zero bytes, made without holding them (about n / 1000 bytes)."""
    import zlib

    packer, out, block = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS), [], bytes(1 << 20)
    for _ in range(n >> 20):
        out.append(packer.compress(block))
    return b"".join([*out, packer.flush()])


def test_a_gzip_bomb_is_refused_once_it_inflates_past_the_bound_without_holding_it():
    """A body of 65 KB on the wire that inflates to 64 MiB (Content-Encoding: gzip), fetched with a 1 MiB bound: it
    is inflated by hsx within the bound (aiohttp's own decoding is off: before aiohttp 3.13.3 it inflated whole
    network chunks at once, 141 MiB at the peak here) and refused once past it, the fetch's Python allocations at
    their peak a few times the bound, not the body's 64 MiB."""
    import tracemalloc

    from extractor.image_fetch import fetch_image

    bomb = _gzip_of_zeros(64 << 20)
    assert len(bomb) < 100_000
    with LoopbackServer({"/bomb.png": [encoded(bomb)], "/a.png": [image(PNG)]}) as server:
        fetch_image(server.url("/a.png"), "image 0", domains=None, timeout_s=20, cap=1 << 20)  # aiohttp imported
        tracemalloc.start()
        try:
            with pytest.raises(ValueError) as e:
                fetch_image(server.url("/bomb.png"), "image 0", domains=None, timeout_s=20, cap=1 << 20)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert not isinstance(e.value, ImageUnavailable)  # the same body every time
    assert _one_line(e).endswith("is larger than 1 MiB once its Content-Encoding gzip is decoded"), str(e.value)
    assert peak < 4 << 20, f"{peak / (1 << 20):.1f} MiB"


def test_compressed_images_are_decoded_and_an_unknown_encoding_is_refused():
    import gzip
    import zlib

    with LoopbackServer({"/g.png": [encoded(gzip.compress(PNG))], "/z.png": [encoded(zlib.compress(PNG), "deflate")],
                         "/twice.png": [encoded(gzip.compress(PNG[:40]) + gzip.compress(PNG[40:]))],
                         "/br.png": [encoded(b"\x0b\x02\x80hello\x03", "br")],
                         "/cut.png": [encoded(gzip.compress(PNG)[:-12])]}) as server:
        for path in ("/g.png", "/z.png", "/twice.png"):  # gzip, zlib-wrapped deflate, two gzip members
            assert load_image(server.url(path), _fetching(), "image 0").size == (16, 12), path
        with pytest.raises(ValueError) as br:
            load_image(server.url("/br.png"), _fetching(), "image 1")
        with pytest.raises(ValueError) as cut:
            load_image(server.url("/cut.png"), _fetching(), "image 2")
    assert _one_line(br).startswith("image 1:") and "Content-Encoding 'br'" in str(br.value), str(br.value)
    assert _one_line(cut).startswith("image 2:") and "gzip" in str(cut.value), str(cut.value)


# -- 4. decoded size --------------------------------------------------------------------------------------------
def test_a_decompression_bomb_png_is_refused_before_it_is_decoded(tmp_path):
    """A 9000x9000 1-bit PNG is about 28 KB and 243 MB as RGB. It is refused from its header: a fresh process's peak
    memory does not move while it is refused (decoding it alone would add 81 MB)."""
    bomb = png_bytes(9000, 9000, mode="1")
    assert len(bomb) < 64_000
    (tmp_path / "bomb.png").write_bytes(bomb)
    small = MediaPolicy(allowed_local_media_path=str(tmp_path), max_image_bytes=48 << 20)
    with pytest.raises(ValueError, match="9000x9000, 231.7 MiB decoded .RGB., over the limit of 48.0 MiB per "
                                         "image .max_image_bytes.") as e:
        load_image("bomb.png", small, "image 0")
    _one_line(e)
    # by default one such image loads (PIL's own bound), three in one prompt do not: refused before the third decodes
    with pytest.raises(ValueError, match=r"come to 695.2 MiB decoded \(RGB\) by image 2 \(9000x9000\), over the limit "
                                         r"of 512.0 MiB per prompt") as e:
        load_images(["bomb.png"] * 3, MediaPolicy(allowed_local_media_path=str(tmp_path)))
    script = (
        "import resource, sys\n"
        "from extractor.media import MediaPolicy, load_image\n"
        "import PIL.PngImagePlugin\n"
        "load_image('small.png', MediaPolicy(allowed_local_media_path=sys.argv[1]), 'warm-up')\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    load_image('bomb.png', MediaPolicy(allowed_local_media_path=sys.argv[1], max_image_bytes=48 << 20), "
        "'image 0')\n"
        "except ValueError:\n"
        "    pass\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n")
    (tmp_path / "small.png").write_bytes(PNG)
    grown_mb = int(subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                                  check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                                  timeout=120).stdout.split()[-1])
    assert grown_mb < 20, grown_mb


def test_a_prompts_images_together_are_bounded_before_each_is_decoded():
    images = [Image.new("RGB", (100, 100), c) for c in ("red", "green", "blue")]  # 30,000 bytes each as RGB
    policy = MediaPolicy(max_request_image_bytes=70_000)
    assert len(load_images(images[:2], policy)) == 2
    with pytest.raises(ValueError, match=r"the prompt's images come to 0.1 MiB decoded \(RGB\) by image 2 \(100x100\), "
                                         r"over the limit of 0.1 MiB per prompt \(max_request_image_bytes\)") as e:
        load_images(images, policy)
    _one_line(e)
    with pytest.raises(ValueError, match="at most 2 image"):
        load_images(images, MediaPolicy({"image": 2}))


def test_an_oversized_data_url_is_refused_before_it_is_decoded():
    huge = "data:image/png;base64," + "A" * (MAX_DATA_URL_CHARS + 4)
    start = time.monotonic()
    with pytest.raises(ValueError, match="over the limit of 64 MiB decoded") as e:
        load_image(huge, MediaPolicy(), "image 0")
    assert time.monotonic() - start < 1.0
    assert len(_one_line(e)) < 300
    small = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert load_image(small, MediaPolicy(), "image 0").size == (16, 12)


# -- 5, 6. local files ------------------------------------------------------------------------------------------
def _in_thread(fn, timeout_s: float = 5.0):
    """fn() on a daemon thread: (finished, its result or exception)."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as e:  # noqa: BLE001 - handed back to the test
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    return (not t.is_alive()), (out[0] if out else None)


def _unblock(fifo: str) -> None:
    """Let a reader blocked opening `fifo` go (a writer opens it)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_a_fifo_in_the_allowed_folder_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "pipe.png")
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path))
    try:
        finished, result = _in_thread(lambda: load_image("pipe.png", policy, "image 0"))
    finally:
        _unblock(str(tmp_path / "pipe.png"))
    assert finished, "load_image blocked on a FIFO"
    assert isinstance(result, ValueError) and "not a regular file" in str(result), result


def test_a_fifo_swapped_in_while_images_load_never_blocks(tmp_path):
    """The path turns from a file into a FIFO and back while it is loaded again and again: each load reads the file
    or refuses the FIFO, and none waits for a writer (a check before the open would leave a window). The file is not
    an image, so that a load is quick and the window is met often."""
    (tmp_path / "real.png").write_bytes(b"not an image")
    os.mkfifo(tmp_path / "fifo")
    os.link(tmp_path / "real.png", tmp_path / "real-again.png")
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path))
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            os.replace(tmp_path / "fifo", tmp_path / "x.png")
            os.mkfifo(tmp_path / "fifo")
            os.replace(tmp_path / "real-again.png", tmp_path / "x.png")
            os.link(tmp_path / "real.png", tmp_path / "real-again.png")

    done, LOADS = [0], 12_000  # noqa: N806

    def loads() -> None:
        for _ in range(LOADS):
            with pytest.raises(ValueError) as e:
                load_image("x.png", policy, "image 0")
            assert any(w in str(e.value) for w in ("not a regular file", "does not exist", "not an image")), e.value
            done[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns often: the swaps land between any two steps of a load
    swapper = threading.Thread(target=swap, daemon=True)
    loader = threading.Thread(target=loads, daemon=True)
    swapper.start()
    loader.start()
    try:
        while loader.is_alive():  # a load that makes no progress for 3 s waits on the FIFO
            seen = done[0]
            loader.join(3.0)
            assert not loader.is_alive() or done[0] != seen, f"load {seen} blocked on the FIFO swapped in"
    finally:
        stop.set()
        swapper.join()
        sys.setswitchinterval(interval)
        _unblock(str(tmp_path / "x.png"))
    assert done[0] == LOADS  # every load returned (an assertion inside would have stopped the count)


def test_a_subfolder_swapped_for_a_symlink_never_leads_outside(tmp_path):
    """sub/ is a real folder, then a link to a folder outside, then real again, while sub/a.png is loaded: no load
    returns the outside picture."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "real").mkdir(parents=True)
    outside.mkdir()
    Image.new("RGB", (8, 8), "green").save(root / "real" / "a.png")
    Image.new("RGB", (9, 9), "red").save(outside / "a.png")  # the secret: 9x9
    os.symlink(outside, root / "link")
    policy = MediaPolicy(allowed_local_media_path=str(root))
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            os.rename(root / "real", root / "sub")
            os.rename(root / "sub", root / "real")
            os.rename(root / "link", root / "sub")
            os.rename(root / "sub", root / "link")

    sizes = set()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    try:
        for _ in range(3000):
            try:
                sizes.add(load_image("sub/a.png", policy, "image 0").size)
            except ValueError as e:
                assert str(e).startswith("image 0:") and "\n" not in str(e), e  # refused while it was a link
    finally:
        stop.set()
        swapper.join()
        sys.setswitchinterval(interval)
    assert (9, 9) not in sizes


def test_symlinks_inside_the_allowed_folder_are_followed_and_ones_leading_out_refused(tmp_path):
    """As vLLM resolves them: a link that stays inside the folder (a Hugging Face cache's snapshots/ -> blobs/, a
    linked dataset tree) loads; one that leads outside is refused."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "pics").mkdir(parents=True)
    outside.mkdir()
    Image.new("RGB", (8, 8), "green").save(root / "pics" / "a.png")
    Image.new("RGB", (9, 9), "red").save(outside / "secret.png")
    os.symlink(outside / "secret.png", root / "escape.png")
    os.symlink(outside, root / "escape-dir")
    os.symlink(root / "pics", root / "inside-dir")
    os.symlink("../pics/a.png", root / "pics" / "relative.png")
    os.symlink(root / "pics" / "a.png", root / "inside.png")
    policy = MediaPolicy(allowed_local_media_path=str(root))
    for ref in ("pics/a.png", "inside-dir/a.png", "inside.png", "pics/relative.png"):
        assert load_image(ref, policy, "image 0").size == (8, 8)
    for ref in ("escape.png", "escape-dir/secret.png", "pics/../../outside/secret.png"):
        with pytest.raises(ValueError, match="must be inside allowed_local_media_path") as e:
            load_image(ref, policy, "image 0")
        _one_line(e)


def test_the_allowed_folder_may_be_named_through_a_link_to_it(tmp_path):
    (tmp_path / "real").mkdir()
    Image.new("RGB", (8, 8), "green").save(tmp_path / "real" / "a.png")
    os.symlink(tmp_path / "real", tmp_path / "alias")
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path / "alias"))
    assert load_image(str(tmp_path / "alias" / "a.png"), policy, "image 0").size == (8, 8)
    assert load_image(f"file://{tmp_path}/real/a.png", policy, "image 0").size == (8, 8)
    with pytest.raises(ValueError, match="must be inside allowed_local_media_path"):
        load_image(str(tmp_path / "a.png"), policy, "image 0")


def test_empty_and_special_files_are_refused(tmp_path):
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "folder.png").mkdir()
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path))
    with pytest.raises(ValueError, match="is empty"):
        load_image("empty.png", policy, "image 0")
    with pytest.raises(ValueError, match="not a regular file"):
        load_image("folder.png", policy, "image 0")
    with pytest.raises(ValueError, match="not a regular file"):
        load_image(".", policy, "image 0")
    proc = MediaPolicy(allowed_local_media_path="/proc/self")
    with pytest.raises(ValueError, match="is empty .or a special file of unknown size."):
        load_image("status", proc, "image 0")  # a regular file of st_size 0, as /proc/kmsg is


def test_a_nul_in_an_image_path_is_named(tmp_path):
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path))
    for ref in ("a\x00.png", "file:///a%00.png"):
        with pytest.raises(ValueError, match="^image 2: the image path .* contains a NUL character") as e:
            load_image(ref, policy, "image 2")
        _one_line(e)


def test_loaded_images_are_rgb_copies_the_caller_may_keep(tmp_path):
    """A PIL image passes through as an RGB image, a copy the caller may keep apart."""
    red = Image.new("RGB", (5, 4), "red")
    out = load_image(red, MediaPolicy(), "image 0")
    assert out.mode == "RGB" and out.size == (5, 4) and out.getpixel((0, 0)) == (255, 0, 0)
    buf = io.BytesIO()
    Image.new("L", (5, 4), 128).save(buf, format="PNG")
    (tmp_path / "grey.png").write_bytes(buf.getvalue())
    assert load_image("grey.png", MediaPolicy(allowed_local_media_path=str(tmp_path)), "x").getpixel((0, 0)) == \
        (128, 128, 128)


def test_llm_takes_allowed_media_domains_as_vllm_spells_it(tiny_llama, tmp_path):
    from connectors import KVTransferConfig
    from extractor import LLM

    llm = LLM(tiny_llama, allow_media_fetch=True, allowed_media_domains=["Img.Example", "localhost"],
              image_fetch_timeout_s=5, max_image_bytes=1 << 20, max_request_image_bytes=3 << 20,
              kv_transfer_config=KVTransferConfig(kv_connector_extra_config={"shared_storage_path": str(tmp_path)}))
    try:
        media = llm.config.media
        assert media.allowed_media_domains == ("img.example", "localhost")
        assert (media.image_fetch_timeout_s, media.max_image_bytes, media.max_request_image_bytes) == \
            (5.0, 1 << 20, 3 << 20)  # every bound settable offline too
    finally:
        llm.shutdown()
