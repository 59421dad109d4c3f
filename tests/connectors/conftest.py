"""Connector fixtures: the storage backends of the contract suite, the local GCS emulator, connector factories.

`backend` is parametrised over local disk, memory://, s3:// (the loopback moto server from tests/conftest.py) and
gs:// (gcp-storage-emulator on loopback); every test that takes it runs once per backend. A `Backend` knows where
the connector should write and gives the test an independent view of the store to check what really happened.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import fsspec
import pytest
import torch

from connectors import KVTransferConfig
from connectors.format import HiddenStatesSpec

# gcsfs reads this once, when it is imported; with its experimental default every call against the emulator
# waits out a 60 s timeout. Must be set before anything imports gcsfs.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

LOCK_SUFFIX = ".lock"


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[str]:
    """gcp-storage-emulator on loopback (in memory). Yields its endpoint URL."""
    if "gcsfs" in sys.modules and os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"].lower() not in ("false", "0"):
        pytest.skip("gcsfs was imported with GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT on; against the emulator every call "
                    "would wait 60 s. Run with GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false")
    emulator = pytest.importorskip("gcp_storage_emulator.server", reason="pip install gcp-storage-emulator")
    pytest.importorskip("gcsfs", reason="pip install gcsfs")
    server = emulator.create_server("127.0.0.1", 0, in_memory=True)
    server.start()
    httpd = server._api._httpd
    # clients that close early (HEAD-like probes) make the emulator print BrokenPipe tracebacks; they are noise
    httpd.handle_error = lambda request, client_address: None
    host, port = httpd.server_address[:2]
    yield f"http://{host}:{port}"
    server.stop()


def _bucket_name(request) -> str:
    stem = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    return f"{stem or 'hsx'}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def gcs_bucket(gcs_server, request) -> tuple[str, dict]:
    """A fresh bucket on the emulator: (url "gs://bucket", storage_options for fsspec)."""
    import gcsfs

    options = {"token": "anon", "endpoint_url": gcs_server}
    gcsfs.GCSFileSystem(skip_instance_cache=True, **options).mkdir(name := _bucket_name(request))
    return f"gs://{name}", options


@dataclass
class Backend:
    """One storage backend: where a connector writes, and an independent view of the store for checks."""

    name: str
    root: str
    """The connector's shared_storage_path: a local folder or a URL."""
    storage_options: dict
    fs: fsspec.AbstractFileSystem
    """A filesystem of our own on the same store, to look at what was written."""
    endpoint: str | None = None
    """The HTTP endpoint of a remote store (None for local disk and memory)."""
    scope: str = ""
    """What `files()` lists: a local folder, a memory prefix, or "" for every bucket on the server."""
    extra_scopes: list[str] = field(default_factory=list)

    @property
    def remote(self) -> bool:
        return self.endpoint is not None

    def key(self, url: str) -> str:
        """The filesystem path of `url`."""
        return url if self.name == "local" else self.fs._strip_protocol(url)

    def url(self, relative: str) -> str:
        return f"{self.root}/{relative}"

    def files(self) -> dict[str, int]:
        """Every file the store holds within reach of the test (all buckets on a server), with sizes."""
        if self.name == "local":
            out = {}
            for scope in [self.scope, *self.extra_scopes]:
                for dirpath, _, names in os.walk(scope):
                    for n in names:
                        p = os.path.join(dirpath, n)
                        out[p] = os.lstat(p).st_size
            return out
        self.fs.invalidate_cache()
        if self.name == "memory":
            store = type(self.fs).store
            return {k: len(v.getvalue()) for k, v in list(store.items())}
        out = {}
        for bucket in self.fs.ls(""):
            for path, info in self.fs.find(bucket.rstrip("/"), detail=True).items():
                out[path] = info["size"]
        return out

    def options_via(self, endpoint: str) -> dict:
        """Storage options that reach the same store through another HTTP endpoint (a proxy)."""
        if self.name == "s3":
            return {"client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True}
        if self.name == "gs":
            return {"token": "anon", "endpoint_url": endpoint, "skip_instance_cache": True}
        raise ValueError(f"{self.name} has no HTTP endpoint")

    def put(self, url: str, data: bytes) -> None:
        if self.name == "local":
            os.makedirs(os.path.dirname(url), exist_ok=True)
            with open(url, "wb") as f:
                f.write(data)
        else:
            self.fs.pipe_file(self.key(url), data)

    def exists(self, url: str) -> bool:
        self.fs.invalidate_cache()
        return self.fs.exists(self.key(url))

    @contextlib.contextmanager
    def writer_holding_lock(self, url: str) -> Iterator[None]:
        """Play a writer that is busy with `url`, as vLLM's writer and ours signal it: on a local disk an exclusive
        flock on <url>.lock, on an object store the lock object's existence. Released (and removed) on exit."""
        lock = url + LOCK_SUFFIX
        if self.name == "local":
            os.makedirs(os.path.dirname(lock), exist_ok=True)
            fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(lock)
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            return
        self.fs.pipe_file(self.key(lock), b'{"pid": 0}')
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.key(lock))


def _local_backend(tmp_path) -> Backend:
    return Backend("local", str(tmp_path / "store" / "run"), {}, fsspec.filesystem("file"),
                   scope=str(tmp_path))


def _memory_backend() -> Backend:
    fs = fsspec.filesystem("memory")
    prefix = f"hsx-{uuid.uuid4().hex[:10]}"
    return Backend("memory", f"memory://{prefix}/run", {}, fs, scope=prefix)


def _s3_backend(request) -> Backend:
    import s3fs

    # the connector, the reader and the checks share fsspec's cached client for the endpoint, as real use does;
    # a fresh client per test (what the shared `s3_bucket` fixture gives) costs ~0.3-1 s each on two cores
    options = {"client_kwargs": {"endpoint_url": request.getfixturevalue("s3_server")}}
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir(name := _bucket_name(request))
    return Backend("s3", f"s3://{name}/run", options, fs, endpoint=options["client_kwargs"]["endpoint_url"])


def _gs_backend(request) -> Backend:
    import gcsfs

    url, options = request.getfixturevalue("gcs_bucket")
    fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **options)
    return Backend("gs", f"{url}/run", options, fs, endpoint=options["endpoint_url"])


def _make_backend(name: str, request, tmp_path) -> Backend:
    if name == "local":
        return _local_backend(tmp_path)
    if name == "memory":
        return _memory_backend()
    if name == "s3":
        return _s3_backend(request)
    return _gs_backend(request)


_S3 = pytest.param("s3", marks=pytest.mark.s3)
_GS = pytest.param("gs", marks=pytest.mark.gcs)


@pytest.fixture(params=["local", "memory", _S3, _GS])
def backend(request, tmp_path) -> Backend:
    """Each storage backend in turn; the contract suite runs against all of them."""
    return _make_backend(request.param, request, tmp_path)


@pytest.fixture(params=["memory", _S3, _GS])
def object_store(request, tmp_path) -> Backend:
    """The backends that are object stores (keys, not directories)."""
    return _make_backend(request.param, request, tmp_path)


@pytest.fixture(params=[_S3, _GS])
def remote_backend(request, tmp_path) -> Backend:
    """The backends behind an HTTP endpoint."""
    return _make_backend(request.param, request, tmp_path)


def make_spec(dtype: torch.dtype = torch.float32, layer_ids=(2, 4, 6), hidden_size: int = 32,
              num_hidden_layers: int = 8) -> HiddenStatesSpec:
    return HiddenStatesSpec(layer_ids=tuple(layer_ids), num_hidden_layers=num_hidden_layers, hidden_size=hidden_size,
                            dtype=str(dtype).removeprefix("torch."), model="tiny/test-model", model_revision="abc123")


@pytest.fixture
def connector_factory():
    """make(root, spec, storage_options=..., **extra_config) -> a connector, shut down after the test."""
    made = []

    def make(root: str, spec: HiddenStatesSpec | None = None, **extra):
        cfg = KVTransferConfig(kv_connector="ExampleHiddenStatesConnector",
                               kv_connector_extra_config={"shared_storage_path": root, **extra})
        connector = cfg.create_connector(spec or make_spec())
        made.append(connector)
        return connector

    yield make
    for connector in made:
        connector.shutdown()
