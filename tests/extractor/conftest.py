import pytest

from connectors import KVTransferConfig


def spec_config(layer_ids):
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}


@pytest.fixture
def kv_config(tmp_path):
    def make(**extra):
        cfg = {"shared_storage_path": str(tmp_path / "hs"), "allow_custom_save_path": True}
        cfg.update(extra)
        return KVTransferConfig(kv_connector="ExampleHiddenStatesConnector", kv_role="kv_producer",
                                kv_connector_extra_config=cfg)
    return make
