"""The sample registry: which records to extract, skip (committed) or fail (duplicate id), in memory that holds
16 bytes per id — never the id strings — split over a few Ray actors.

    id_keys(ids) -> uint64 [n]           what the registry keeps of an id: its xxh3_64 (0 mapped to 1)
    DoneSet.load(run)                    the settled ids' keys, sorted (the driver's resume set): len, contains
    ClaimTable                           sorted runs of (key, packed source), 16 bytes an entry, and a small hash
                                         buffer for new keys
    SampleRegistry(done_keys)            one actor per shard (key % shards): claim(keys, sources) -> [verdict]
    start_registry(done, shards)         the shard actors; claim_block(shards, ids, sources) from a read task

A verdict is None (extract it), SKIP (already committed) or an error text (a duplicate id). Read tasks claim once per
block, one call per shard. Claims are idempotent per (id, source): when Ray re-runs a read task (its worker died),
its records are claimed again by the same source and are not mistaken for duplicates. A record whose id another
source claimed is a duplicate and fails — two records writing one file would make the manifest lie.

Memory: a source "corpus/file.jsonl:123" (or "...parquet#45") is kept as (the file's index, the line), packed in 8
bytes; the file names once per shard. A shard holds 16 bytes per id it owns plus a constant (a 1 MB buffer, merges
of at most 8 MB): 16 MB per million ids over all shards, 4 MB in each of 4 (benchmarks/bench_registry.py). An open-
addressing table of the same entries held 16-32 bytes an id and, while doubling, both copies. Keys are 64-bit
hashes: two ids of a 10M-id run share one with a probability of about 3 in a million (n^2 / 2^65) — the second
would be skipped or failed as a duplicate; the manifest, which keeps the ids, stays exact.

Why actors and not a Ray Data operator: the check is global (any two files may share an id) and streaming; Ray
Data's global operators (groupby, unique) materialise the whole corpus first.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

SKIP = "skip"
DEFAULT_SHARDS = 4
_DONE = np.uint64(2**64 - 1)
"""The packed source of a committed id (no real source packs to it)."""
_LINE_BITS = 40
_NO_LINE = (1 << _LINE_BITS) - 1
_SOURCE_RE = re.compile(r"^(.*[:#])(\d{1,12})$")


def id_keys(ids: Iterable[str]) -> np.ndarray:
    """uint64 [n]: each id's xxh3_64 (of its UTF-8, lone surrogates kept), 0 mapped to 1 (0 marks an empty slot)."""
    keys = np.fromiter((xxhash.xxh3_64_intdigest(i.encode("utf-8", "surrogatepass")) for i in ids), dtype=np.uint64)
    keys[keys == 0] = 1
    return keys


def sorted_unique(keys: np.ndarray) -> np.ndarray:
    """The distinct keys, sorted (a sort and a compare: numpy's own unique hashes first, ten times slower here)."""
    keys = np.sort(np.asarray(keys, dtype=np.uint64))
    if len(keys) > 1:
        keys = keys[np.concatenate(([True], keys[1:] != keys[:-1]))]
    return keys


class DoneSet:
    """The keys of the sample ids a resume skips, sorted: 8 bytes an id in the driver."""

    def __init__(self, keys: np.ndarray | None = None) -> None:
        self.keys = sorted_unique(keys) if keys is not None and len(keys) else np.zeros(0, dtype=np.uint64)

    @classmethod
    def load(cls, run, *, retry_failed: bool = False) -> DoneSet:
        """The ids a resume of `run` skips (connectors.manifest.settled_rows: committed, skipped for good, or failing the
        same way every time unless `retry_failed`), hashed a slice at a time: the id strings are never all held."""
        from connectors.manifest import SETTLED_COLUMNS, read_manifest, settled_rows  # pyarrow: not in the shard actors

        ids = settled_rows(read_manifest(run, columns=list(SETTLED_COLUMNS)), retry_failed=retry_failed)["sample_id"]
        step = 1 << 16
        return cls(np.concatenate([np.zeros(0, dtype=np.uint64), *(
            id_keys(ids.slice(start, step).to_pylist()) for start in range(0, len(ids), step))]))

    def __len__(self) -> int:
        return len(self.keys)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """bool [n]: which keys are committed."""
        if not len(self.keys):
            return np.zeros(len(keys), dtype=bool)
        at = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        return self.keys[at] == keys


class _HashTable:
    """key -> value (uint64, value 0 = none) by linear probing over numpy arrays, of a fixed size: ClaimTable's buffer
    (it starts a new one before this one passes MAX_LOAD)."""

    MAX_LOAD = 0.75

    def __init__(self, capacity: int = 1 << 12) -> None:
        size = 1 << max(4, int(capacity - 1).bit_length())
        self._keys = np.zeros(size, dtype=np.uint64)
        self._vals = np.zeros(size, dtype=np.uint64)
        self.count = 0

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._vals.nbytes

    def _probe(self, keys: np.ndarray, vals: np.ndarray) -> np.ndarray:
        """Distinct keys: find or insert each; [n] the value found (0 when inserted)."""
        mask = np.uint64(len(self._keys) - 1)
        slots = keys & mask
        found = np.zeros(len(keys), dtype=np.uint64)
        todo = np.arange(len(keys))
        while len(todo):
            s = slots[todo]
            cur = self._keys[s]
            hit = cur == keys[todo]
            found[todo[hit]] = self._vals[s[hit]]
            empty = np.flatnonzero(cur == 0)
            _, win = np.unique(s[empty], return_index=True)  # one key per empty slot this round
            won = todo[empty[win]]
            self._keys[slots[won]] = keys[won]
            self._vals[slots[won]] = vals[won]
            self.count += len(won)
            settled = hit.copy()
            settled[empty[win]] = True
            todo = todo[~settled]  # their slot holds another key (or another took it this round): the next one
            slots[todo] = (slots[todo] + np.uint64(1)) & mask
        return found


class ClaimTable:
    """key -> value (uint64, nonzero), claimed a batch at a time: new keys go into a small hash table; when it is
    3/4 full its entries become a sorted run (two parallel arrays, 16 bytes an entry, no empty slots), and runs of
    similar size are merged up to `run_cap` entries. A key lives in exactly one place; a lookup is a binary search
    of each run and a probe of the buffer. Memory: 16 bytes a key, plus a constant (the buffer, and a merge's
    temporary arrays of at most `run_cap` entries) — no doubling of one big table, whose peak holds both copies."""

    def __init__(self, keys: np.ndarray | None = None, vals: np.ndarray | None = None, *,
                 buffer_slots: int = 1 << 16, run_cap: int = 1 << 19) -> None:
        """`keys`/`vals`: distinct keys to start with (one run; kept as given when already sorted, as a resume's are)."""
        self.buffer_slots, self.run_cap = buffer_slots, run_cap
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []
        self._buffer = _HashTable(buffer_slots)
        if keys is not None and len(keys):
            if not bool((keys[1:] > keys[:-1]).all()):
                order = np.argsort(keys, kind="stable")
                keys, vals = keys[order], vals[order]
            self.runs.append((keys, vals))

    @property
    def count(self) -> int:
        return sum(len(k) for k, _ in self.runs) + self._buffer.count

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.runs) + self._buffer.nbytes

    def claim(self, keys: np.ndarray, vals: np.ndarray) -> np.ndarray:
        """For each key: the value it already had (the first claim's), or 0 when this call put it in with its own
        value. Within one call the first occurrence of a key claims it; later ones get that value back."""
        unique, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        if self._buffer.count + len(unique) > _HashTable.MAX_LOAD * len(self._buffer._keys):
            self._flush(len(unique))  # before the lookups: the buffer's keys move into the runs
        before = np.zeros(len(unique), dtype=np.uint64)
        pending = np.ones(len(unique), dtype=bool)
        for run_keys, run_vals in self.runs:
            at = np.minimum(np.searchsorted(run_keys, unique), len(run_keys) - 1)
            hit = pending & (run_keys[at] == unique)
            before[hit] = run_vals[at[hit]]
            pending &= ~hit
        rest = np.flatnonzero(pending)
        if len(rest):
            before[rest] = self._buffer._probe(unique[rest], vals[first][rest])
        out = before[inverse]
        later = np.ones(len(keys), dtype=bool)
        later[first] = False  # a repeat within this call sees the first occurrence's value when that was new
        fresh_then = later & (out == 0)
        out[fresh_then] = vals[first][inverse][fresh_then]
        return out

    def _flush(self, incoming: int) -> None:
        """The buffer's entries as a new sorted run (merged with the last runs while they are of similar size and
        the merge stays within run_cap); a fresh buffer with room for `incoming` keys."""
        table = self._buffer
        used = table._keys != 0
        if used.any():
            keys, vals = table._keys[used], table._vals[used]
            order = np.argsort(keys)
            self.runs.append((keys[order], vals[order]))
        self._buffer = _HashTable(max(self.buffer_slots, int(incoming / _HashTable.MAX_LOAD) + 1))
        while len(self.runs) >= 2:
            (k1, v1), (k2, v2) = self.runs[-2], self.runs[-1]
            if len(k1) + len(k2) > self.run_cap or len(k1) > 2 * len(k2):
                break
            keys, vals = np.concatenate([k1, k2]), np.concatenate([v1, v2])
            order = np.argsort(keys, kind="stable")
            self.runs[-2:] = [(keys[order], vals[order])]


class SampleRegistry:
    """One shard of the registry (a Ray actor): the ids whose key % shards is its own."""

    def __init__(self, done_keys: np.ndarray | Sequence[str] = ()) -> None:
        done = sorted_unique(done_keys if isinstance(done_keys, np.ndarray) else id_keys(done_keys))
        self._table = ClaimTable(done, np.full(len(done), _DONE, dtype=np.uint64))
        self._files: dict[str, int] = {}
        self._names: list[str] = []
        self._skipped = 0
        self._duplicates = 0
        self._done = len(done)

    def claim(self, keys: np.ndarray | Sequence[str], sources: Sequence[str],
              ids: Sequence[str] | None = None) -> list[str | None]:
        """Verdicts for records with these keys (or ids) found at `sources`; `ids` name duplicates in messages."""
        if not isinstance(keys, np.ndarray):
            ids, keys = list(keys), id_keys(keys)
        packed = np.fromiter((self._pack(s) for s in sources), dtype=np.uint64, count=len(sources))
        before = self._table.claim(keys, packed)
        verdicts: list[str | None] = []
        for i, (was, mine) in enumerate(zip(before.tolist(), packed.tolist())):
            if was == _DONE:
                self._skipped += 1
                verdicts.append(SKIP)
            elif was == 0 or was == mine:
                verdicts.append(None)
            else:
                self._duplicates += 1
                name = repr(ids[i]) if ids is not None else "of this record"
                verdicts.append(f"{sources[i]}: duplicate sample id {name} (first seen at {self._unpack(was)}); "
                                "sample ids must be unique — fix the corpus or choose another --id-field")
        return verdicts

    def stats(self) -> dict[str, int]:
        return {"skipped": self._skipped, "duplicates": self._duplicates,
                "claimed": self._table.count - self._done, "table_bytes": self._table.nbytes}

    def _pack(self, source: str) -> int:
        m = _SOURCE_RE.match(source)
        prefix, line = (m.group(1), int(m.group(2))) if m and int(m.group(2)) < _NO_LINE else (source, _NO_LINE)
        index = self._files.get(prefix)
        if index is None:
            index = self._files[prefix] = len(self._names)
            self._names.append(prefix)
        return ((index + 1) << _LINE_BITS) | line

    def _unpack(self, packed: int) -> str:
        prefix = self._names[(packed >> _LINE_BITS) - 1]
        line = packed & _NO_LINE
        return prefix if line == _NO_LINE else f"{prefix}{line}"


def start_registry(done: DoneSet, shards: int = DEFAULT_SHARDS) -> list:
    """The shard actors (no CPU reserved), each given the committed keys it owns, on the driver's node: the job
    outlives any other node (a lost worker node costs only its unfinished samples), and a shard's claims cannot be
    rebuilt elsewhere."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(num_cpus=0, scheduling_strategy=here)(SampleRegistry)
    n = np.uint64(shards)
    return [actor.remote(done.keys[done.keys % n == np.uint64(i)]) for i in range(shards)]


def claim_block(shards: list, ids: Sequence[str], sources: Sequence[str]) -> list[str | None]:
    """A read task's claim of one block: keys hashed here, one call per shard, verdicts in the records' order."""
    import ray

    keys = id_keys(ids)
    which = (keys % np.uint64(len(shards))).astype(np.int64)
    calls = []
    for i, shard in enumerate(shards):
        mine = np.flatnonzero(which == i)
        if len(mine):
            calls.append((mine, shard.claim.remote(keys[mine], [sources[j] for j in mine], [ids[j] for j in mine])))
    verdicts: list[str | None] = [None] * len(ids)
    for mine, ref in calls:
        for j, verdict in zip(mine.tolist(), ray.get(ref)):
            verdicts[j] = verdict
    return verdicts
