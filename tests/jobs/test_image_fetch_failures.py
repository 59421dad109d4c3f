"""An image sample whose URL cannot be fetched now (a loopback server that refuses, answers 503, or is not up yet) is
a failed row that a re-run tries again (not settled), while one that fails the same way every time (404) is settled;
once the server answers, the re-run's worker writes the sample. The worker runs in this process (no Ray)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from connectors.format import HiddenStatesSpec
from connectors.manifest import read_manifest, settled_rows
from connectors.run import RunDir, RunSpec, write_run_spec
from tests.image_servers import LoopbackServer, image, png_bytes, status


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    from reference.tiny_models import build_tiny_vl_model

    return build_tiny_vl_model(str(tmp_path_factory.mktemp("tiny_vl")))


def _samples(vl_model, urls: dict[str, str]) -> pa.Table:
    from corpus.tokenization import SAMPLE_SCHEMA, SampleTokenizer, TokenizeSettings

    tok = SampleTokenizer(TokenizeSettings(tokenizer=vl_model, max_prompt_tokens=200, images=True))
    rows = []
    for sid, url in urls.items():
        record = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": url},
                                                            {"type": "text", "text": "what is it"}]}]}
        out = tok.tokenize(json.dumps(record))
        rows.append({"sample_id": sid, "source": f"c.jsonl:{sid}", "prompt_token_ids": out.ids, "loss_mask": out.mask,
                     "num_prompt_tokens": len(out.ids), "truncated": False, "error": None, "prompt_text": out.text,
                     "images": out.images})
    return pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA)


def test_a_transient_image_fetch_failure_is_retried_by_a_rerun(vl_model, tmp_path):
    from connectors.manifest_writer import ManifestWriter
    from connectors.safetensors_connector import HiddenStatesConnectorConfig
    from extractor import EngineConfig, SamplingParams
    from extractor.media import MediaPolicy
    from jobs.worker import ExtractionWorker, WorkerSettings

    out = RunDir(str(tmp_path / "run"))
    spec = RunSpec(HiddenStatesSpec(layer_ids=(1, 4), num_hidden_layers=4, hidden_size=64, dtype="float32",
                                    model=vl_model))
    write_run_spec(out, spec)
    png = png_bytes(56, 56)
    with LoopbackServer({"/busy.png": [status(503), status(503), status(503), image(png)],
                         "/gone.png": [status(404)], "/ok.png": [image(png)]}) as server:
        settings = WorkerSettings(
            engine=EngineConfig(model=vl_model, layer_ids=(1, 4), dtype="float32", device="cpu",
                                media=MediaPolicy(allow_fetch=True, image_fetch_timeout_s=20)),
            sampling=SamplingParams(max_tokens=0),
            connector=HiddenStatesConnectorConfig(shared_storage_path=out.url, allow_custom_save_path=True), run=spec)
        worker = ExtractionWorker(settings)
        samples = _samples(vl_model, {"busy": server.url("/busy.png"), "gone": server.url("/gone.png"),
                                      "ok": server.url("/ok.png")})
        writer = ManifestWriter(out, "A")
        first = worker(samples).to_pylist()
        writer.add(pa.Table.from_pylist(first))
        writer.flush()
        by_id = {r["sample_id"]: r for r in first}
        assert by_id["ok"]["status"] == "ok"
        assert by_id["busy"]["status"] == "failed" and by_id["busy"]["retry"] is True
        assert "cannot be fetched (HTTP 503; 3 tries)" in by_id["busy"]["error"]
        assert by_id["gone"]["status"] == "failed" and by_id["gone"]["retry"] is False
        assert "cannot be fetched (HTTP 404)" in by_id["gone"]["error"]
        settled = set(settled_rows(read_manifest(out))["sample_id"].to_pylist())
        assert settled == {"ok", "gone"}  # the busy sample is left for a re-run

        again = worker(samples.filter(pc.equal(samples["sample_id"], "busy"))).to_pylist()
        worker.llm.shutdown()
    assert again[0]["status"] == "ok", again[0]["error"]
    assert server.hits.count("/busy.png") == 4
