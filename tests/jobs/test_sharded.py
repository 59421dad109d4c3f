"""`hsx run --layout sharded`: samples appended to shard objects, each sample's byte range in the manifest.

The oracle is the per-file layout (itself checked against a plain transformers forward in test_job.py): the same
corpus extracted both ways must give the same tensors (to float rounding: the two runs batch samples differently),
sample by sample, through every reader — load_hidden_states,
HiddenStatesDataset — and `hsx verify` must tell a damaged sample of a shard from its neighbours.
"""

from __future__ import annotations

import json
import os

import pytest
import safetensors.torch
import torch

from cli.args import EXIT_FAILED, EXIT_OK
from cli.main import main
from connectors import load_hidden_states
from connectors.manifest import ok_rows, read_manifest
from connectors.run import RunDir
from connectors.shards import SHARD_ALIGN, SHARD_DIR, SHARD_SUFFIX
from harness.corpora import word_corpus
from jobs.config import JobConfig
from jobs.pipeline import run_job
from jobs.runinfo import RunMismatch
from tests.jobs.test_job import assert_exactly_once
from training.dataset import HiddenStatesDataset
from training.export import export_run

pytestmark = [pytest.mark.ray]

SHARD_MB = 0.5  # about 650 tokens of the tiny model: a shard holds 10-30 of its samples


def _shards(run: RunDir) -> list[str]:
    run.fs.invalidate_cache()
    return sorted(p for p in run.fs.find(run.path(SHARD_DIR)) if p.endswith(SHARD_SUFFIX)) \
        if run.exists(SHARD_DIR) else []


def _job(tiny_llama, corpus, output, **kw) -> JobConfig:
    return JobConfig(model=tiny_llama, corpus=(corpus,), output=output, progress=False, **kw)


@pytest.fixture(scope="module")
def by_file(ray_cluster, tiny_llama, tmp_path_factory):
    """The oracle: the same corpus in the per-file layout."""
    tmp = tmp_path_factory.mktemp("by-file")
    corpus, ids = word_corpus(tmp, 40)
    output = str(tmp / "files")
    assert run_job(_job(tiny_llama, corpus, output)).ok == len(ids)
    return corpus, ids, output


@pytest.mark.parametrize("store", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_sharded_run_holds_the_per_file_runs_tensors_in_few_objects(store, by_file, tiny_llama, request,
                                                                       tmp_path):
    corpus, ids, files_run = by_file
    options = None
    if store == "s3":
        url, options = request.getfixturevalue("s3_bucket")
        # the workers of the session's Ray cluster do not inherit the test's credentials: pass them as options
        options = {**options, "key": os.environ["AWS_ACCESS_KEY_ID"], "secret": os.environ["AWS_SECRET_ACCESS_KEY"]}
        output = f"{url}/sharded"
    else:
        output = str(tmp_path / "sharded")
    result = run_job(_job(tiny_llama, corpus, output, layout="sharded", shard_mb=SHARD_MB,
                          storage_options=options or {}))
    assert (result.ok, result.failed) == (len(ids), 0)
    rows = assert_exactly_once(output, ids, options)
    run = RunDir(output, options or {})
    shards = _shards(run)
    assert 1 < len(shards) < len(ids) // 2, shards  # many samples per shard, and more than one shard
    assert not run.exists("data")  # no file per sample
    assert all(r["offset"] % SHARD_ALIGN == 0 for r in rows.values())
    for sid, row in rows.items():  # the same tensors as the per-file run's, read by range
        mine = load_hidden_states(run.url_of(row["path"]), byte_range=(row["offset"], row["bytes"]),
                                  storage_options=options, verify=True)
        theirs = load_hidden_states(os.path.join(files_run, _file_of(files_run, sid)))
        assert mine.keys() == theirs.keys()
        _same(mine, theirs, sid)
        part = load_hidden_states(run.url_of(row["path"]), byte_range=(row["offset"], row["bytes"]),
                                  storage_options=options, token_range=(1, 3), layer_indices=[0])
        assert torch.equal(part["hidden_states"], mine["hidden_states"][1:3, [0]])
    # the training feed reads the shards as it reads files: the same items, in the same order
    ds, oracle = HiddenStatesDataset(output, storage_options=options or {}), HiddenStatesDataset(files_run)
    assert len(ds) == len(oracle) and ds.sample_ids.to_pylist() == oracle.sample_ids.to_pylist()
    for i in range(len(ds)):
        _same(ds[i], oracle[i], i)
    assert list(ds.token_items()) and ds.byte_range(0) is not None
    # a finished run re-run: nothing to do, no shard written
    again = run_job(_job(tiny_llama, corpus, output, layout="sharded", shard_mb=SHARD_MB,
                         storage_options=options or {}))
    assert (again.ok, again.skipped) == (0, len(ids)) and _shards(run) == shards


def _same(mine: dict, theirs: dict, what) -> None:
    """Token ids and masks exactly; states to float32 rounding (the runs batch the samples differently, and a batched
    matmul's sums may round differently: a sample read from the wrong bytes would differ everywhere)."""
    for k, v in theirs.items():
        if not isinstance(v, torch.Tensor):
            assert mine[k] == v, (what, k)
        elif v.is_floating_point():
            torch.testing.assert_close(mine[k], v, rtol=1e-4, atol=1e-5, msg=f"{what} {k}: the states differ")
        else:
            assert torch.equal(mine[k], v), (what, k)


def _file_of(run: str, sid: str) -> str:
    table = read_manifest(run, ["sample_id", "path", "status"])
    return next(p for s, p, st in zip(*(table[c].to_pylist() for c in ("sample_id", "path", "status")))
                if s == sid and st == "ok")


def test_verify_marks_the_damaged_sample_of_a_shard_and_a_rerun_replaces_it_and_orphans_go(
        ray_cluster, tiny_llama, tmp_path, capsys):
    corpus, ids = word_corpus(tmp_path, 24)
    output = str(tmp_path / "sharded")
    config = _job(tiny_llama, corpus, output, layout="sharded", shard_mb=SHARD_MB)
    assert run_job(config).ok == len(ids)
    run_json = json.load(open(os.path.join(output, "run.json")))  # older hsx refuse version 3: shards are not files
    assert (run_json["format_version"], run_json["storage_layout"]) == ("3", "sharded")
    # an export reads each sample by its range: speculators' layout, one file per sample in dataset (id) order
    dest = str(tmp_path / "speculators")
    assert export_run(output, dest, "speculators").written == len(ids)
    for i, row in enumerate(ok_rows(output).to_pylist()):
        exported = safetensors.torch.load_file(os.path.join(dest, "hidden_states", f"hs_{i}.safetensors"))
        stored = load_hidden_states(os.path.join(output, row["path"]), byte_range=(row["offset"], row["bytes"]))
        assert torch.equal(exported["hidden_states"], stored["hidden_states"])
        assert torch.equal(exported["token_ids"], stored["token_ids"])
    assert main(["verify", output]) == EXIT_OK
    capsys.readouterr()
    main(["status", output])
    shards = len({r["path"] for r in ok_rows(output).to_pylist()})
    assert f"in {shards} shards (--layout sharded)" in capsys.readouterr().out
    rows = {r["sample_id"]: r for r in read_manifest(output).to_pylist()}
    victim = rows["k0007"]
    shard = os.path.join(output, victim["path"])
    with open(shard, "r+b") as f:  # a byte flipped near the end of k0007's range: its data, no one else's
        f.seek(victim["offset"] + victim["bytes"] - 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    # an orphan: a whole shard no row points into (its worker died before its rows were committed)
    orphan = os.path.join(os.path.dirname(shard), "0" * 32 + SHARD_SUFFIX)
    with open(shard, "rb") as src, open(orphan, "wb") as dst:
        dst.write(src.read())
    capsys.readouterr()
    assert main(["verify", output]) == EXIT_FAILED
    printed = capsys.readouterr().out
    assert f"checked {len(ids)} of {len(ids)} committed samples, 1 failed" in printed, printed
    again = run_job(config)  # extracts exactly the marked sample again, into a new shard; the orphan goes
    assert (again.ok, again.skipped) == (1, len(ids) - 1)
    assert not os.path.exists(orphan)
    assert main(["verify", output]) == EXIT_OK  # every committed sample, by its range: the new one and the others
    committed = {r["sample_id"]: r for r in ok_rows(output).to_pylist()}
    assert set(committed) == ids
    assert committed["k0007"]["path"] != victim["path"] and os.path.exists(shard)  # its neighbours stay where they were
    assert sum(r["path"] == victim["path"] for r in committed.values()) >= 1


def test_layout_flags_are_checked_and_a_run_keeps_its_layout(by_file, tiny_llama, tmp_path):
    files_corpus, _, files_run = by_file
    with pytest.raises(RunMismatch, match="storage_layout: run has 'files', this job has 'sharded' \\(--layout\\)"):
        run_job(_job(tiny_llama, files_corpus, files_run, layout="sharded"))
    assert json.load(open(os.path.join(files_run, "run.json")))["format_version"] == "2"
    corpus, _ = word_corpus(tmp_path, 2)
    with pytest.raises(ValueError, match="--layout 'shards' is not a layout; use files"):
        _job(tiny_llama, corpus, str(tmp_path / "o"), layout="shards")
    with pytest.raises(ValueError, match="--shard-mb must be > 0"):
        _job(tiny_llama, corpus, str(tmp_path / "o"), layout="sharded", shard_mb=0)
