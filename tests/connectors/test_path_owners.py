"""connectors.paths.PathOwners' bound on remembered files (max_remembered), which keeps a long-lived server's memory
flat (the vLLM plug-in's scheduler, issue 63); without a bound nothing is ever forgotten unasked."""

from __future__ import annotations

import pytest

from connectors.paths import Destination, PathInUse, PathOwners


def _dest(name: str) -> Destination:
    return Destination(f"s3://bucket/{name}.safetensors", None)


def _commit(owners: PathOwners, name: str) -> None:
    owners.claim(_dest(name), f"req-{name}", overwrite=False)
    owners.release(_dest(name), f"req-{name}", committed=True)


def test_past_max_remembered_the_oldest_committed_file_is_forgotten_and_the_newer_stay_owned():
    owners = PathOwners(max_remembered=3)
    for name in "abcde":
        _commit(owners, name)
    assert owners.num_remembered == 3
    owners.claim(_dest("a"), "later", overwrite=False)  # forgotten: as if it had existed before
    for name in "cde":
        with pytest.raises(PathInUse, match="was written earlier"):
            owners.claim(_dest(name), "later", overwrite=False)


def test_forgetting_a_remembered_file_frees_it_and_its_slot():
    owners = PathOwners(max_remembered=2)
    _commit(owners, "a")
    _commit(owners, "b")
    owners.forget(_dest("a").path)
    _commit(owners, "c")  # no eviction needed: b is still owned
    assert owners.num_remembered == 2
    with pytest.raises(PathInUse):
        owners.claim(_dest("b"), "later", overwrite=False)


def test_without_a_bound_every_committed_file_is_remembered():
    owners = PathOwners()
    for i in range(100):
        _commit(owners, str(i))
    assert owners.num_remembered == 100


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError, match="max_remembered"):
        PathOwners(max_remembered=-1)
