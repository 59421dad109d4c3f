"""OpenAI content parts -> what a chat template is given, by vLLM's rule (`chat_template_content_format="auto"`): one
rule for `LLM.chat`, `hsx serve`'s chat route and the corpus readers.

    content_format(template) -> "string" | "openai"     "openai" when the template loops over a message's content
    message_content(content, where, model) -> str | [{"type": "text", "text": ...}]
                                                        a message's content checked: a string, or text parts
    media_refusal(content, where, model) -> str | None  why a media part cannot reach a text-only target
    image_content(content, where) -> (content, images)  a vision-language target's message: image parts become
                                                        {"type": "image"} for the template, their references returned
    for_template(content, fmt) -> str | [parts]         as the template takes it: text parts joined with "\\n"
                                                        ("string"), or passed as parts ("openai")
    messages_for_template(messages, template)           every message's content as `template` takes it

A content part is `{"type": "text", "text": str}`. An image, audio, video or file part on a text-only target is
refused naming the target (hsx's engine serves text-only targets; it never turns a part into text). A template
"expects parts" when its Jinja source has a `for` loop over `<message>['content']` or `<message>.content`, as vLLM
detects it; every other template gets one string, the text parts joined by newlines.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

STRING, OPENAI = "string", "openai"
MEDIA_PARTS = ("image_url", "image", "image_pil", "image_embeds", "input_image", "audio_url", "input_audio", "audio",
               "video_url", "video", "file")
"""Part types that carry media: on a text-only target, an error (never text)."""
IMAGE_PARTS = ("image_url", "input_image", "image_pil", "image")
"""Part types that carry an image: a vision-language target takes them (image_content)."""


def content_format(template: Any) -> str:
    """"openai" when `template` iterates a message's content (it renders parts itself), else "string". A template
    that does not parse is "string": rendering it reports its own error. A tokenizer's named templates (a dict, when
    a model ships additional_chat_templates/) are judged by the one apply_chat_template uses, "default"."""
    if isinstance(template, Mapping):
        template = template.get("default")
    return _content_format(template) if isinstance(template, str) and template else STRING


@functools.lru_cache(maxsize=32)
def _content_format(template: str) -> str:
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateError:
        return STRING
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        if isinstance(it, nodes.Filter) and it.node is not None:  # `for p in message['content'] | list`
            it = it.node
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content":
            return OPENAI
        if isinstance(it, nodes.Getattr) and it.attr == "content":
            return OPENAI
    return STRING


def message_content(content: Any, where: str, model: str | None = None) -> str | list[dict[str, str]]:
    """`content` checked: a string as it is, a list of parts as [{"type": "text", "text": str}]. ValueError names the
    message, the part and the fix; a media part names the target as text-only."""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence) or isinstance(content, (bytes, bytearray)):
        raise ValueError(f"{where} content must be a string or a list of {{'type': 'text', 'text': ...}} parts, got "
                         f"{type(content).__name__}")
    if (refused := media_refusal(content, where, model)) is not None:
        raise ValueError(refused)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            shown = repr(part)[:60]
            raise ValueError(f"{where} content part {j} must be {{'type': 'text', 'text': str}}, got {shown}")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def image_content(content: Any, where: str) -> tuple[str | list[dict[str, str]], list[Any]]:
    """A message's content for a vision-language target: (content for the template, the images it brings in order).
    Text parts as message_content gives them; each image part (image_url / input_image with a URL, image_pil, image)
    becomes {"type": "image"} where it stood (the template puts the model's placeholder there) and its reference is
    returned for extractor.media.load_image. Audio, video and file parts are refused: hsx takes images."""
    if isinstance(content, str) or not isinstance(content, Sequence) or isinstance(content, (bytes, bytearray)):
        return message_content(content, where), []
    parts: list[dict[str, str]] = []
    images: list[Any] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in IMAGE_PARTS:
            value = part.get("image_url" if kind in ("image_url", "input_image") else kind)
            ref = value.get("url") if isinstance(value, Mapping) else value
            if ref is None:
                raise ValueError(f"{where} content part {j} ({kind}) carries no image: give "
                                 "{'type': 'image_url', 'image_url': {'url': ...}}")
            parts.append({"type": "image"})
            images.append(ref)
        elif kind in MEDIA_PARTS:
            raise ValueError(f"{where} content part {j} is of type {kind!r}: hsx gives a vision-language target text "
                             "and images only; drop that part")
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise ValueError(f"{where} content part {j} must be a text part {{'type': 'text', 'text': str}} or an "
                             f"image part, got {repr(part)[:60]}")
    return parts, images


def media_refusal(content: Any, where: str, model: str | None = None) -> str | None:
    """Why `content` cannot reach a text-only target (its first media part, named), or None."""
    if isinstance(content, str) or not isinstance(content, Sequence):
        return None
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type")
        if kind in MEDIA_PARTS or (kind is None and set(part) & set(MEDIA_PARTS)):
            target = f"{model} is" if model else "the target is"
            return (f"{where} content part {j} is of type {kind or 'media'!r}, but {target} a text-only model: hsx "
                    "gives a text-only target text alone (an image is never turned into text); drop that part, or "
                    "use a multimodal target")
    return None


def for_template(content: str | list[Mapping[str, str]] | None, fmt: str) -> Any:
    """A checked content as a template of format `fmt` takes it (see the module docstring)."""
    if content is None or isinstance(content, str):
        return content
    if fmt == OPENAI:
        return [dict(p) for p in content]
    return "\n".join(p["text"] for p in content)


def messages_for_template(messages: Sequence[Mapping[str, Any]], template: str | None) -> list[dict[str, Any]]:
    """Each message with its content as `template` takes it (messages already checked by message_content)."""
    fmt = content_format(template)
    return [{**m, "content": for_template(m.get("content"), fmt)} if "content" in m else dict(m) for m in messages]
