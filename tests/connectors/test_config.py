"""KVTransferConfig and the connector's extra config: mistakes are caught at construction, with the valid choices."""

from __future__ import annotations

import dataclasses

import pytest

from connectors import KVTransferConfig, registered_connectors
from connectors.example_hidden_states_connector import ExampleHiddenStatesConnector, HiddenStatesConnectorConfig

VALID_KEYS = [f.name for f in dataclasses.fields(HiddenStatesConnectorConfig)]


def test_unknown_connector_name_is_rejected_listing_the_registered_ones():
    with pytest.raises(ValueError) as excinfo:
        KVTransferConfig(kv_connector="SharedStorageConnector")
    message = str(excinfo.value)
    assert "'SharedStorageConnector'" in message
    for name in ("ExampleHiddenStatesConnector", "HsxHiddenStatesConnector"):
        assert name in message and name in registered_connectors()


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both", "", "KV_PRODUCER"])
def test_kv_role_other_than_producer_is_rejected_naming_the_valid_one(role):
    with pytest.raises(ValueError, match=r"kv_role .* not supported.*\['kv_producer'\]"):
        KVTransferConfig(kv_role=role)


def test_unknown_extra_config_keys_are_rejected_listing_the_valid_ones(tmp_path):
    with pytest.raises(ValueError) as excinfo:
        KVTransferConfig(kv_connector_extra_config={"shared_storage_path": str(tmp_path), "num_threads": 4,
                                                    "allow_custom_path": True})
    message = str(excinfo.value)
    assert "['allow_custom_path', 'num_threads']" in message
    assert all(key in message for key in VALID_KEYS)


def test_extra_config_must_be_a_dict():
    with pytest.raises(TypeError, match="kv_connector_extra_config must be a dict, got list"):
        KVTransferConfig(kv_connector_extra_config=[("shared_storage_path", "/tmp")])


@pytest.mark.parametrize(("key", "value", "error"), [
    ("allow_custom_save_path", "false", TypeError),  # a YAML/JSON string must not switch custom paths on
    ("use_synchronization_lock", 1, TypeError),
    ("num_writer_threads", 0, ValueError),
    ("num_writer_threads", "8", TypeError),
    ("max_bytes_in_flight", 0, ValueError),
    ("max_write_attempts", 0, ValueError),
    ("write_retry_backoff_s", -1.0, ValueError),
    ("shared_storage_path", "", ValueError),
    ("storage_options", "endpoint=x", TypeError),
    ("max_remembered_paths", 0, ValueError),
    ("max_remembered_paths", -5, ValueError),
    ("max_remembered_paths", "16384", TypeError),
    ("max_remembered_paths", 2.5, TypeError),
    ("max_remembered_paths", True, TypeError),
])
def test_bad_extra_config_values_are_rejected_naming_the_key(key, value, error):
    with pytest.raises(error, match=key if key != "shared_storage_path" else "shared_storage_path is empty"):
        KVTransferConfig(kv_connector_extra_config={key: value})


def test_the_vllm_plug_ins_remembered_paths_bound_is_a_setting_refused_in_one_line_unless_positive(tmp_path):
    """max_remembered_paths (vllm_engine.connector hands it to connectors.paths.PathOwners): 16384 unless set, any
    positive integer taken, anything else one line naming the key."""
    assert HiddenStatesConnectorConfig().max_remembered_paths == 16384
    kv = KVTransferConfig(kv_connector="HsxHiddenStatesConnector",
                          kv_connector_extra_config={"shared_storage_path": str(tmp_path), "max_remembered_paths": 50})
    assert kv.connector_class.parse_extra_config(kv.kv_connector_extra_config).max_remembered_paths == 50
    with pytest.raises(ValueError) as e:
        KVTransferConfig(kv_connector_extra_config={"max_remembered_paths": 0})
    assert str(e.value) == ("kv_connector_extra_config['max_remembered_paths'] must be a positive number of paths, "
                            "got 0 (default 16384)")


def test_defaults_match_vllms_connector():
    cfg = HiddenStatesConnectorConfig()
    assert cfg.allow_custom_save_path is False
    assert cfg.num_writer_threads == 8
    assert cfg.use_synchronization_lock is True


def test_valid_config_builds_the_connector_with_its_settings(tmp_path):
    from tests.connectors.conftest import make_spec

    kv = KVTransferConfig(kv_connector="HsxHiddenStatesConnector",
                          kv_connector_extra_config={"shared_storage_path": str(tmp_path),
                                                     "allow_custom_save_path": True, "allowed_roots": str(tmp_path),
                                                     "num_writer_threads": 2})
    connector = kv.create_connector(make_spec())
    try:
        assert isinstance(connector, ExampleHiddenStatesConnector)
        assert connector.extra_config.allow_custom_save_path is True
        assert connector.extra_config.allowed_roots == (str(tmp_path),)
        assert connector.extra_config.num_writer_threads == 2
    finally:
        connector.shutdown()


def test_vllm_import_path_exposes_load_and_cleanup():
    from connectors import example_hidden_states_connector
    from connectors.reader import cleanup_hidden_states, load_hidden_states

    assert example_hidden_states_connector.load_hidden_states is load_hidden_states
    assert example_hidden_states_connector.cleanup_hidden_states is cleanup_hidden_states
    assert callable(example_hidden_states_connector.read_hidden_states_info)
