"""What an image prompt may bring, and loading its images: vLLM's media settings checked per request, no torch.

    MediaPolicy(limit_mm_per_prompt, allowed_local_media_path, allow_fetch, allowed_media_domains,
                image_fetch_timeout_s, max_image_bytes, max_request_image_bytes)
    load_images(refs, policy, where) -> [PIL.Image] a prompt's images in order: their count (limit_mm_per_prompt) and
                                                    their decoded bytes together (max_request_image_bytes) checked,
                                                    each checked before it is decoded
    load_image(ref, policy, where) -> PIL.Image     one RGB image from a PIL image, a local path or file:// URL, a
                                                    data: URL, or (when allowed) an http(s) URL
    ImageUnavailable                                the ValueError of a URL that could not be fetched now (connection
                                                    failed, 408, 429, 5xx, the deadline): a later try may succeed
    is_multimodal(hf_config) / check_supported(hf_config, model)
                                                    which targets take images in hsx's engine (extractor.multimodal
                                                    runs them)

Where an image may come from, and the bounds on each:
    local path, file://   only inside allowed_local_media_path (unset: refused, as vLLM refuses them). Links are
                          resolved and the result must lie inside the folder (as vLLM checks it); the resolved
                          path is then opened from the folder one component at a time, following no symbolic link
                          (one swapped in between the check and the open is refused, never followed). The opened
                          file must be a non-empty regular file of at most 64 MiB (a FIFO, a device, /proc's size-0
                          files are refused without blocking). The folder itself may be named through a link.
    data: URL             base64 of at most 64 MiB decoded, its length checked before it is decoded
    http(s) URL           only with allow_fetch, by extractor.image_fetch: only hosts in allowed_media_domains when
                          that is set; redirects followed only to an http(s) host on that list (never without it);
                          connect, redirects, tries and the body within image_fetch_timeout_s; at most 64 MiB
    every image           PNG, JPEG, GIF, BMP, WebP, TIFF, PPM or ICO; its size read from its header and refused
                          before it is decoded when its RGB bytes (width x height x 3) pass max_image_bytes, or the
                          prompt's images together pass max_request_image_bytes (a 10 KB 1-bit PNG may decode to
                          hundreds of MB)

Every refusal is one line, a ValueError naming the image (`where`) and the fix; nothing is fetched or read outside
the policy.
"""

from __future__ import annotations

import base64
import binascii
import errno
import io
import os
import stat
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from extractor.image_fetch import ImageUnavailable, fetch_image  # noqa: F401 - ImageUnavailable: caught by callers

SUPPORTED_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""Vision-language families hsx's engine runs: their merged embeddings and M-RoPE positions are computed by the
model's own methods (get_image_features, get_rope_index) and fed to the language model chunk by chunk."""
DEEPSTACK_VL = ("qwen3_vl_moe",)


def is_multimodal(hf_config: Any) -> bool:
    """Whether hsx runs this target as a vision-language model (its images through the vision tower). Other configs
    with a vision tower whose text model transformers' AutoModelForCausalLM builds (Qwen3.5, Gemma-3, Llama-4) run as
    text-only targets."""
    return getattr(hf_config, "model_type", "") in (*SUPPORTED_VL, *DEEPSTACK_VL)


def check_supported(hf_config: Any, model: str) -> None:
    """ValueError naming what to do for a vision-language target hsx's engine cannot run exactly."""
    kind = getattr(hf_config, "model_type", "")
    if kind in DEEPSTACK_VL:
        raise ValueError(f"{model} is a {kind} target, which hsx's engine has not been checked against yet; supported "
                         f"vision-language families: {', '.join(SUPPORTED_VL)}")
    if kind not in SUPPORTED_VL:
        raise ValueError(f"{model} is a vision-language target of type {kind!r}, which hsx's engine does not run; "
                         f"supported: {', '.join(SUPPORTED_VL)} (or use its text model alone)")



DEFAULT_LIMIT_PER_PROMPT = 999
"""vLLM's default `limit_mm_per_prompt` per modality (V1 engine)."""
MAX_FETCH_BYTES = 64 << 20
"""Largest image file read (a local file, a fetched URL, a data: URL's decoded payload)."""
MAX_DATA_URL_CHARS = (MAX_FETCH_BYTES + 2) // 3 * 4
"""The longest base64 payload of a data: URL (MAX_FETCH_BYTES decoded), refused before it is decoded."""
DEFAULT_MAX_IMAGE_BYTES = 256 << 20
"""One image's decoded RGB bytes (width x height x 3): PIL's own decompression-bomb bound (89.5 Mpixel) as RGB, so
any camera or phone photo loads (the processor downscales it)."""
DEFAULT_MAX_REQUEST_IMAGE_BYTES = 512 << 20
"""A prompt's images' decoded RGB bytes together: two images at the per-image bound (the default limit_mm_per_prompt
of 999 would otherwise admit hundreds of small-on-the-wire, huge-decoded ones)."""
DEFAULT_FETCH_TIMEOUT_S = 30.0
"""The whole fetch of one image URL, when neither image_fetch_timeout_s nor $VLLM_IMAGE_FETCH_TIMEOUT says."""
FETCH_TIMEOUT_ENV = "VLLM_IMAGE_FETCH_TIMEOUT"
ALLOWED_IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF", "PPM", "ICO")
"""The image formats PIL may open here (never EPS, which may run Ghostscript on the file's PostScript)."""
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
_OPEN_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class MediaPolicy:
    """vLLM's media settings, and hsx's bounds on what an image may cost."""

    limit_mm_per_prompt: Mapping[str, int] | None = None
    """{"image": N}: the most images one prompt may bring (default vLLM's 999)."""
    allowed_local_media_path: str | None = None
    """The folder local images (paths, file:// URLs) must lie in, links resolved; unset: local images are refused,
    as vLLM refuses them."""
    allow_fetch: bool = False
    """Fetch http(s) URLs (off by default here: a batch job should not reach the network unasked)."""
    allowed_media_domains: Sequence[str] | None = None
    """vLLM's: the hosts URLs may be fetched from (matched exactly); unset: any host, and no redirect followed."""
    image_fetch_timeout_s: float | None = None
    """The whole fetch of one URL, in seconds; default $VLLM_IMAGE_FETCH_TIMEOUT, else 30."""
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    """One image's decoded RGB bytes (width x height x 3), checked from its header before decoding."""
    max_request_image_bytes: int = DEFAULT_MAX_REQUEST_IMAGE_BYTES
    """A prompt's images' decoded RGB bytes together."""

    def __post_init__(self) -> None:
        if not isinstance(self.allow_fetch, bool):  # a config file's "false" is a truthy string
            raise TypeError(f"allow_media_fetch must be true or false, got {self.allow_fetch!r}")
        if not isinstance(self.limit_mm_per_prompt, (Mapping, type(None))):
            raise TypeError(f"limit_mm_per_prompt must be a mapping like {{\"image\": 2}}, got "
                            f"{type(self.limit_mm_per_prompt).__name__}")
        limits = dict(self.limit_mm_per_prompt or {})
        for name, value in limits.items():
            if isinstance(value, Mapping):  # vLLM also takes {"image": {"count": N, ...}}
                value = value.get("count")
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"limit_mm_per_prompt[{name!r}] must be a count >= 0, got {value!r}")
            limits[name] = value
        object.__setattr__(self, "limit_mm_per_prompt", limits)
        if self.allowed_local_media_path:
            root = os.path.realpath(os.path.expanduser(str(self.allowed_local_media_path)))
            if not os.path.isdir(root):
                raise ValueError(f"allowed_local_media_path {self.allowed_local_media_path!r} is not an existing "
                                 "folder; give the folder your local images are in")
            object.__setattr__(self, "allowed_local_media_path", root)
        object.__setattr__(self, "allowed_media_domains", _domains(self.allowed_media_domains))
        object.__setattr__(self, "image_fetch_timeout_s", _fetch_timeout(self.image_fetch_timeout_s))
        for name in ("max_image_bytes", "max_request_image_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")

    def limit(self, modality: str) -> int:
        return int(self.limit_mm_per_prompt.get(modality, DEFAULT_LIMIT_PER_PROMPT))

    def check_count(self, modality: str, count: int, where: str) -> None:
        if count > self.limit(modality):
            raise ValueError(f"{where} has {count} {modality}s; at most {self.limit(modality)} {modality}(s) may be "
                             f"provided in one prompt (limit_mm_per_prompt); raise the limit or split the prompt")


def _domains(value: Any) -> tuple[str, ...] | None:
    """allowed_media_domains as lower-cased host names (a string: comma-separated); None when empty."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, Sequence) or not all(isinstance(d, str) for d in items):
        raise TypeError(f"allowed_media_domains must be a list of host names, got {value!r}")
    hosts = tuple(d.strip().lower() for d in items if d.strip())
    for host in hosts:
        if any(c in host for c in "/@ \t\\:") or host.startswith("["):  # a port never matches: hosts alone
            raise ValueError(f"allowed_media_domains takes host names like images.example.com (no scheme, port or "
                             f"path), got {host!r}")
    return hosts or None


def _fetch_timeout(value: Any) -> float:
    """image_fetch_timeout_s, else $VLLM_IMAGE_FETCH_TIMEOUT, else the default; a positive number of seconds."""
    name = "image_fetch_timeout_s"
    if value is None and os.environ.get(FETCH_TIMEOUT_ENV, "").strip():
        value, name = os.environ[FETCH_TIMEOUT_ENV].strip(), f"${FETCH_TIMEOUT_ENV}"
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if value is None:
        return DEFAULT_FETCH_TIMEOUT_S
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


# -- loading ------------------------------------------------------------------------------------------------------
def load_images(refs: Sequence[Any], policy: MediaPolicy, where: str = "the prompt") -> list:
    """A prompt's images as RGB PIL images, in order (what load_image takes, each); ValueError names the image and
    the fix. Each image's size is read from its header and the prompt's running total checked before it is decoded,
    so a prompt over max_request_image_bytes costs at most that much memory."""
    policy.check_count("image", len(refs), where)
    images, total = [], 0
    for i, ref in enumerate(refs):
        image = _open_image(ref, policy, f"image {i}")
        width, height = image.size
        total += width * height * 3
        if total > policy.max_request_image_bytes:
            raise ValueError(f"{where}'s images come to {_mib(total)} decoded (RGB) by image {i} ({width}x{height}), "
                             f"over the limit of {_mib(policy.max_request_image_bytes)} per prompt "
                             "(max_request_image_bytes); send fewer or smaller images, or raise the limit")
        images.append(_decoded(image, f"image {i}"))
    return images


def load_image(ref: Any, policy: MediaPolicy, where: str):
    """An RGB PIL image from `ref`: a PIL image, a local path or file:// URL (inside allowed_local_media_path), a
    data: URL (base64), or an http(s) URL when fetching is allowed. ValueError names the image and the fix."""
    return _decoded(_open_image(ref, policy, where), where)


def _open_image(ref: Any, policy: MediaPolicy, where: str):
    """`ref` opened as a PIL image, its header read and its size checked, not decoded yet."""
    from PIL import Image

    if isinstance(ref, Image.Image):
        image = ref
    elif not isinstance(ref, str) or not ref:
        raise ValueError(f"{where}: an image must be a path, a file://, data: or http(s) URL, or a PIL image; got "
                         f"{type(ref).__name__}")
    else:
        image = _open_bytes(_read(ref, policy, where), where)
    width, height = image.size
    if width == 0 or height == 0:
        raise ValueError(f"{where}: the image is empty ({width}x{height})")
    if width * height * 3 > policy.max_image_bytes:
        raise ValueError(f"{where}: the image is {width}x{height}, {_mib(width * height * 3)} decoded (RGB), over the "
                         f"limit of {_mib(policy.max_image_bytes)} per image (max_image_bytes); downscale it, or "
                         "raise the limit")
    return image


def _read(ref: str, policy: MediaPolicy, where: str) -> bytes:
    scheme = urllib.parse.urlsplit(ref).scheme.lower() if "://" in ref or ref.startswith("data:") else ""
    if scheme == "data":
        return _data_url(ref, where)
    if scheme in ("http", "https"):
        if not policy.allow_fetch:
            raise ValueError(f"{where}: fetching image URL {ref[:200]!r} is not allowed; download it and give a local "
                             "path, or allow media fetching")
        return fetch_image(ref, where, domains=policy.allowed_media_domains, timeout_s=policy.image_fetch_timeout_s,
                           cap=MAX_FETCH_BYTES)
    if scheme in ("", "file"):
        return _local(ref, policy, where)
    raise ValueError(f"{where}: image URL scheme {scheme!r} is not supported; use a path, file://, data: or http(s) "
                     "URL")


def _open_bytes(data: bytes, where: str):
    from PIL import Image

    try:
        return Image.open(io.BytesIO(data), formats=ALLOWED_IMAGE_FORMATS)
    except Exception as e:  # PIL raises UnidentifiedImageError, or its decoders' own errors
        raise ValueError(f"{where}: not an image PIL can read ({type(e).__name__}: {str(e)[:80]}); give a "
                         f"{', '.join(ALLOWED_IMAGE_FORMATS)} file") from None


def _decoded(image, where: str):
    """RGB as vLLM's loader gives it: turned upright by its EXIF orientation, transparency laid on white."""
    from PIL import Image, ImageOps

    try:
        if image.getexif().get(0x0112, 1) != 1:  # else exif_transpose would only copy it
            image = ImageOps.exif_transpose(image)
        if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, rgba).convert("RGB")
        return image.convert("RGB")
    except Exception as e:
        raise ValueError(f"{where}: the image cannot be decoded ({type(e).__name__}: {str(e)[:80]})") from None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def _data_url(ref: str, where: str) -> bytes:
    head, sep, body = ref.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ValueError(f"{where}: a data: URL must be data:<mime>;base64,<data>")
    if len(body) > MAX_DATA_URL_CHARS:
        raise ValueError(f"{where}: the data: URL's payload is {len(body):,} characters of base64, over the limit of "
                         f"{MAX_FETCH_BYTES >> 20} MiB decoded; send a smaller image")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: the data: URL's base64 payload does not decode") from None


# -- local files ----------------------------------------------------------------------------------------------------
def _local(ref: str, policy: MediaPolicy, where: str) -> bytes:
    """The bytes of a local image inside allowed_local_media_path, opened without following links (module doc)."""
    path = urllib.parse.unquote(urllib.parse.urlsplit(ref).path) if ref.lower().startswith("file:") else ref
    root = policy.allowed_local_media_path
    if not root:
        raise ValueError(f"{where}: cannot load local image {ref!r} without allowed_local_media_path; set it to the "
                         "folder your images are in")
    if "\x00" in path:
        raise ValueError(f"{where}: the image path {ref!r} contains a NUL character; give the path without it")
    # links resolved first (as vLLM resolves them: one inside the folder is fine), then the resolved path opened with
    # no link followed: one swapped in after the check is refused, never followed
    try:
        real = os.path.realpath(os.path.join(root, os.path.expanduser(path)))
    except OSError as e:  # a link that changed while it was resolved
        raise ValueError(f"{where}: the image path {ref!r} cannot be resolved ({e.strerror or e})") from None
    if os.path.commonpath([real, root]) != root:
        raise ValueError(f"{where}: the image path {ref!r} must be inside allowed_local_media_path {root!r}")
    rel = os.path.relpath(real, root)
    fd = _open_inside(root, [] if rel == "." else rel.split(os.sep), ref, where)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{where}: {ref!r} is not a regular file")
        if info.st_size == 0:  # an empty file, or a special one (/proc's) whose reads may block or never end
            raise ValueError(f"{where}: image file {ref!r} is empty (or a special file of unknown size)")
        if info.st_size > MAX_FETCH_BYTES:
            raise ValueError(f"{where}: image file {ref!r} is {info.st_size:,} bytes, over the limit of "
                             f"{MAX_FETCH_BYTES >> 20} MiB")
        data = bytearray()
        while len(data) <= MAX_FETCH_BYTES and (chunk := os.read(fd, min(1 << 20, MAX_FETCH_BYTES + 1 - len(data)))):
            data += chunk
    except OSError as e:  # BlockingIOError included: nothing here waits for a writer
        raise ValueError(f"{where}: image file {ref!r} cannot be read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_FETCH_BYTES:
        raise ValueError(f"{where}: image file {ref!r} grew past the limit of {MAX_FETCH_BYTES >> 20} MiB")
    return bytes(data)


def _open_inside(root: str, parts: list[str], ref: str, where: str) -> int:
    """A descriptor of root/parts[0]/.../parts[-1], each folder opened from the last one's descriptor and nothing
    followed: a link at any step is refused, whatever it points at (no window between a check and the open)."""
    if not parts:
        raise ValueError(f"{where}: {ref!r} is not a regular file")
    folder = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    part = ""
    try:
        for part in parts[:-1]:
            inner = os.open(part, _OPEN_FOLDER, dir_fd=folder)
            os.close(folder)
            folder = inner
        part = parts[-1]
        return os.open(part, _OPEN_FILE, dir_fd=folder)
    except FileNotFoundError:
        raise ValueError(f"{where}: image file {ref!r} does not exist") from None
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno == errno.ENOTDIR and _is_link(part, folder)):
            raise ValueError(f"{where}: the image path {ref!r} changed while it was opened (a symbolic link appeared "
                             f"at {part!r}); it is not followed") from None
        if e.errno == errno.ENOTDIR:  # a file where a folder should be (or a link, gone again by now)
            raise ValueError(f"{where}: the image path {ref!r} goes through {part!r}, which is not a folder") from None
        raise ValueError(f"{where}: image file {ref!r} cannot be read: {e.strerror or e}") from None
    finally:
        os.close(folder)


def _is_link(name: str, folder: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
    except OSError:
        return False
