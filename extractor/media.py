"""What an image prompt may bring, and loading its images: vLLM's media settings checked per request, no torch.

    MediaPolicy(limit_mm_per_prompt, allowed_local_media_path, allow_fetch, max_image_pixels)
    load_image(ref, policy, where) -> PIL.Image     a PIL image, a local path or file:// URL (inside
                                                    allowed_local_media_path), a data: URL, or (when allowed) http(s)
    is_multimodal(hf_config) / check_supported(hf_config, model)
                                                    which targets take images in hsx's engine (extractor.multimodal
                                                    runs them)

Every refusal is a ValueError naming the image (`where`) and the fix; nothing is fetched or read outside the policy.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
"""PIL's own decompression-bomb limit (Image.MAX_IMAGE_PIXELS): larger images are refused before decoding."""
MAX_FETCH_BYTES = 64 << 20
"""Largest image file read (a local file or a fetched URL)."""
ALLOWED_IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF", "PPM", "ICO")
"""The image formats PIL may open here (never EPS, which may run Ghostscript on the file's PostScript)."""



@dataclass(frozen=True)
class MediaPolicy:
    """vLLM's media settings. `limit_mm_per_prompt` {"image": N}; `allowed_local_media_path`: the folder local files
    (paths, file:// URLs) must lie in (unset: local files are refused, as vLLM refuses them); `allow_fetch`: http(s)
    URLs are fetched (off by default here: a batch job should not reach the network unasked)."""

    limit_mm_per_prompt: Mapping[str, int] | None = None
    allowed_local_media_path: str | None = None
    allow_fetch: bool = False
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

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

    def limit(self, modality: str) -> int:
        return int(self.limit_mm_per_prompt.get(modality, DEFAULT_LIMIT_PER_PROMPT))

    def check_count(self, modality: str, count: int, where: str) -> None:
        if count > self.limit(modality):
            raise ValueError(f"{where} has {count} {modality}s; at most {self.limit(modality)} {modality}(s) may be "
                             f"provided in one prompt (limit_mm_per_prompt); raise the limit or split the prompt")


def load_image(ref: Any, policy: MediaPolicy, where: str):
    """An RGB PIL image from `ref`: a PIL image, a local path or file:// URL (inside allowed_local_media_path), a
    data: URL (base64), or an http(s) URL when fetching is allowed. ValueError names the image and the fix."""
    from PIL import Image

    if isinstance(ref, Image.Image):
        return _checked(ref, policy, where)
    if not isinstance(ref, str) or not ref:
        raise ValueError(f"{where}: an image must be a path, a file://, data: or http(s) URL, or a PIL image; got "
                         f"{type(ref).__name__}")
    scheme = urllib.parse.urlsplit(ref).scheme.lower() if "://" in ref or ref.startswith("data:") else ""
    if scheme == "data":
        data = _data_url(ref, where)
    elif scheme in ("http", "https"):
        data = _fetch(ref, policy, where)
    elif scheme in ("", "file"):
        data = _local(ref, policy, where)
    else:
        raise ValueError(f"{where}: image URL scheme {scheme!r} is not supported; use a path, file://, data: or "
                         "http(s) URL")
    try:
        image = Image.open(io.BytesIO(data), formats=ALLOWED_IMAGE_FORMATS)
    except Exception as e:  # PIL raises UnidentifiedImageError, or its decoders' own errors
        raise ValueError(f"{where}: not an image PIL can read ({type(e).__name__}: {str(e)[:80]}); give a "
                         f"{', '.join(ALLOWED_IMAGE_FORMATS)} file") from None
    return _checked(image, policy, where)


def _checked(image, policy: MediaPolicy, where: str):
    width, height = image.size
    if width * height > policy.max_image_pixels:
        raise ValueError(f"{where}: the image is {width}x{height} = {width * height:,} pixels, over the limit of "
                         f"{policy.max_image_pixels:,} (max_image_pixels); downscale it")
    if width == 0 or height == 0:
        raise ValueError(f"{where}: the image is empty ({width}x{height})")
    try:
        return _rgb(image)
    except Exception as e:
        raise ValueError(f"{where}: the image cannot be decoded ({type(e).__name__}: {str(e)[:80]})") from None


def _rgb(image):
    """RGB as vLLM's loader gives it: turned upright by its EXIF orientation, transparency laid on white."""
    from PIL import Image, ImageOps

    image = ImageOps.exif_transpose(image)
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _data_url(ref: str, where: str) -> bytes:
    head, sep, body = ref.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ValueError(f"{where}: a data: URL must be data:<mime>;base64,<data>")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: the data: URL's base64 payload does not decode") from None


def _local(ref: str, policy: MediaPolicy, where: str) -> bytes:
    path = urllib.parse.unquote(urllib.parse.urlsplit(ref).path) if ref.lower().startswith("file:") else ref
    root = policy.allowed_local_media_path
    if not root:
        raise ValueError(f"{where}: cannot load local image {ref!r} without allowed_local_media_path; set it to the "
                         "folder your images are in")
    real = os.path.realpath(os.path.join(root, os.path.expanduser(path)))
    if os.path.commonpath([real, root]) != root:
        raise ValueError(f"{where}: the image path {ref!r} must be inside allowed_local_media_path {root!r}")
    try:
        info = os.stat(real)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{where}: {ref!r} is not a regular file")
        if info.st_size > MAX_FETCH_BYTES:
            raise ValueError(f"{where}: image file {ref!r} is {info.st_size:,} bytes, over the limit of "
                             f"{MAX_FETCH_BYTES >> 20} MiB")
        with open(real, "rb") as f:
            return f.read(MAX_FETCH_BYTES + 1)
    except FileNotFoundError:
        raise ValueError(f"{where}: image file {ref!r} does not exist") from None
    except OSError as e:
        raise ValueError(f"{where}: image file {ref!r} cannot be read: {e.strerror or e}") from None


def _fetch(url: str, policy: MediaPolicy, where: str) -> bytes:
    if not policy.allow_fetch:
        raise ValueError(f"{where}: fetching image URL {url!r} is not allowed; download it and give a local path, "
                         "or allow media fetching")
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=30) as response:  # noqa: S310 (http(s) only, checked above)
            data = response.read(MAX_FETCH_BYTES + 1)
    except Exception as e:
        raise ValueError(f"{where}: image URL {url!r} cannot be fetched ({type(e).__name__}: {str(e)[:80]})") from None
    if len(data) > MAX_FETCH_BYTES:
        raise ValueError(f"{where}: image URL {url!r} is larger than {MAX_FETCH_BYTES >> 20} MiB")
    return data
