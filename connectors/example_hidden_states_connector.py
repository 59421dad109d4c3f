"""vLLM's module name for the hidden-states connector, kept so that vLLM users' imports and calls port unchanged:

    from connectors import example_hidden_states_connector
    example_hidden_states_connector.load_hidden_states(path)
    KVTransferConfig(kv_connector="ExampleHiddenStatesConnector", ...)

`ExampleHiddenStatesConnector` is `safetensors_connector.SafetensorsHiddenStatesConnector` under vLLM's name.
"""

from connectors.reader import cleanup_hidden_states, load_hidden_states, read_hidden_states_info
from connectors.safetensors_connector import HiddenStatesConnectorConfig, SafetensorsHiddenStatesConnector

ExampleHiddenStatesConnector = SafetensorsHiddenStatesConnector

__all__ = ["ExampleHiddenStatesConnector", "HiddenStatesConnectorConfig", "cleanup_hidden_states",
           "load_hidden_states", "read_hidden_states_info"]
