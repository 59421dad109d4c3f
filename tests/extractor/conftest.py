import pytest

from connectors import KVTransferConfig
from harness.specs import spec_config  # noqa: F401 - the fixtures below build it


@pytest.fixture
def kv_config(tmp_path):
    def make(**extra):
        cfg = {"shared_storage_path": str(tmp_path / "hs"), "allow_custom_save_path": True}
        cfg.update(extra)
        return KVTransferConfig(kv_connector="ExampleHiddenStatesConnector", kv_role="kv_producer",
                                kv_connector_extra_config=cfg)
    return make
