"""hsx connectors: where captured hidden states go, and how they are read back.

    config.py                          KVTransferConfig, the connector registry
    base.py                            HiddenStatesConnector (the interface), RequestInfo
    safetensors_connector.py           SafetensorsHiddenStatesConnector: one safetensors file per request on fsspec
    extra_config.py                    HiddenStatesConnectorConfig: its kv_connector_extra_config, checked (no torch)
    example_hidden_states_connector.py vLLM's module name: the connector under vLLM's name + load/cleanup
    format.py                          the file format's names, without torch: HiddenStatesSpec, tensor names,
                                       HiddenStatesFileError (every file hsx refuses), layer-id and target checks,
                                       storage dtype names, the data checksum
    header.py                          a file's header: encoding, exact sizes, parsing and checks (TensorEntry,
                                       HiddenStatesFileInfo), the checksum against the header
    quant.py                           storing states in a storage dtype (fp8 with per-token-per-layer scales),
                                       BadStates and the one pass that finds NaN/Inf/all-zero layers before a commit
    run.py                             the run format: RunDir (the output root), RunSpec (run.json), data layout
    manifest.py                        the manifest: schema, atomic parts, readers, compaction, committed/settled rows
    manifest_writer.py                 the job's side: ManifestWriter (buffered atomic parts), summaries for `hsx status`
    fingerprint.py                     model_fingerprint: a model's identity as run.json records it
    folders.py                         what a folder holds (a model, a run): the names the guards look for
    paths.py                           default file names, custom-path containment
    lease.py                           WriterLease: one writer per folder (FOLDER/writer.lease), renewed while it runs
    outputs.py                         OutputFolder / check_output_file: outputs that cannot destroy inputs
    csvfile.py                         csv_bytes / safe_cell: every CSV hsx writes, safe to open in a spreadsheet
    http_reads.py                      read_bounded / is_redirect: an HTTP answer from a peer hsx does not control
                                       (a regenerate server, an image URL), its bytes bounded, redirects refused
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

This package never imports transformers or ray, and torch only where tensors are made (header, quant, reader, spool,
the safetensors modules): the interface, the run format, the lease, paths and storage load without it. The names below load
lazily, on first use. The training feed built on it is the `training` package.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "HiddenStatesConnector": "connectors.base",
    "RequestInfo": "connectors.base",
    "KVTransferConfig": "connectors.config",
    "get_connector_class": "connectors.config",
    "register_connector": "connectors.config",
    "registered_connectors": "connectors.config",
    "HiddenStatesFileError": "connectors.format",
    "HiddenStatesSpec": "connectors.format",
    "HiddenStatesFileInfo": "connectors.header",
    "PathInUse": "connectors.paths",
    "PathRejected": "connectors.paths",
    "cleanup_hidden_states": "connectors.reader",
    "load_hidden_states": "connectors.reader",
    "read_hidden_states_info": "connectors.reader",
    "verify_hidden_states": "connectors.reader",
    "UnsafeWritePathError": "connectors.storage",
}
"""name -> the module that defines it: each loads on first use, so `import connectors.lease` stays free of torch."""

__all__ = sorted([*_EXPORTS, "example_hidden_states_connector"])


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name == "example_hidden_states_connector":  # vLLM's module name: loads only when asked for
        return importlib.import_module("connectors.example_hidden_states_connector")
    raise AttributeError(f"module 'connectors' has no attribute {name!r}")
