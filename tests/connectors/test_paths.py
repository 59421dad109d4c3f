"""Where files may go: custom paths that try to escape the root are refused before anything is written; request ids
of any shape become safe, distinct file names inside the root."""

from __future__ import annotations

import logging
import os
import re

import pytest
import torch

from connectors import PathRejected, RequestInfo, load_hidden_states
from tests.connectors.conftest import make_spec

SAFE_NAME = re.compile(r"[A-Za-z0-9._-]+\.safetensors")


def local_files(top) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(top):
        for n in names:
            p = os.path.join(dirpath, n)
            out[p] = os.readlink(p).encode() if os.path.islink(p) else open(p, "rb").read()
    return out


def write_one(connector, request_id: str, params: dict | None = None, num_tokens: int = 3) -> str:
    connector.start_request(RequestInfo(request_id, num_tokens, params or {}))
    connector.save_hidden_states(request_id, torch.arange(num_tokens), torch.ones(num_tokens, 3, 32))
    return connector.request_finished(request_id)["hidden_states_path"]


def assert_rejected_and_nothing_written(connector, backend, tmp_path, custom) -> None:
    """`custom` fails its request at start_request; the connector still works; the only new file is a valid one."""
    before = {**backend.files(), **{k: len(v) for k, v in local_files(tmp_path).items()}}
    contents_before = local_files(tmp_path)
    with pytest.raises(PathRejected):
        connector.start_request(RequestInfo("attack", 3, {"hidden_states_path": custom}))
    with pytest.raises(KeyError, match="not in flight"):  # the request was never accepted
        connector.save_hidden_states("attack", torch.arange(3), torch.ones(3, 3, 32))
    good = write_one(connector, "good")
    assert connector.wait_for_save() == {}
    after = {**backend.files(), **{k: len(v) for k, v in local_files(tmp_path).items()}}
    assert set(after) - set(before) == {backend.key(good)}
    assert {k: v for k, v in after.items() if k in before} == before
    assert {k: v for k, v in local_files(tmp_path).items() if k in contents_before} == contents_before


LOCAL_ATTACKS = {
    "dotdot-relative": lambda root, out: "../escape.safetensors",
    "dotdot-relative-deep": lambda root, out: "sub/../../escape.safetensors",
    "dotdot-absolute": lambda root, out: f"{root}/../escape.safetensors",
    "dotdot-absolute-deep": lambda root, out: f"{root}/sub/../../../outside/escape.safetensors",
    "absolute-elsewhere": lambda root, out: f"{out}/escape.safetensors",
    "file-url-elsewhere": lambda root, out: f"file://{out}/escape.safetensors",
    "home": lambda root, out: "~/escape.safetensors",
    "home-user": lambda root, out: "~root/escape.safetensors",
    "another-protocol": lambda root, out: "memory://store/run/escape.safetensors",
    "unknown-protocol": lambda root, out: "nosuchfs://bucket/escape.safetensors",
    "chained-protocol": lambda root, out: f"simplecache::file://{root}/escape.safetensors",
    "prefix-sibling": lambda root, out: f"{root}-evil/escape.safetensors",
    "root-as-file": lambda root, out: f"{root}.safetensors",
    "symlinked-directory": lambda root, out: f"{root}/link-out/escape.safetensors",
    "symlinked-file": lambda root, out: f"{root}/victim.safetensors",
    "symlinked-file-relative": lambda root, out: "victim.safetensors",
    "backslash-relative": lambda root, out: "..\\..\\escape.safetensors",
    "dot-segment-relative": lambda root, out: "./sub/./escape.safetensors",
    "empty-segment-relative": lambda root, out: "sub//escape.safetensors",
    "newline": lambda root, out: f"{root}/esc\nape.safetensors",
    "null-byte": lambda root, out: f"{root}/escape\x00.safetensors",
    "escape-char": lambda root, out: f"{root}/\x1b[2Jescape.safetensors",
    "no-suffix": lambda root, out: f"{root}/escape.bin",
    "suffix-then-directory": lambda root, out: f"{root}/escape.safetensors/",
    "empty": lambda root, out: "",
}


@pytest.mark.parametrize("attack", sorted(LOCAL_ATTACKS))
def test_escaping_local_custom_path_is_rejected_and_nothing_is_written(attack, tmp_path, monkeypatch,
                                                                       connector_factory):
    from tests.connectors.conftest import _local_backend

    backend = _local_backend(tmp_path)
    root, outside = backend.root, tmp_path / "outside"
    os.makedirs(root)
    outside.mkdir()
    (outside / "victim.safetensors").write_bytes(b"precious")
    os.symlink(outside, f"{root}/link-out")
    os.symlink(outside / "victim.safetensors", f"{root}/victim.safetensors")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    connector = connector_factory(root, make_spec(), allow_custom_save_path=True)

    assert_rejected_and_nothing_written(connector, backend, tmp_path, LOCAL_ATTACKS[attack](root, outside))
    assert (outside / "victim.safetensors").read_bytes() == b"precious"


def test_non_string_custom_path_is_rejected(tmp_path, connector_factory):
    connector = connector_factory(str(tmp_path), make_spec(), allow_custom_save_path=True)
    with pytest.raises(PathRejected, match="non-empty string"):
        connector.start_request(RequestInfo("r", 3, {"hidden_states_path": 42}))


def _other_protocol(proto: str, tmp_path) -> str:
    return "s3://hsx-other/run/escape.safetensors" if proto != "s3" else "memory://hsx-other/run/escape.safetensors"


STORE_ATTACKS = {
    "dotdot-relative": lambda p, b, t: "../escape.safetensors",
    "dotdot-relative-deep": lambda p, b, t: "sub/../../escape.safetensors",
    "dotdot-in-key": lambda p, b, t: f"{p}://{b}/run/../escape.safetensors",
    "dotdot-in-key-deep": lambda p, b, t: f"{p}://{b}/run/sub/../../other/escape.safetensors",
    "dot-segment": lambda p, b, t: f"{p}://{b}/run/./escape.safetensors",
    "empty-segment": lambda p, b, t: f"{p}://{b}/run//escape.safetensors",
    "outside-prefix": lambda p, b, t: f"{p}://{b}/other/escape.safetensors",
    "prefix-sibling": lambda p, b, t: f"{p}://{b}/run-evil/escape.safetensors",
    "another-bucket": lambda p, b, t: f"{p}://{b}-evil/run/escape.safetensors",
    "backslash": lambda p, b, t: f"{p}://{b}/run/..\\..\\escape.safetensors",
    "backslash-relative": lambda p, b, t: "sub\\..\\..\\escape.safetensors",
    "query": lambda p, b, t: f"{p}://{b}/run/escape?x=.safetensors",
    "fragment": lambda p, b, t: f"{p}://{b}/run/escape#.safetensors",
    "another-protocol": lambda p, b, t: _other_protocol(p, t),
    "chained-protocol": lambda p, b, t: f"simplecache::{p}://{b}/run/escape.safetensors",
    "local-absolute": lambda p, b, t: f"{t}/outside/escape.safetensors",
    "home": lambda p, b, t: "~/escape.safetensors",
    "newline": lambda p, b, t: f"{p}://{b}/run/esc\nape.safetensors",
    "null-byte": lambda p, b, t: f"{p}://{b}/run/escape\x00.safetensors",
    "no-suffix": lambda p, b, t: f"{p}://{b}/run/escape",
}


@pytest.mark.parametrize("attack", sorted(STORE_ATTACKS))
def test_escaping_object_store_custom_path_is_rejected_and_nothing_is_written(attack, object_store, tmp_path,
                                                                              monkeypatch, connector_factory):
    proto, rest = object_store.root.split("://", 1)
    bucket = rest.split("/", 1)[0]
    if object_store.name != "memory":
        object_store.fs.mkdir(f"{bucket}-evil")  # exists, so a write there would land
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    connector = connector_factory(object_store.root, make_spec(), storage_options=object_store.storage_options,
                                  allow_custom_save_path=True)
    assert_rejected_and_nothing_written(connector, object_store, tmp_path,
                                        STORE_ATTACKS[attack](proto, bucket, tmp_path))


def test_custom_paths_inside_the_root_are_accepted(backend, connector_factory):
    connector = connector_factory(backend.root, make_spec(), storage_options=backend.storage_options,
                                  allow_custom_save_path=True)
    relative = write_one(connector, "rel", {"hidden_states_path": "sub/dir/rel.safetensors"})
    absolute = write_one(connector, "abs", {"hidden_states_path": backend.url("abs/x.safetensors")})
    assert connector.wait_for_save() == {}
    assert backend.key(relative) == backend.key(backend.url("sub/dir/rel.safetensors"))
    assert backend.key(absolute) == backend.key(backend.url("abs/x.safetensors"))
    for path in (relative, absolute):
        assert load_hidden_states(path, storage_options=backend.storage_options)["hidden_states"].shape == (3, 3, 32)


def test_custom_path_is_ignored_with_a_warning_when_not_allowed(backend, tmp_path, connector_factory, caplog):
    connector = connector_factory(backend.root, make_spec(), storage_options=backend.storage_options)
    inside = backend.url("custom/wanted.safetensors")
    escaping = str(tmp_path / "outside" / "escape.safetensors")
    with caplog.at_level(logging.WARNING, logger="connectors.example_hidden_states_connector"):
        first = write_one(connector, "req-a", {"hidden_states_path": inside})
        second = write_one(connector, "req-b", {"hidden_states_path": escaping})
    assert connector.wait_for_save() == {}

    assert backend.key(first) == backend.key(backend.url("req-a.safetensors"))
    assert backend.key(second) == backend.key(backend.url("req-b.safetensors"))
    assert not backend.exists(inside) and not os.path.exists(escaping)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "req-a" in warnings[0] and inside in warnings[0] and "allow_custom_save_path" in warnings[0]
    assert "req-b" in warnings[1] and escaping in warnings[1]


ODD_REQUEST_IDS = ["a/b", "a_b", "../../etc/passwd", "..", ".", "", ".hidden", "/abs/olute", "a\\b", "héllo",
                   "日本語-🚀", "x" * 500, "x" * 501, "a\x00b", "a\nb", "req 1", "cmpl-123_0-ab"]


def test_request_ids_of_any_shape_become_safe_distinct_names_inside_the_root(backend, connector_factory):
    connector = connector_factory(backend.root, make_spec(), storage_options=backend.storage_options)
    paths = {rid: write_one(connector, rid, num_tokens=1 + i) for i, rid in enumerate(ODD_REQUEST_IDS)}
    assert connector.wait_for_save() == {}

    root_key = backend.key(backend.root)
    keys = {rid: backend.key(p) for rid, p in paths.items()}
    assert len(set(keys.values())) == len(ODD_REQUEST_IDS)  # distinct
    for rid, key in keys.items():
        parent, name = key.rsplit("/", 1)
        assert parent == root_key, (rid, key)
        assert SAFE_NAME.fullmatch(name) and not name.startswith(".") and len(name) <= 160, (rid, name)
    assert paths["cmpl-123_0-ab"].endswith("/cmpl-123_0-ab.safetensors")  # safe ids are kept as they are
    for i, rid in enumerate(ODD_REQUEST_IDS):  # each file holds its own request
        got = load_hidden_states(paths[rid], storage_options=backend.storage_options)
        assert got["token_ids"].shape == (1 + i,)
    stored = {k for k in backend.files() if k.startswith(root_key + "/")}
    assert stored == set(keys.values())


def test_paths_too_long_for_the_storage_are_refused_and_the_longest_allowed_is_written(backend, tmp_path,
                                                                                       connector_factory):
    """A name the storage cannot hold is a clear refusal before anything is written, not a write error later."""
    connector = connector_factory(backend.root, make_spec(), storage_options=backend.storage_options,
                                  allow_custom_save_path=True)
    suffix = ".safetensors"
    if backend.name == "local":  # a file name: 255 bytes less the writer's temporary .<name>.tmp-<32 hex>
        longest, too_long = "n" * (217 - len(suffix)) + suffix, "n" * (218 - len(suffix)) + suffix
        with pytest.raises(PathRejected, match="a folder name 255"):
            connector.start_request(RequestInfo("deep", 3, {"hidden_states_path": "d" * 256 + "/x" + suffix}))
    elif backend.name in ("s3", "gs"):  # a key after the bucket: 1024 bytes less its 5-byte .lock
        prefix = backend.url("").split("://", 1)[1].partition("/")[2]  # the root's key prefix, "run/..."
        longest = "k" * (1019 - len(prefix) - len(suffix)) + suffix
        too_long = "k" + longest
    else:
        longest, too_long = "k" * 500 + suffix, "k" * 1100 + suffix
    assert_rejected_and_nothing_written(connector, backend, tmp_path, too_long)
    with pytest.raises(PathRejected, match="too long for an? (file system|object store)"):
        connector.start_request(RequestInfo("long", 3, {"hidden_states_path": too_long}))
    path = write_one(connector, "longest", {"hidden_states_path": longest})
    assert connector.wait_for_save() == {}
    assert load_hidden_states(path, storage_options=backend.storage_options)["hidden_states"].shape == (3, 3, 32)
