"""The sample registry's table (issue 26): claims against a plain dict as the oracle, duplicate ids named with the
first source, re-run read tasks idempotent, committed ids skipped, and memory of 16 bytes per id held (plus a buffer)."""

from __future__ import annotations

import random

import numpy as np

from corpus.sample_registry import SKIP, ClaimTable, DoneSet, SampleRegistry, id_keys


def test_the_claim_table_agrees_with_a_dict_through_flushes_merges_collisions_and_repeats():
    rng = random.Random(0)
    start = np.array([5, 3001, 7], dtype=np.uint64)  # keys it starts with (a resume's committed ones)
    table = ClaimTable(start, np.array([1, 2, 3], dtype=np.uint64), buffer_slots=64, run_cap=1024)
    oracle = {5: 1, 3001: 2, 7: 3}
    for _ in range(60):
        n = rng.randint(1, 400)
        # a small key space: repeats within a batch and across batches, and many probe collisions
        keys = np.array([rng.randint(1, 3000) for _ in range(n)], dtype=np.uint64)
        vals = np.array([rng.randint(1, 9) for _ in range(n)], dtype=np.uint64)
        want = []  # a key's first claim (in this call or before) gets 0, every later one the first claim's value
        for k, v in zip(keys.tolist(), vals.tolist()):
            want.append(oracle.get(k, 0))
            oracle.setdefault(k, v)
        assert table.claim(keys, vals).tolist() == want
    assert table.count == len(oracle)
    sizes = [len(k) for k, _ in table.runs]
    assert len(sizes) > 2 and max(sizes) > 64 and max(sizes) <= 1024  # flushed into runs, merged, within the cap
    assert all(bool((np.diff(k.astype(np.int64)) > 0).all()) for k, _ in table.runs)  # each run sorted, distinct
    assert len(set(np.concatenate([k for k, _ in table.runs]).tolist())) == sum(sizes)  # a key in one run only
    keys = np.array(sorted(oracle), dtype=np.uint64)
    assert table.claim(keys, np.full(len(keys), 99, dtype=np.uint64)).tolist() == [oracle[k] for k in keys.tolist()]


def test_duplicates_are_named_with_the_first_source_and_re_runs_of_a_read_task_are_not_duplicates():
    registry = SampleRegistry(["done-1"])
    ids = ["a", "b", "done-1", "a"]
    sources = ["c/x.jsonl:1", "c/x.jsonl:2", "c/x.jsonl:3", "c/y.parquet#7"]
    verdicts = registry.claim(ids, sources)
    assert verdicts[:3] == [None, None, SKIP]
    assert verdicts[3].startswith("c/y.parquet#7: duplicate sample id 'a' (first seen at c/x.jsonl:1)")
    assert registry.claim(["a", "b"], ["c/x.jsonl:1", "c/x.jsonl:2"]) == [None, None]  # the same read task again
    odd = registry.claim(["z", "z"], ["no-line-here", "other"])
    assert odd[0] is None and "first seen at no-line-here" in odd[1]
    assert registry.stats()["skipped"] == 1 and registry.stats()["duplicates"] == 2


def test_the_done_set_answers_membership_and_a_shard_holds_16_bytes_an_id_and_its_buffer():
    ids = [f"sample-{i}" for i in range(50_000)]
    done = DoneSet(id_keys(ids[::2]))
    assert len(done) == 25_000
    assert done.contains(id_keys(ids[:6])).tolist() == [True, False] * 3
    assert DoneSet().contains(id_keys(["x"])).tolist() == [False]
    registry = SampleRegistry(done.keys)
    registry.claim(id_keys(ids[1::2]), [f"f.jsonl:{i}" for i in range(25_000)])
    stats = registry.stats()
    assert stats["claimed"] == 25_000
    buffer = 16 * (1 << 16)
    assert 16 * 50_000 <= stats["table_bytes"] <= 16 * 50_000 + buffer  # the table alone: no strings per id
