"""benchmarks/gpu_summary.py reads what gpu_check.sh leaves (the benchmarks' own JSON shapes) into one table of issue
46's figures: a figure present is compared with its goal, one missing says so, a failed test run is a "no"."""

from __future__ import annotations

import json

from benchmarks.gpu_summary import rows


def test_the_summary_reads_each_benchmarks_json_and_says_what_is_missing(tmp_path):
    speed = {"ratios": {"early_exit_speedup": 1.93, "b_over_a": 0.975}, "approaches": {"b": {"mfu": 0.381}}}
    (tmp_path / "results.json").write_text(json.dumps({"speed": speed}))
    (tmp_path / "regeneration.json").write_text(json.dumps({"workloads": {"fixed": {"hsx_over_transformers": 0.49}}}))
    (tmp_path / "host_path.json").write_text(json.dumps({"end_to_end": [
        {"storage": "model", "cpu_s_per_GB": 0.83}, {"storage": "float8_e4m3fn", "cpu_s_per_GB": 3.1},
        {"storage": "float8_e4m3fn converted on the device", "cpu_s_per_GB": 0.57}]}))
    (tmp_path / "tests.log").write_text("..F.\n=========== 1 failed, 60 passed in 200.1s ===========\n")
    got = {figure: (value, meets) for figure, value, _, meets in rows(str(tmp_path))}
    assert got["early exit vs the full forward (e/a)"] == ("1.93", "yes")
    assert got["hsx extraction vs the bare forward (b/a), bf16 files"] == ("0.975", "yes")
    assert got["MFU of hsx extraction"] == ("38.1%", "no")
    assert got["hsx extraction vs the bare forward (b/a), fp8 files"][1] == "-"  # extraction-fp8.json absent
    assert "not measured" in got["hsx extraction vs the bare forward (b/a), fp8 files"][0]
    assert "not measured" in got["hsx extraction packed vs padded (b/p)"][0]
    (tmp_path / "packing.json").write_text(json.dumps({"speed": {"ratios": {"packing_speedup": 1.21}}}))
    assert ("hsx extraction packed vs padded (b/p)", "1.21", ">= 1.0", "yes") in rows(str(tmp_path))
    (tmp_path / "packing.json").write_text(json.dumps({"speed": {"packed": False, "packing_refusal": "why",
                                                                 "ratios": {"packing_speedup": 1.0}}}))
    assert ("hsx extraction packed vs padded (b/p)", "not packed: why", ">= 1.0", "-") in rows(str(tmp_path))
    assert got["regeneration with output-token files vs transformers generate"] == ("0.49", "no")
    assert got["host CPU-s per GB written, bf16"] == ("0.83", "yes")
    assert got["host CPU-s per GB written, fp8 converted on the device"] == ("0.57", "yes")
    assert got["CUDA tests (tests/extractor)"] == ("1 failed, 60 passed in 200.1s", "no")
