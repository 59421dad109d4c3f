"""HiddenStatesDataset on local runs: items against the stored tensors and a transformers oracle, the EAGLE-3 split,
the final norm, manifest semantics (ok rows, resumes, a million rows without touching files), mixed runs refused."""

from __future__ import annotations

import json
import os
import shutil
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from connectors import HiddenStatesSpec, load_hidden_states
from connectors.manifest import write_manifest_part
from connectors.run import write_run_spec
from extractor.norm import FinalNorm
from harness.runs import random_samples, spec_run_json, write_manifest, write_run
from tests.training.conftest import ORACLE_LAYERS
from training.dataset import HiddenStatesDataset, read_run_info


def test_items_equal_the_stored_tensors(random_run):
    out, samples, spec = random_run
    ds = HiddenStatesDataset(out)
    assert len(ds) == len(samples)
    for i, s in enumerate(samples):  # sample ids sort in write order
        item = ds[i]
        assert item["sample_id"] == s.sample_id
        assert torch.equal(item["input_ids"], s.token_ids)
        assert item["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(item["hidden_states"], s.hidden_states)
        expected_mask = s.loss_mask.long() if s.loss_mask is not None else torch.ones(len(s.token_ids), dtype=torch.long)
        assert torch.equal(item["loss_mask"], expected_mask)
        stored = load_hidden_states(ds.path(i))
        assert torch.equal(item["hidden_states"], stored["hidden_states"])
        assert torch.equal(item["input_ids"], stored["token_ids"])


def test_items_match_a_plain_transformers_forward(oracle_run, oracle_model):
    out, samples, spec = oracle_run
    model, _ = oracle_model
    n = model.config.num_hidden_layers
    ds = HiddenStatesDataset(out)
    assert len(ds) == len(samples)
    for i in range(len(ds)):
        item = ds[i]
        with torch.no_grad():
            hf = model(item["input_ids"][None], output_hidden_states=True).hidden_states  # N+1 x [1, T, H]
            for j, layer_id in enumerate(ORACLE_LAYERS):
                got = item["hidden_states"][:, j]
                if layer_id < n:
                    torch.testing.assert_close(got, hf[layer_id][0], rtol=1e-5, atol=1e-5)
                else:  # id N is stored pre-norm; HF's hidden_states[N] is post-norm
                    torch.testing.assert_close(model.model.norm(got), hf[n][0], rtol=1e-5, atol=1e-5)
                    assert not torch.allclose(got, hf[n][0])


def test_eagle3_split_has_aux_layers_concatenated_in_stored_order_and_the_last_as_target(random_run):
    out, samples, spec = random_run
    ds = HiddenStatesDataset(out, layout="eagle3")
    h = spec.hidden_size
    for i, s in enumerate(samples):
        item = ds[i]
        t = len(s.token_ids)
        assert "hidden_states" not in item
        assert item["aux_hidden_states"].shape == (t, (len(spec.layer_ids) - 1) * h)
        assert item["target_hidden_states"].shape == (t, h)
        for j in range(len(spec.layer_ids) - 1):
            assert torch.equal(item["aux_hidden_states"][:, j * h:(j + 1) * h], s.hidden_states[:, j])
        assert torch.equal(item["target_hidden_states"], s.hidden_states[:, -1])


def test_final_norm_option_equals_the_models_own_norm(oracle_run, oracle_model, tiny_llama):
    out, samples, spec = oracle_run
    model, _ = oracle_model
    ds = HiddenStatesDataset(out, layout="eagle3", normalize_last_layer=True)  # model dir from the run's metadata
    raw = HiddenStatesDataset(out)
    for i in range(len(ds)):
        pre = raw[i]["hidden_states"][:, -1]
        with torch.no_grad():
            expected = model.model.norm(pre)
            post = model(raw[i]["input_ids"][None], output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(ds[i]["target_hidden_states"], expected, rtol=0, atol=0)
        torch.testing.assert_close(ds[i]["target_hidden_states"], post, rtol=1e-5, atol=1e-5)
        # aux layers untouched
        assert torch.equal(ds[i]["aux_hidden_states"], raw[i]["hidden_states"][:, :-1].flatten(1))
    # raw layout: only the last row is normalised
    normed = HiddenStatesDataset(out, normalize_last_layer=True, model_dir=tiny_llama)[0]["hidden_states"]
    assert torch.equal(normed[:, :-1], raw[0]["hidden_states"][:, :-1])
    torch.testing.assert_close(normed[:, -1], ds[0]["target_hidden_states"], rtol=0, atol=0)


def test_final_norm_on_a_bf16_run_matches_the_model_loaded_in_bf16(tmp_path, tiny_llama, oracle_model):
    import copy

    model, _ = oracle_model
    spec = HiddenStatesSpec(layer_ids=(1, 4), num_hidden_layers=4, hidden_size=model.config.hidden_size,
                            dtype="bfloat16", model=tiny_llama)
    samples = random_samples(3, spec, seed=5)
    write_run(str(tmp_path), samples, spec)
    ds = HiddenStatesDataset(str(tmp_path), layout="eagle3", normalize_last_layer=True)
    norm_bf16 = copy.deepcopy(model.model.norm).to(torch.bfloat16)
    for i, s in enumerate(samples):
        got = ds[i]["target_hidden_states"]
        assert got.dtype == torch.bfloat16
        with torch.no_grad():
            assert torch.equal(got, norm_bf16(s.hidden_states[:, -1]))


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_final_norm_of_other_families_equals_transformers(tiny_model_factory, family):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory(family)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    norm_module = model.transformer.ln_f if family == "gpt2" else model.model.norm
    x = torch.randn(7, model.config.hidden_size) * 3
    with torch.no_grad():
        torch.testing.assert_close(FinalNorm.from_model_dir(model_dir)(x), norm_module(x), rtol=1e-6, atol=1e-6)


def test_final_norm_refuses_unknown_models_and_missing_folders(tmp_path, random_run):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_family", "rms_norm_eps": 1e-6}))
    with pytest.raises(ValueError, match="cannot read this config.*no_such_family"):
        FinalNorm.from_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2", "rms_norm_eps": 1e-6}))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):  # Gemma-2's norm is found; no weights
        FinalNorm.from_model_dir(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="config.json"):
        FinalNorm.from_model_dir(str(tmp_path / "nowhere"))
    out, _, _ = random_run  # model "tiny/random" is no folder, and its last stored id is not N
    with pytest.raises(ValueError, match="last stored id is 6|not a local folder"):
        HiddenStatesDataset(out, normalize_last_layer=True)


def test_final_norm_needs_a_model_folder_when_the_run_names_none(tmp_path, oracle_run):
    out, samples, spec = oracle_run
    run2 = str(tmp_path / "run")
    remote = HiddenStatesSpec(**{**spec.__dict__, "model": "org/not-a-folder"})
    write_run(run2, samples[:2], remote, run_json=spec_run_json(remote))
    with pytest.raises(ValueError, match="Pass model_dir"):
        HiddenStatesDataset(run2, normalize_last_layer=True)
    ds = HiddenStatesDataset(run2, normalize_last_layer=True, model_dir=spec.model, layout="eagle3")
    assert ds[0]["target_hidden_states"].shape == (len(samples[0].token_ids), spec.hidden_size)


def test_only_ok_rows_count_and_a_resumed_sample_is_kept_once(tmp_path):
    spec = HiddenStatesSpec(layer_ids=(1, 2), num_hidden_layers=2, hidden_size=8, dtype="float32")
    samples = random_samples(5, spec, seed=3)
    failed = [{"sample_id": "zz-bad", "path": "", "num_tokens": 0, "num_prompt_tokens": 0, "status": "failed",
               "error": "tokenizer error", "bytes": 0}]
    rows = write_run(str(tmp_path), samples, spec, extra_rows=failed)
    # a resume wrote s00001 and s00003 again ("ok" twice) and s00002 failed once before it succeeded
    dupes = [dict(r) for r in rows if r["sample_id"] in ("s00001", "s00003")]
    retry = [{**rows[2], "status": "failed", "error": "worker died"}]
    write_manifest(str(tmp_path), retry + rows + dupes, parts=3)
    ds = HiddenStatesDataset(str(tmp_path))
    assert [ds.sample_id(i) for i in range(len(ds))] == [s.sample_id for s in samples]
    assert ds.num_tokens.tolist() == [len(s.token_ids) for s in samples]


def test_a_manifest_without_ok_rows_or_columns_is_refused_clearly(tmp_path):
    write_manifest(str(tmp_path), [{"sample_id": "a", "path": "x", "num_tokens": 1, "num_prompt_tokens": 1,
                                    "status": "failed", "error": "bad", "bytes": 0}])
    with pytest.raises(ValueError, match="none with status 'ok'"):
        HiddenStatesDataset(str(tmp_path))
    bad = tmp_path / "other"
    (bad / "manifest").mkdir(parents=True)
    pq.write_table(pa.table({"sample_id": ["a"], "file": ["x"]}), bad / "manifest" / "part-0.parquet")
    with pytest.raises(ValueError, match=r"lacks columns \['path', 'num_tokens', 'status'\]"):
        HiddenStatesDataset(str(bad))
    with pytest.raises(FileNotFoundError, match="no manifest"):
        HiddenStatesDataset(str(tmp_path / "missing"))


def test_opening_a_million_row_manifest_reads_no_data_file(tmp_path):
    n = 1_000_000
    spec = HiddenStatesSpec(layer_ids=(2, 16, 29, 32), num_hidden_layers=32, hidden_size=4096, dtype="bfloat16",
                            model="org/model")
    ids = pa.array([f"sample-{i:07d}" for i in range(n)])
    table = pa.table({"sample_id": ids, "path": pa.compute.binary_join_element_wise("data/", ids, ".safetensors", ""),
                      "num_tokens": pa.array(range(n), pa.int64()), "num_prompt_tokens": pa.array(range(n), pa.int64()),
                      "status": pa.array(["ok"] * n), "error": pa.nulls(n, pa.string()),
                      "bytes": pa.array([1] * n, pa.int64())})
    write_manifest_part(str(tmp_path), table, "test", 0)
    write_run_spec(str(tmp_path), spec_run_json(spec))
    start = time.perf_counter()
    ds = HiddenStatesDataset(str(tmp_path), layout="eagle3")
    elapsed = time.perf_counter() - start
    assert len(ds) == n and ds.num_tokens[123_456] == 123_456
    assert ds.run_info.layer_ids == (2, 16, 29, 32)
    assert not (tmp_path / "data").exists()  # no data file exists, so none could have been read
    with pytest.raises(FileNotFoundError, match=r"sample 'sample-0000000'\) is missing.*hsx verify"):
        ds[0]  # reading an item is what touches files; the error names the sample and the fix
    assert elapsed < 30, f"opening took {elapsed:.1f}s"


def test_without_run_json_the_spec_comes_from_the_first_files_header(tmp_path, random_run):
    _, samples, spec = random_run
    write_run(str(tmp_path), samples[:3], spec, run_json=False)
    info = read_run_info(str(tmp_path))
    assert info.layer_ids == spec.layer_ids and info.dtype == "bfloat16" and info.model == "tiny/random"
    assert torch.equal(HiddenStatesDataset(str(tmp_path))[2]["hidden_states"], samples[2].hidden_states)


def test_max_length_keeps_the_leading_tokens(random_run):
    out, samples, _ = random_run
    ds = HiddenStatesDataset(out, max_length=5, layout="eagle3")
    for i, s in enumerate(samples):
        t = min(5, len(s.token_ids))
        assert torch.equal(ds[i]["input_ids"], s.token_ids[:t])
        assert torch.equal(ds[i]["target_hidden_states"], s.hidden_states[:t, -1])


@pytest.mark.parametrize("change", [{"layer_ids": (2, 3, 5)}, {"dtype": "float16"}, {"model": "tiny/other"}])
def test_mixed_runs_are_refused(tmp_path, random_run, change):
    out, samples, spec = random_run
    other_spec = HiddenStatesSpec(**{**spec.__dict__, **change})
    other = [s.__class__(s.sample_id, s.token_ids, s.hidden_states.to(getattr(torch, other_spec.dtype)), s.loss_mask)
             for s in samples[:2]]
    other_out = str(tmp_path / "other")
    write_run(other_out, other, other_spec)
    # two runs that differ: refused at open
    with pytest.raises(ValueError, match="mixed runs cannot be read as one dataset"):
        HiddenStatesDataset([out, other_out])
    # one run with a foreign file copied in over one of its own: refused when read
    mixed = str(tmp_path / "mixed")
    shutil.copytree(out, mixed)
    rel = "data/0000/s00001.safetensors"
    shutil.copyfile(os.path.join(other_out, rel), os.path.join(mixed, rel))
    ds = HiddenStatesDataset(mixed)
    ds[0]
    with pytest.raises(ValueError, match="run is mixed"):
        ds[1]


def test_two_runs_with_the_same_spec_read_as_one(tmp_path, random_run):
    out, samples, spec = random_run
    second = str(tmp_path / "second")
    extra = random_samples(3, spec, seed=9)
    write_run(second, extra, spec)
    ds = HiddenStatesDataset([out, second])
    assert len(ds) == len(samples) + 3
    assert torch.equal(ds[len(samples) + 1]["hidden_states"], extra[1].hidden_states)


def test_a_file_that_disagrees_with_the_manifest_is_refused(tmp_path, random_run):
    out, samples, spec = random_run
    run = str(tmp_path / "run")
    rows = write_run(run, samples[:2], spec)
    rows[0]["num_tokens"] += 1
    shutil.rmtree(os.path.join(run, "manifest"))
    write_manifest(run, rows)
    with pytest.raises(ValueError, match="the manifest says"):
        HiddenStatesDataset(run)[0]
