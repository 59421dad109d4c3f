"""Shared fixtures: tiny models built locally (no downloads), a quiet environment for Ray and transformers.

Heavier shared services (loopback S3 server, GCS emulator, local Ray) live in the conftest of the test package
that needs them, each started once per session. The live `hsx serve` (`server`, harness/serving.py) is here: the tests
of `hsx serve` (tests/serve/) and of `hsx regenerate` against it (tests/jobs/) share one per session.
"""

from __future__ import annotations

import os

import pytest

from harness.serving import ServeProcess, SharedServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """build(family, **config_overrides) -> model dir; each distinct model is built once per session."""
    from reference.tiny_models import build_tiny_model

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


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-API server (moto in server mode) on loopback, as s3fs tests itself. Yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "hsx-test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "hsx-test")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, request):
    """A fresh bucket on the loopback server: (url "s3://bucket", storage_options for fsspec)."""
    import re
    import uuid

    import s3fs

    options = {"client_kwargs": {"endpoint_url": s3_server}, "skip_instance_cache": True}
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(**options)
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:8]
    fs.mkdir(name)
    return f"s3://{name}", options


@pytest.fixture(scope="session")
def oracle_model(tiny_llama):
    """(the tiny Llama in fp32, eval mode; its tokenizer): the plain transformers oracle."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="session")
def oracle_run(tmp_path_factory, tiny_llama, oracle_model):
    """(output, samples, spec): texts through the tiny Llama, layers ORACLE_LAYERS, last one pre-norm."""
    from connectors import HiddenStatesSpec
    from harness.runs import ORACLE_LAYERS, oracle_samples, write_run
    from reference.tiny_models import sample_text

    model, tokenizer = oracle_model
    spec = HiddenStatesSpec(layer_ids=ORACLE_LAYERS, num_hidden_layers=model.config.num_hidden_layers,
                            hidden_size=model.config.hidden_size, dtype="float32", model=tiny_llama)
    samples = oracle_samples(model, sample_text(6, seed=7, min_words=4, max_words=30), tokenizer, ORACLE_LAYERS)
    out = str(tmp_path_factory.mktemp("oracle-run"))
    write_run(out, samples, spec)
    return out, samples, spec


@pytest.fixture(scope="session")
def serve_model(tiny_llama) -> str:
    return tiny_llama


@pytest.fixture(scope="session")
def _servers(serve_model, tmp_path_factory):
    servers = SharedServer(serve_model, tmp_path_factory.mktemp("serve"))
    yield servers
    servers.close()


@pytest.fixture
def server(_servers) -> ServeProcess:
    """The shared live server: two engine replicas, 8 prompts per batch, a queue of 8, small limits to hit. Started
    once per session, shared by tests/serve/ and tests/jobs/test_regenerate*.py (Ray Serve's start is what costs)."""
    return _servers.get()
