"""`hsx export`: each layout re-read field by field against a transformers oracle, resume, refusals, the CLI."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest
import safetensors.torch
import torch

from cli.args import EXIT_OK, EXIT_USAGE
from cli.main import build_parser, main
from connectors import HiddenStatesSpec, load_hidden_states
from connectors.format import FP8
from connectors.paths import safe_file_stem
from connectors.quant import FP8_RELATIVE_ERROR
from harness.runs import spec_run_json, write_run
from tests.training.conftest import ORACLE_LAYERS
from training.export import export_run
from training.export import exporter as export


def _oracle(model, input_ids):
    """HF's own hidden states: [k] for aux ids, [N] (post-norm) as the target."""
    with torch.no_grad():
        hs = model(input_ids[None], output_hidden_states=True).hidden_states
    aux = torch.cat([hs[k][0] for k in ORACLE_LAYERS[:-1]], dim=-1)  # [T, 2H]
    return aux, hs[-1][0]  # post-norm [T, H]


def _mask(sample):
    return sample.loss_mask.long()


def test_speculators_layout_reads_back_field_by_field(oracle_run, oracle_model, tmp_path):
    out, samples, spec = oracle_run
    model, _ = oracle_model
    dest = str(tmp_path / "spec")
    summary = export_run(out, dest, "speculators")
    assert (summary.samples, summary.written, summary.skipped) == (len(samples), len(samples), 0)
    for i, s in enumerate(samples):
        f = safetensors.torch.load_file(os.path.join(dest, "hidden_states", f"hs_{i}.safetensors"))
        assert set(f) == {"token_ids", "hidden_states", "loss_mask"}
        assert torch.equal(f["token_ids"], s.token_ids)
        assert f["hidden_states"].shape == (len(s.token_ids), len(ORACLE_LAYERS), spec.hidden_size)
        aux, post = _oracle(model, s.token_ids)
        # the trainer's split: hidden_states[:, :-1] flattened (aux) and hidden_states[:, -1] (pre-norm target)
        torch.testing.assert_close(f["hidden_states"][:, :-1].flatten(1), aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.model.norm(f["hidden_states"][:, -1]), post, rtol=1e-5, atol=1e-5)
        assert torch.equal(f["loss_mask"], _mask(s))
    # the Arrow dataset next to it, row i <-> hs_i
    with pa.memory_map(os.path.join(dest, "data-00000-of-00001.arrow")) as src:
        table = pa.ipc.open_stream(src).read_all()
    assert table.column_names == ["input_ids", "loss_mask", "seq_len"]
    assert table["input_ids"].to_pylist() == [s.token_ids.tolist() for s in samples]
    assert table["loss_mask"].to_pylist() == [_mask(s).tolist() for s in samples]
    assert table["seq_len"].to_pylist() == [len(s.token_ids) for s in samples]
    features = json.loads(table.schema.metadata[b"huggingface"])["info"]["features"]
    assert features["seq_len"] == {"dtype": "int64", "_type": "Value"}
    state = json.load(open(os.path.join(dest, "state.json")))
    assert state["_data_files"] == [{"filename": "data-00000-of-00001.arrow"}] and state["_format_type"] == "torch"
    assert json.load(open(os.path.join(dest, "dataset_info.json")))["features"] == features


def test_speculators_export_loads_with_hf_datasets_when_installed(oracle_run, tmp_path):
    datasets = pytest.importorskip("datasets")
    out, samples, _ = oracle_run
    dest = str(tmp_path / "spec")
    export_run(out, dest, "speculators")
    ds = datasets.load_from_disk(dest)
    assert len(ds) == len(samples)
    assert torch.equal(ds[1]["input_ids"], samples[1].token_ids)


def test_specforge_layout_reads_back_field_by_field(oracle_run, oracle_model, tmp_path):
    out, samples, spec = oracle_run
    model, _ = oracle_model
    dest = str(tmp_path / "sf")
    export_run(out, dest, "specforge")  # the run's model is a local folder: its final norm applies
    # .hsx-output.json marks DEST as an hsx output folder (a re-export may replace it; nothing else may)
    assert sorted(os.listdir(dest)) == [".hsx-output.json", "hsx_export.json", "rows_0-2000"]
    for i, s in enumerate(samples):
        obj = torch.load(os.path.join(dest, "rows_0-2000", f"data_{i}.ckpt"), weights_only=True)
        assert set(obj) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        t = len(s.token_ids)
        assert torch.equal(obj["input_ids"], s.token_ids)
        assert torch.equal(obj["loss_mask"], _mask(s))
        aux, post = _oracle(model, s.token_ids)
        assert obj["hidden_state"].shape == (1, t, spec.hidden_size)
        assert obj["aux_hidden_state"].shape == (1, t, 2 * spec.hidden_size)
        torch.testing.assert_close(obj["hidden_state"][0], post, rtol=1e-5, atol=1e-5)  # post-norm
        torch.testing.assert_close(obj["aux_hidden_state"][0], aux, rtol=1e-5, atol=1e-5)


# -- an fp8 run: passed through to speculators, dequantized for the others ---------------------------------------------


@pytest.fixture(scope="module")
def fp8_run(oracle_run, tmp_path_factory):
    """(output, samples, spec): the oracle run's float32 states stored in fp8 (per-token-per-layer scales)."""
    _, samples, spec = oracle_run
    spec8 = HiddenStatesSpec(**{**spec.__dict__, "storage_dtype": FP8})
    out = str(tmp_path_factory.mktemp("fp8-run"))
    write_run(out, samples, spec8)
    return out, samples, spec8


def _within_fp8(got: torch.Tensor, expected: torch.Tensor) -> None:
    """`got` [T, L, H] equals `expected` within fp8's rounding: per token and layer, FP8_RELATIVE_ERROR of that row's
    largest magnitude (the bound hsx verify allows), and not bit-equal (so fp8 really went through)."""
    err = (got.float() - expected.float()).abs().amax(-1)  # [T, L]
    bound = FP8_RELATIVE_ERROR * expected.float().abs().amax(-1)  # [T, L]
    assert bool((err <= bound * 1.001 + 1e-12).all()), float((err / bound.clamp(min=1e-30)).max())
    assert not torch.equal(got.float(), expected.float())


def test_an_fp8_run_goes_to_speculators_as_its_fp8_bytes_and_scales_which_load_back_within_fp8_error(fp8_run,
                                                                                                    tmp_path):
    out, samples, spec = fp8_run
    dest = str(tmp_path / "spec")
    export_run(out, dest, "speculators")
    stored = {r["sample_id"]: r for r in _run_rows(out)}
    for i, s in enumerate(samples):
        path = os.path.join(dest, "hidden_states", f"hs_{i}.safetensors")
        f = safetensors.torch.load_file(path)
        t, n_layers = len(s.token_ids), len(ORACLE_LAYERS)
        assert set(f) == {"token_ids", "hidden_states", "hidden_states_scales", "loss_mask"}
        assert f["hidden_states"].dtype == torch.float8_e4m3fn and f["hidden_states"].shape == (t, n_layers,
                                                                                                 spec.hidden_size)
        assert f["hidden_states_scales"].dtype == torch.float32 and f["hidden_states_scales"].shape == (t, n_layers, 1)
        # the run's own bytes and scales, not a requantization
        raw = load_hidden_states(os.path.join(out, stored[s.sample_id]["path"]), dequantize=False)
        assert torch.equal(f["hidden_states"].view(torch.uint8), raw["hidden_states"].view(torch.uint8))
        assert torch.equal(f["hidden_states_scales"], raw["hidden_states_scales"])
        # speculators' rule (fp8.to(dtype) * scales.to(dtype)) broadcasts [T, L, 1] as it does its own [T, 1, 1]
        _within_fp8(f["hidden_states"].float() * f["hidden_states_scales"], s.hidden_states)
        back = load_hidden_states(path)  # our reader: no hsx metadata, scaled -> float32
        assert back["hidden_states"].dtype == torch.float32 and torch.equal(back["token_ids"], s.token_ids)
        _within_fp8(back["hidden_states"], s.hidden_states)
        part = load_hidden_states(path, layer_ids=[ORACLE_LAYERS[-1], ORACLE_LAYERS[0]], token_range=(1, t - 1))
        torch.testing.assert_close(part["hidden_states"], back["hidden_states"][1:t - 1][:, [2, 0]], rtol=0, atol=0)


def test_the_feed_gives_an_fp8_runs_stored_states_only_when_asked_and_only_in_the_raw_layout(fp8_run):
    from training.dataset import HiddenStatesDataset

    out, samples, _ = fp8_run
    stored = HiddenStatesDataset(out, dequantize=False)[0]
    values = HiddenStatesDataset(out)[0]
    assert stored["hidden_states"].dtype == torch.float8_e4m3fn and "hidden_states" in values
    assert "hidden_states_scales" not in values and values["hidden_states"].dtype == torch.float32
    assert torch.equal(stored["hidden_states"].float() * stored["hidden_states_scales"], values["hidden_states"])
    with pytest.raises(ValueError, match="only layout='raw' without normalize_last_layer"):
        HiddenStatesDataset(out, layout="eagle3", dequantize=False)


def _run_rows(out):
    from connectors.manifest import ok_rows

    return ok_rows(out).to_pylist()


@pytest.mark.parametrize("fmt", ["specforge", "modelopt"])
def test_an_fp8_run_goes_to_the_other_layouts_dequantized_to_the_model_dtype(fp8_run, oracle_run, oracle_model,
                                                                           tmp_path, fmt):
    out, samples, spec = fp8_run
    model, _ = oracle_model
    dest = str(tmp_path / fmt)
    export_run(out, dest, fmt)
    bf = str(tmp_path / f"{fmt}-float32")
    export_run(oracle_run[0], bf, fmt)  # the same prompts stored in float32
    layout = export._LAYOUTS[fmt](dest, None)
    for i, s in enumerate(samples):
        rel = layout.relpath(i, s.sample_id)
        obj, ref = torch.load(os.path.join(dest, rel), weights_only=True), torch.load(os.path.join(bf, rel),
                                                                                        weights_only=True)
        target, aux = ("hidden_state", "aux_hidden_state") if fmt == "specforge" else ("hidden_states",
                                                                                       "aux_hidden_states")
        assert obj[target].dtype == obj[aux].dtype == torch.float32  # the model dtype, never fp8
        t, h = len(s.token_ids), spec.hidden_size
        _within_fp8(obj[aux].reshape(t, 2, h), ref[aux].reshape(t, 2, h))
        # the target is the final norm of the dequantized pre-norm layer: fp8's error, scaled by the norm
        with torch.no_grad():
            expected = model.model.norm(s.hidden_states[:, -1])  # [T, H] from the float32 pre-norm states
        got = obj[target].reshape(t, h)
        rel_err = float((got - expected).norm() / expected.norm())
        assert 0 < rel_err < 2 * FP8_RELATIVE_ERROR, rel_err
        torch.testing.assert_close(ref[target].reshape(t, h), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["speculators", "specforge", "modelopt"])
def test_an_fp8_runs_export_is_byte_deterministic(fp8_run, tmp_path, fmt):
    out = fp8_run[0]
    trees = []
    for n in (1, 2):
        dest = tmp_path / f"{fmt}{n}"
        export_run(out, str(dest), fmt)
        trees.append({f: (dest / f).read_bytes() for f in _files_under(str(dest)) if f != ".hsx-output.json"})
    assert trees[0] == trees[1] and len(trees[0]) > len(fp8_run[1])


def test_specforge_rows_go_in_folders_of_2000():
    layout = export.SpecForgeLayout("d", None)
    assert layout.relpath(0, "x") == "rows_0-2000/data_0.ckpt"
    assert layout.relpath(1999, "x") == "rows_0-2000/data_1999.ckpt"
    assert layout.relpath(2000, "x") == "rows_2000-4000/data_2000.ckpt"


def test_modelopt_layout_reads_back_field_by_field(oracle_run, oracle_model, tmp_path):
    out, samples, spec = oracle_run
    model, _ = oracle_model
    dest = str(tmp_path / "mo")
    export_run(out, dest, "modelopt", model_dir=spec.model)
    for s in samples:
        obj = torch.load(os.path.join(dest, f"{safe_file_stem(s.sample_id)}.pt"), weights_only=True)
        assert set(obj) == {"input_ids", "hidden_states", "aux_hidden_states", "loss_mask", "conversation_id"}
        assert obj["conversation_id"] == s.sample_id
        assert torch.equal(obj["input_ids"], s.token_ids)
        assert torch.equal(obj["loss_mask"], _mask(s))
        aux, post = _oracle(model, s.token_ids)
        torch.testing.assert_close(obj["hidden_states"], post, rtol=1e-5, atol=1e-5)  # HF last_hidden_state
        torch.testing.assert_close(obj["aux_hidden_states"], aux, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["speculators", "specforge", "modelopt"])
def test_resume_skips_finished_samples_and_redoes_missing_or_broken_ones(oracle_run, tmp_path, fmt):
    out, samples, _ = oracle_run
    dest = str(tmp_path / fmt)
    export_run(out, dest, fmt)
    layout = export._LAYOUTS[fmt](dest, None)
    paths = [os.path.join(dest, layout.relpath(i, s.sample_id)) for i, s in enumerate(samples)]
    inodes = [os.stat(p).st_ino for p in paths]
    os.remove(paths[1])  # interrupted before sample 1 was written
    with open(paths[3], "wb") as f:  # a file that is not what it should be
        f.write(b"not a sample")
    with open(os.path.join(os.path.dirname(paths[0]), ".leftover.tmp-123"), "wb") as f:
        f.write(b"partial")  # a crashed writer's temp file
    summary = export_run(out, dest, fmt, num_workers=1)
    assert (summary.written, summary.skipped) == (2, len(samples) - 2)
    for i, p in enumerate(paths):
        if i not in (1, 3):
            assert os.stat(p).st_ino == inodes[i]  # untouched
    fresh = str(tmp_path / f"{fmt}-fresh")
    export_run(out, fresh, fmt)
    for p, q in zip(paths, [os.path.join(fresh, os.path.relpath(p, dest)) for p in paths]):
        if fmt == "speculators":
            a, b = safetensors.torch.load_file(p), safetensors.torch.load_file(q)
        else:
            a, b = torch.load(p, weights_only=True), torch.load(q, weights_only=True)
        assert a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
    again = export_run(out, dest, fmt)
    assert (again.written, again.skipped) == (0, len(samples))


def test_post_norm_formats_need_the_model_when_the_run_names_no_folder(oracle_run, tmp_path):
    out, samples, spec = oracle_run
    run = str(tmp_path / "run")
    spec2 = HiddenStatesSpec(**{**spec.__dict__, "model": "org/remote-model"})
    write_run(run, samples[:2], spec2, run_json=spec_run_json(spec2))
    for fmt in ("specforge", "modelopt"):
        with pytest.raises(ValueError, match="pass --model-dir"):
            export_run(run, str(tmp_path / fmt), fmt)
        assert not os.path.exists(tmp_path / fmt)  # refused before writing anything
    export_run(run, str(tmp_path / "ok"), "specforge", model_dir=spec.model)
    export_run(run, str(tmp_path / "spec"), "speculators")  # pre-norm: no model needed


def test_refusals_name_the_fix(oracle_run, tmp_path):
    out, samples, spec = oracle_run
    post = str(tmp_path / "post")
    spec_post = HiddenStatesSpec(**{**spec.__dict__, "last_layer_normalized": True})
    write_run(post, samples[:2], spec_post)
    with pytest.raises(ValueError, match="cannot be undone"):
        export_run(post, str(tmp_path / "a"), "speculators")
    export_run(post, str(tmp_path / "b"), "modelopt", model_dir="/nonexistent")  # already post-norm: no norm needed
    no_n = str(tmp_path / "no-n")
    write_run(no_n, samples[:2], HiddenStatesSpec(**{**spec.__dict__, "layer_ids": (1, 2, 3)}))
    with pytest.raises(ValueError, match="extract with id 4 last"):
        export_run(no_n, str(tmp_path / "c"), "specforge")
    dest = str(tmp_path / "d")
    export_run(out, dest, "specforge")
    with pytest.raises(ValueError, match="export into an empty DEST"):
        export_run(out, dest, "modelopt")
    with pytest.raises(ValueError, match="unknown export format"):
        export_run(out, dest, "eagle")


@pytest.mark.parametrize("fmt", ["speculators", "specforge", "modelopt"])
def test_a_topk_target_run_is_refused_by_layouts_that_store_the_last_layer(fmt, oracle_run, oracle_model, tmp_path):
    from tests.drafters.test_topk_training import topk_run

    run = topk_run(str(tmp_path / "run"), oracle_run, oracle_model, 8)
    with pytest.raises(ValueError, match=rf"{fmt}'s layout stores the last layer's hidden state \(id 4\), which this "
                                         r"run kept only as a top_k:8 target .* --kind eagle3`, or re-extract with "
                                         "--target states"):
        export_run(run, str(tmp_path / "dest"), fmt)
    assert not (tmp_path / "dest").exists()


def test_cli_export_subcommand(oracle_run, tmp_path, capsys):
    out, samples, spec = oracle_run
    parser = build_parser()
    args = parser.parse_args(["export", "--format", "modelopt", "--model-dir", spec.model, out, str(tmp_path / "x")])
    assert args.func(args) == EXIT_OK == 0
    assert f"exported {len(samples)} samples" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        main(["export", "--format", "speculators", str(tmp_path / "nothing"), str(tmp_path / "y")])
    assert bad.value.code == EXIT_USAGE == 2
    assert "no manifest" in capsys.readouterr().err


@pytest.mark.s3
def test_export_reads_an_s3_run(s3_bucket, tmp_path):
    from harness.runs import random_samples

    url, options = s3_bucket
    spec = HiddenStatesSpec(layer_ids=(1, 2, 4), num_hidden_layers=4, hidden_size=8, dtype="bfloat16", model="x/y")
    samples = random_samples(3, spec, seed=2)
    write_run(f"{url}/run", samples, spec, storage_options=options)
    dest = str(tmp_path / "spec")
    summary = export_run(f"{url}/run", dest, "speculators", storage_options=options)
    assert summary.written == 3
    for i, s in enumerate(samples):
        f = safetensors.torch.load_file(os.path.join(dest, "hidden_states", f"hs_{i}.safetensors"))
        assert torch.equal(f["hidden_states"], s.hidden_states) and torch.equal(f["token_ids"], s.token_ids)


def _files_under(dest):
    return sorted(os.path.relpath(os.path.join(d, f), dest) for d, _, names in os.walk(dest) for f in names)


@pytest.mark.parametrize("fmt", ["speculators", "specforge", "modelopt"])
def test_every_exported_file_is_written_through_put_atomic_and_no_temp_file_is_left(oracle_run, tmp_path, fmt,
                                                                                    monkeypatch):
    from connectors import storage

    out, samples, _ = oracle_run
    dest = str(tmp_path / fmt)
    put_atomic, written = storage.put_atomic, []

    def recording_put_atomic(fs, path, content):
        written.append(os.path.relpath(path, dest))
        return put_atomic(fs, path, content)

    monkeypatch.setattr(storage, "put_atomic", recording_put_atomic)
    export_run(out, dest, fmt)
    on_disk = _files_under(dest)
    assert sorted(written) == on_disk  # each file once, and nothing written another way
    assert len(on_disk) >= len(samples) + 1
    assert not [f for f in on_disk if ".tmp-" in f or
                (os.path.basename(f).startswith(".") and f != ".hsx-output.json")]


@pytest.mark.parametrize("fmt", ["specforge", "modelopt"])
def test_an_export_interrupted_inside_a_write_leaves_no_partial_file(oracle_run, tmp_path, fmt, monkeypatch):
    out, samples, _ = oracle_run
    dest = str(tmp_path / fmt)
    save, calls = torch.save, []

    def save_that_dies_on_the_third_sample(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            f.write(b"PK\x03\x04 half a zip")  # bytes reach the file, then the writer dies
            raise OSError("disk full")
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_that_dies_on_the_third_sample)
    with pytest.raises(OSError, match="disk full"):
        export_run(out, dest, fmt)
    monkeypatch.setattr(torch, "save", save)
    layout = export._LAYOUTS[fmt](dest, None)
    paths = [os.path.join(dest, layout.relpath(i, s.sample_id)) for i, s in enumerate(samples)]
    assert [os.path.exists(p) for p in paths] == [True, True] + [False] * (len(samples) - 2)
    assert not [f for f in _files_under(dest) if ".tmp-" in f]  # the temp file went with the failure
    for p, s in zip(paths[:2], samples):
        assert torch.equal(torch.load(p, weights_only=True)["input_ids"], s.token_ids)  # whole files only
    resumed = export_run(out, dest, fmt)
    assert (resumed.written, resumed.skipped) == (len(samples) - 2, 2)
