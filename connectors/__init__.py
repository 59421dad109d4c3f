"""hsx connectors: where captured hidden states go, and how they are read back.

    config.py                          KVTransferConfig, the connector registry
    base.py                            HiddenStatesConnector (the interface), RequestInfo
    safetensors_connector.py           SafetensorsHiddenStatesConnector: one safetensors file per request on fsspec
    example_hidden_states_connector.py vLLM's module name: the connector under vLLM's name + load/cleanup
    format.py                          the file format: HiddenStatesSpec, header encoding/parsing and checks, data
                                       checksum, HiddenStatesFileError (every file hsx refuses), layer-id check
    quant.py                           storage dtypes (fp8 with per-token-per-layer scales), BadStates and the one
                                       pass that finds NaN/Inf/all-zero layers before a commit
    run.py                             the run format: RunSpec (run.json), data layout, manifest schema/parts/readers
    fingerprint.py                     model_fingerprint: a model's identity as run.json records it
    paths.py                           default file names, custom-path containment
    lease.py                           WriterLease: one writer per folder (FOLDER/writer.lease), renewed while it runs
    outputs.py                         OutputFolder / check_output_file: outputs that cannot destroy inputs
    csvfile.py                         csv_bytes / safe_cell: every CSV hsx writes, safe to open in a spreadsheet
    storage.py                         fsspec primitives: the one durable atomic put, pending-write locks, retries
    safetensors_file.py                one safetensors file's bytes through that put: write_atomic (checksummed)
    writer.py                          background writes with a bound on bytes in flight
    spool.py                           Spool: a long request's per-token streams staged on local disk (anonymous
                                       files), read back block by block when its file is assembled
    reader.py                          load_hidden_states / read_hidden_states_info / verify_hidden_states /
                                       cleanup_hidden_states / read_rows (the training feed's read); fp8 dequantized;
                                       any of them over one sample's byte range of a shard
    shards.py                          the sharded layout: many samples' files in one object, written atomically,
                                       orphans removed

This package never imports transformers or ray. The training feed built on it is the `training` package.
"""

from connectors.base import HiddenStatesConnector, RequestInfo
from connectors.config import KVTransferConfig, get_connector_class, register_connector, registered_connectors
from connectors.format import HiddenStatesFileError, HiddenStatesFileInfo, HiddenStatesSpec
from connectors.paths import PathInUse, PathRejected
from connectors.reader import (
    cleanup_hidden_states,
    load_hidden_states,
    read_hidden_states_info,
    verify_hidden_states,
)
from connectors.storage import UnsafeWritePathError

__all__ = [
    "HiddenStatesConnector",
    "HiddenStatesFileError",
    "HiddenStatesFileInfo",
    "HiddenStatesSpec",
    "KVTransferConfig",
    "PathInUse",
    "PathRejected",
    "UnsafeWritePathError",
    "RequestInfo",
    "cleanup_hidden_states",
    "example_hidden_states_connector",
    "get_connector_class",
    "load_hidden_states",
    "read_hidden_states_info",
    "register_connector",
    "registered_connectors",
    "verify_hidden_states",
]


def __getattr__(name: str):
    # lazy: the connector module loads only when asked for
    if name == "example_hidden_states_connector":
        import importlib

        return importlib.import_module("connectors.example_hidden_states_connector")
    raise AttributeError(f"module 'connectors' has no attribute {name!r}")
