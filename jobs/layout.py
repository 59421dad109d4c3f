"""The output layout of a run, and small atomic writes into it.

    OUTPUT/run.json                                    what produced the run (see runinfo.py)
    OUTPUT/data/<2 hex>/<safe sample id>.safetensors   one file per sample; 256 sub-folders (sha1 of the id)
    OUTPUT/manifest/part-<attempt>-<seq>.parquet       the manifest, one part per commit (see manifest.py)

`Output` opens the root once (local folder or any fsspec URL) and writes whole small files atomically: a temp file in
the same folder renamed into place on local disks, a single put on object stores (an object appears only once
complete). Names starting with "." are temp files; readers (pyarrow datasets included) skip them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import uuid

from connectors import storage
from connectors.paths import FILE_SUFFIX, safe_file_stem

RUN_JSON = "run.json"
DATA_DIR = "data"
MANIFEST_DIR = "manifest"
_ATOMIC_PUT_PROTOCOLS = {"s3", "s3a", "gcs", "gs", "memory", "az", "abfs", "abfss", "adl"}


def data_path(sample_id: str) -> str:
    """A sample's file, relative to the output root: data/<first 2 hex of sha1(id)>/<safe id>.safetensors."""
    shard = hashlib.sha1(str(sample_id).encode("utf-8", "surrogatepass")).hexdigest()[:2]
    return f"{DATA_DIR}/{shard}/{safe_file_stem(sample_id)}{FILE_SUFFIX}"


class Output:
    """An output root: resolves relative paths to URLs and writes small files atomically."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        if not url:
            raise ValueError("--output is required: a local folder or a URL such as s3://bucket/run")
        self.storage_options = dict(storage_options or {})
        self.fs, root = storage.open_url(url, self.storage_options)
        self.local = storage.is_local(self.fs)
        self.root = os.path.abspath(root) if self.local else root.rstrip("/")
        self.url = self.root if self.local else self.fs.unstrip_protocol(self.root)

    def path(self, rel: str) -> str:
        """Protocol-less path for this filesystem."""
        return posixpath.join(self.root, rel)

    def url_of(self, rel: str) -> str:
        """URL of `rel` that storage.open_url maps back here (plain path for local roots)."""
        return self.path(rel) if self.local else self.fs.unstrip_protocol(self.path(rel))

    def exists(self, rel: str) -> bool:
        self.fs.invalidate_cache(self.path(rel))
        return self.fs.exists(self.path(rel))

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def put_atomic(self, rel: str, data: bytes) -> None:
        """Write `rel` so that readers see the old state or the whole new file, never a partial one."""
        path = self.path(rel)
        parent = posixpath.dirname(path)
        if self.local:
            os.makedirs(parent, exist_ok=True)
            tmp = posixpath.join(parent, f".{posixpath.basename(path)}.tmp-{uuid.uuid4().hex}")
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(tmp)
            return
        protocols = {self.fs.protocol} if isinstance(self.fs.protocol, str) else set(self.fs.protocol)
        if protocols & _ATOMIC_PUT_PROTOCOLS:
            self.fs.pipe_file(path, data)
            return
        self.fs.makedirs(parent, exist_ok=True)
        tmp = posixpath.join(parent, f".{posixpath.basename(path)}.tmp-{uuid.uuid4().hex}")
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, path)

    def list(self, rel: str) -> list[str]:
        """Names directly under `rel` (not starting with "."), or [] when it does not exist."""
        path = self.path(rel)
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        names = [posixpath.basename(e.rstrip("/")) for e in entries]
        return sorted(n for n in names if not n.startswith("."))
