"""hsx and real vLLM: vLLM as hsx's second engine. The only package that imports vLLM; nothing below it does, and
`--engine hsx` (the default) never loads it.

    connector.py     HsxHiddenStatesConnector: hsx's connector as vLLM's KV-connector plug-in for the
                     `extract_hidden_states` method (kv_connector_module_path="vllm_engine.connector")
    engine.py        VllmEngine: vLLM behind the engine API hsx's workers use (extractor.engines.Engine,
                     `hsx run --engine vllm`), each reported file durable before `generate` returns
    rows.py          one request's states out of vLLM's block cache onto the host (pinned, a copy stream on CUDA)
    outcomes.py      each written file's outcome, from vLLM's workers back to the engine (worker_extension_cls)
    speculative.py   VllmSpeculativeLLM: speculative decoding in vLLM for `hsx eval-drafter --engine vllm`, each
                     family's checkpoint served with the method vLLM serves it with
    kind.py          VllmKind: vLLM as an engine kind (`--engine vllm`, entry point in hsx.engines), imports no
                     vLLM until it builds an engine
    options.py       vLLM's parallel settings and install hint, checked without vLLM (kind.py reads them)
"""
