"""The reference vision-language target's build at test size: drawn scenes are deterministic and answerable only
from the picture, the build learns (its loss falls), is cached, and the folder runs in hsx's engine on image
prompts as transformers runs it."""

from __future__ import annotations

import json
import os
import random

import torch

from reference.vl_target import REPORT_NAME, Scene, VLTargetConfig, build_vl_target, chat, image_chats


def test_scenes_and_chats_are_deterministic_and_need_the_picture(tmp_path):
    a = image_chats(12, seed=3, folder=str(tmp_path / "a"))
    b = image_chats(12, seed=3, folder=str(tmp_path / "b"))
    assert [r["messages"] for r in a] == [r["messages"] for r in b]
    assert open(tmp_path / "a" / "scene-3-0.png", "rb").read() == open(tmp_path / "b" / "scene-3-0.png", "rb").read()
    rng = random.Random(0)
    answers = {}
    for _ in range(200):  # the same question about different pictures has different answers
        scene = Scene.draw(rng)
        question, answer = chat(scene, rng)
        answers.setdefault(question, set()).add(answer)
    assert all(len(v) > 1 for q, v in answers.items() if q in ("Describe the picture.", "What digit is shown?"))


def test_the_build_learns_is_cached_and_runs_in_hsx(tmp_path):
    from transformers import AutoModelForImageTextToText

    from extractor import LLM, SamplingParams

    config = VLTargetConfig(steps=60, train_scenes=160, heldout_scenes=2, hidden_size=64, cache_root=str(tmp_path))
    target = build_vl_target(config, progress=False)
    report = json.load(open(os.path.join(target.path, REPORT_NAME)))
    assert not target.cached and report["final_loss"] < report["loss_curve"][0] - 1.5
    assert build_vl_target(config, progress=False).cached
    media = str(tmp_path / "media")
    (record,) = image_chats(1, seed=11, folder=media, answers=False)
    llm = LLM(target.path, allowed_local_media_path=media)
    (out,) = llm.chat(record["messages"], SamplingParams(max_tokens=8, temperature=0))
    model = AutoModelForImageTextToText.from_pretrained(target.path).eval()
    processor = llm.runner.vision.processor
    from PIL import Image

    image = Image.open(os.path.join(media, record["messages"][0]["content"][0]["image_url"]["url"])).convert("RGB")
    enc = processor(text=[out.prompt], images=[image], return_tensors="pt", return_mm_token_type_ids=True)
    with torch.no_grad():
        want = model.generate(**enc, max_new_tokens=8, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    assert out.outputs[0].token_ids == want[:len(out.outputs[0].token_ids)] and out.outputs[0].token_ids
