"""hsx and real vLLM: vLLM as hsx's second engine. The only package that imports vLLM; nothing below it does, and
`--engine hsx` (the default) never loads it.

    connector.py     HsxHiddenStatesConnector: hsx's connector as vLLM's KV-connector plug-in for the
                     `extract_hidden_states` method (kv_connector_module_path="vllm_engine.connector")
"""
