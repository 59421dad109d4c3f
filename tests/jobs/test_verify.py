"""`hsx verify` on real runs: every kind of planted damage is found and marked, a re-run of the same job repairs
exactly those samples, states recomputed with transformers agree (and a different model's do not), generated tokens
are what the stored last layer predicts."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from cli.args import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from cli.main import main
from connectors.manifest import committed_rows, read_manifest
from connectors.run import RunDir

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _run(ray_cluster, tiny_llama, tmp_path, n: int = 8, **over):
    from harness.corpora import write_jsonl
    from jobs.config import JobConfig
    from jobs.pipeline import run_job

    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": f"s{i}", "prompt": f"sample {i} says " + "word " * (i + 3)}
                                                for i in range(n)])
    config = JobConfig(model=tiny_llama, corpus=(corpus,), output=str(tmp_path / "out"), progress=False, **over)
    result = run_job(config)
    assert result.ok == n
    return config


def _paths(output: str) -> dict[str, str]:
    rows = committed_rows(read_manifest(output)).to_pylist()
    return {r["sample_id"]: os.path.join(output, r["path"]) for r in rows}


def test_verify_finds_every_planted_damage_and_a_rerun_repairs_exactly_those(ray_cluster, tiny_llama, tmp_path,
                                                                             capsys):
    from connectors import HiddenStatesSpec, KVTransferConfig, RequestInfo
    from connectors.run import read_run_spec
    from jobs.pipeline import run_job

    config = _run(ray_cluster, tiny_llama, tmp_path)
    out = config.output
    assert main(["verify", out]) == EXIT_OK  # a clean run verifies
    paths = _paths(out)
    # s0: 64 bytes flipped inside the tensor data
    blob = bytearray(open(paths["s0"], "rb").read())
    for i in range(len(blob) - 200, len(blob) - 136):
        blob[i] ^= 0xFF
    open(paths["s0"], "wb").write(bytes(blob))
    # s1: truncated; s2: deleted; s3: replaced by s4's file
    open(paths["s1"], "r+b").truncate(os.path.getsize(paths["s1"]) // 2)
    os.remove(paths["s2"])
    shutil.copyfile(paths["s4"], paths["s3"])
    # s5: re-written whole and self-consistent (a valid checksum of its own) but with NaN states
    spec: HiddenStatesSpec = read_run_spec(out).file_spec()
    # (a writer without the commit check: hsx's own refuses to commit NaN states)
    connector = KVTransferConfig(kv_connector_extra_config={"shared_storage_path": out, "allow_custom_save_path": True,
                                                            "check_states": False}).create_connector(spec)
    t = 5
    connector.start_request(RequestInfo("nan", t, {"hidden_states_path": paths["s5"]}, sample_id="s5"))
    states = torch.zeros(t, len(spec.layer_ids), spec.hidden_size)
    states[2, 1, 3] = float("nan")
    connector.save_hidden_states("nan", torch.arange(t), states)
    connector.request_finished("nan")
    assert connector.wait_for_save() == {}
    connector.shutdown()

    capsys.readouterr()
    assert main(["verify", out]) == EXIT_FAILED
    printed = capsys.readouterr().out
    assert "checked 8 of 8 committed samples, 5 failed" in printed
    report = json.loads(open(printed.rsplit("report: ", 1)[1].strip()).read())
    problems = {f["sample_id"]: f["problem"] for f in report["failures"]}
    assert set(problems) == {"s0", "s1", "s2", "s3", "s5"}
    assert "checksum" in problems["s0"]
    assert "truncated" in problems["s1"] or "bytes" in problems["s1"]
    assert "gone" in problems["s2"]
    assert "holds sample 's4'" in problems["s3"]
    assert "non-finite" in problems["s5"] or "NaN" in problems["s5"]
    # status shows what verify found; the committed set no longer holds the bad samples
    main(["status", out])
    status = capsys.readouterr().out
    assert "invalid:  5 samples" in status and "verify:" in status and "5 failed" in status
    # the same job again re-extracts exactly the five, and then everything verifies
    again = run_job(config)
    assert (again.ok, again.skipped) == (5, 3)
    assert main(["verify", out]) == EXIT_OK
    table = read_manifest(out)
    ok_rows = [s for s, st in zip(table["sample_id"].to_pylist(), table["status"].to_pylist()) if st == "ok"]
    assert sorted(ok_rows) == sorted([f"s{i}" for i in range(8)] + ["s0", "s1", "s2", "s3", "s5"])


def test_recomputed_states_agree_and_another_models_do_not(ray_cluster, tiny_llama, tiny_model_factory, tmp_path,
                                                           capsys):
    config = _run(ray_cluster, tiny_llama, tmp_path, n=4)
    out = config.output
    assert main(["verify", out, "--recompute", "3", "--no-mark"]) == EXIT_OK
    printed = capsys.readouterr().out
    assert "recomputed 3 with transformers" in printed
    report = json.loads(open(printed.rsplit("report: ", 1)[1].strip()).read())
    assert all(d < 1e-4 for r in report["recomputed"] for d in r["max_rel_diff"].values())
    other = tiny_model_factory("llama", seed=1)  # same shapes, other weights
    assert main(["verify", out, "--recompute", "2", "--model-dir", other, "--no-mark"]) == EXIT_FAILED
    assert "recompute: layers" in capsys.readouterr().out
    assert len(committed_rows(read_manifest(out))) == 4  # --no-mark: nothing was marked


def test_generated_tokens_are_what_the_stored_last_layer_predicts(ray_cluster, tiny_llama, tmp_path, capsys):
    config = _run(ray_cluster, tiny_llama, tmp_path, n=3, max_tokens=5, include_output_tokens=True)
    assert main(["verify", config.output, "--recompute", "3"]) == EXIT_OK
    report = json.loads(open(capsys.readouterr().out.rsplit("report: ", 1)[1].strip()).read())
    assert sum(r["tokens_checked"] for r in report["recomputed"]) > 0
    assert all(r["token_mismatches"] == 0 for r in report["recomputed"])


def test_verify_refuses_what_it_cannot_check(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["verify", str(tmp_path)])
    assert e.value.code == EXIT_USAGE and "no run.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["verify", str(tmp_path), "--sample", "2", "--all"])
    assert e.value.code == EXIT_USAGE
    assert RunDir(str(tmp_path)).list("verify") == []


def test_a_row_without_a_path_is_a_failed_sample_and_the_report_copy_is_guarded(tmp_path, capsys):
    """An "ok" row with no path (a damaged manifest) is a failed sample: exit 1 naming it, no traceback; and
    --report may not be written over the run (or inside it)."""
    from connectors import HiddenStatesSpec
    from harness.runs import random_samples, write_manifest, write_run

    spec = HiddenStatesSpec(layer_ids=(1, 2), num_hidden_layers=4, hidden_size=8, dtype="float32", model="m")
    out = str(tmp_path / "run")
    rows = write_run(out, random_samples(3, spec), spec)
    rows[1] = {**rows[1], "path": None}
    os.makedirs(tmp_path / "elsewhere")  # sample 2's own valid file outside the run, its row pointing there
    os.replace(f"{out}/{rows[2]['path']}", tmp_path / "elsewhere" / "s2.safetensors")
    rows[2] = {**rows[2], "path": "../elsewhere/s2.safetensors"}
    write_manifest(out, rows)
    assert main(["verify", out, "--no-mark", "--report", str(tmp_path / "report.json")]) == EXIT_FAILED
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert "s00001" in captured.out and "path" in captured.out
    assert "s00002" in captured.out and "not a plain relative path inside the run" in captured.out
    failures = json.loads((tmp_path / "report.json").read_text())["failures"]
    assert [f["sample_id"] for f in failures] == ["s00001", "s00002"]
    for report, message in ((f"{out}/run.json", "lies inside the OUTPUT folder"), (out, "is a folder")):
        before = open(f"{out}/run.json", "rb").read()
        with pytest.raises(SystemExit) as e:
            main(["verify", out, "--no-mark", "--report", report])
        assert e.value.code == EXIT_USAGE and message in capsys.readouterr().err
        assert open(f"{out}/run.json", "rb").read() == before
