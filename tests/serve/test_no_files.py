"""`hsx serve --no-files`: generation only, a file only for a request that sends kv_transfer_params (the generator
behind `hsx regenerate`). Oracle: the offline engine's greedy tokens and its file for the same request."""

from __future__ import annotations

import os

import pytest
import torch

from connectors import load_hidden_states
from extractor import LLM, SamplingParams
from harness.serving import LAYERS, served
from harness.specs import spec_config
from serve.config import ServeConfig
from serve.server import check

PROMPT = [17, 250, 3, 99, 480, 12, 7]


@pytest.mark.ray
@pytest.mark.slow
def test_a_no_files_server_writes_only_for_requests_that_ask(serve_model, tmp_path):
    out = tmp_path / "out"
    with served(serve_model, str(out), str(tmp_path / "serve.log"), no_files=True, replicas=1) as server:
        client = server.client()
        plain = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
        assert plain.kv_transfer_params is None and plain.choices[0].kv_transfer_params is None
        assert not out.exists() or list(out.iterdir()) == []
        chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3, temperature=0)
        assert chat.kv_transfer_params is None and (not out.exists() or list(out.iterdir()) == [])
        asked = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True,
                                                      "kv_transfer_params": {}})
        path = asked.kv_transfer_params["hidden_states_path"]
        assert os.path.dirname(path) == str(out) and [p.name for p in out.iterdir()] == [os.path.basename(path)]
        got = load_hidden_states(path)
    assert plain.choices[0].token_ids == asked.choices[0].token_ids

    from connectors import KVTransferConfig

    llm = LLM(model=serve_model, speculative_config=spec_config(LAYERS), kv_transfer_config=KVTransferConfig(
        kv_connector_extra_config={"shared_storage_path": str(tmp_path / "offline")}))
    try:
        (want,) = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=5, temperature=0,
                                                                               ignore_eos=True))
        assert list(want.outputs[0].token_ids) == plain.choices[0].token_ids
        ref = load_hidden_states(want.kv_transfer_params["hidden_states_path"])
    finally:
        llm.shutdown()
    assert got["token_ids"].tolist() == PROMPT
    torch.testing.assert_close(got["hidden_states"], ref["hidden_states"], rtol=1e-4, atol=5e-5)


def test_no_files_without_output_is_a_generation_server(serve_model):
    """No --output: nothing can be written, so it is not asked for (check passes) and the replicas' connector is the
    NullConnector; with --output the connector writes for requests that ask."""
    config = ServeConfig(model=serve_model, files=False)
    check(config)
    assert not config.writes_files and config.kv_transfer_config().kv_connector == "NullConnector"
    with_output = ServeConfig(model=serve_model, files=False, output="/tmp/hsx-no-files")
    assert with_output.kv_transfer_config().kv_connector_extra_config["files"] == "requested"
    with pytest.raises(ValueError, match="--output"):
        check(ServeConfig(model=serve_model))
