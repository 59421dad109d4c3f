"""The sample registry: one small Ray actor that decides, per record, "extract", "skip" or "duplicate".

    SampleRegistry(done_ids)          ids with an "ok" manifest row (from the resume)
    claim(ids, sources) -> [verdict]  None = extract it; "skip" = already committed; an error text = duplicate id
    stats() -> {"skipped", "duplicates"}

Read tasks call it once per block, before tokenization. Claims are idempotent per (id, source): when Ray re-runs a
read task (its worker died), its records are claimed again by the same source and are not mistaken for duplicates.
A record whose id was claimed by another source is a duplicate and fails — two records writing one file would make
the manifest lie. Memory: a 16-byte digest plus a source string per claimed id.

Why an actor and not a Ray Data operator: the check is global (any two files may share an id) and streaming; Ray
Data's global operators (groupby, unique) materialise the whole corpus first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

SKIP = "skip"


def _digest(sample_id: str) -> bytes:
    return hashlib.blake2b(sample_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class SampleRegistry:
    def __init__(self, done_ids: Iterable[str] = ()) -> None:
        self._done = {_digest(i) for i in done_ids}
        self._claimed: dict[bytes, str] = {}
        self._skipped = 0
        self._duplicates = 0

    def claim(self, ids: list[str], sources: list[str]) -> list[str | None]:
        verdicts: list[str | None] = []
        for sample_id, source in zip(ids, sources):
            key = _digest(sample_id)
            if key in self._done:
                self._skipped += 1
                verdicts.append(SKIP)
                continue
            first = self._claimed.setdefault(key, source)
            if first == source:
                verdicts.append(None)
            else:
                self._duplicates += 1
                verdicts.append(f"{source}: duplicate sample id {sample_id!r} (first seen at {first}); sample ids "
                                "must be unique — fix the corpus or choose another --id-field")
        return verdicts

    def stats(self) -> dict[str, int]:
        return {"skipped": self._skipped, "duplicates": self._duplicates, "claimed": len(self._claimed)}
