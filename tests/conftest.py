"""Shared fixtures: tiny models built locally (no downloads), a quiet environment for Ray and transformers.

Heavier shared services (loopback S3 server, GCS emulator, local Ray) live in the conftest of the test package
that needs them, each started once per session.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """build(family, **config_overrides) -> model dir; each distinct model is built once per session."""
    from extractor.tiny_models import build_tiny_model

    built: dict[tuple, str] = {}

    def build(family: str = "llama", **overrides) -> str:
        key = (family, tuple(sorted(overrides.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{family}")
            built[key] = build_tiny_model(family, str(out), **overrides)
        return built[key]

    return build


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    """A 4-layer Llama (hidden 64, fp32) with the local tokenizer."""
    return tiny_model_factory("llama")
