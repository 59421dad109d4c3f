"""One table of the GPU data path's figures (issue 46), from what `benchmarks/gpu_check.sh` left in RESULTS_DIR.

    python benchmarks/gpu_summary.py RESULTS_DIR          # prints the table, writes RESULTS_DIR/summary.md

Reads (each optional: a step that did not run or ran out of time is a row saying so): results.json
(bench_extraction: early exit e/a, hsx vs the bare forward b/a, MFU of b: packed where the target packs),
extraction-fp8.json (the same with --storage-dtype fp8), packing.json (bench_extraction's packing section: hsx
packed vs padded, b/p), regeneration.json (bench_regeneration: hsx with output-token files vs transformers generate),
host_path.json (bench_host_path: CPU-seconds per GB written) and tests.log (the CUDA tests' pytest summary line).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable


def _ratio(key: str) -> Callable[[dict], float | None]:
    return lambda r: (r.get("speed") or {}).get("ratios", {}).get(key)


def _mfu(r: dict) -> float | None:
    b = (r.get("speed") or {}).get("approaches", {}).get("b") or {}
    return b.get("mfu")


def _packing(r: dict) -> float | str | None:
    speed = r.get("speed") or {}
    if speed and not speed.get("packed", True):  # the target fell back to padded batches: no packed figure
        return f"not packed: {speed.get('packing_refusal')}"
    return _ratio("packing_speedup")(r)


def _regeneration(r: dict) -> float | None:
    fixed = (r.get("workloads") or {}).get("fixed") or {}
    return fixed.get("hsx_over_transformers")


def _cpu_per_gb(storage: str) -> Callable[[dict], float | None]:
    return lambda r: next((row["cpu_s_per_GB"] for row in r.get("end_to_end", []) if row["storage"] == storage), None)


GOALS: list[tuple[str, str, float, str, Callable[[dict], float | str | None]]] = [
    ("early exit vs the full forward (e/a)", "results.json", 1.8, ">=", _ratio("early_exit_speedup")),
    ("hsx extraction vs the bare forward (b/a), bf16 files", "results.json", 0.95, ">=", _ratio("b_over_a")),
    ("hsx extraction vs the bare forward (b/a), fp8 files", "extraction-fp8.json", 0.97, ">=", _ratio("b_over_a")),
    ("MFU of hsx extraction", "results.json", 0.45, ">=", _mfu),
    ("hsx extraction packed vs padded (b/p)", "packing.json", 1.0, ">=", _packing),
    ("regeneration with output-token files vs transformers generate", "regeneration.json", 0.9, ">=", _regeneration),
    ("host CPU-s per GB written, bf16", "host_path.json", 1.0, "<=", _cpu_per_gb("model")),
    ("host CPU-s per GB written, fp8 converted on the device", "host_path.json", 1.0, "<=",
     _cpu_per_gb("float8_e4m3fn converted on the device")),
]
"""(figure, the file in RESULTS_DIR, goal, direction, how to read the figure from the file's JSON): issue 46's."""


def rows(results_dir: str) -> list[tuple[str, str, str, str]]:
    """(figure, value, goal, meets) per goal, then the CUDA tests' line."""
    out = []
    for figure, name, goal, direction, read in GOALS:
        path = os.path.join(results_dir, name)
        try:
            with open(path) as f:
                value = read(json.load(f))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            out.append((figure, f"not measured ({name}: {type(e).__name__})", f"{direction} {goal}", "-"))
            continue
        if value is None or isinstance(value, str):  # a string says why there is no figure
            out.append((figure, value or f"not measured (not in {name})", f"{direction} {goal}", "-"))
            continue
        meets = value >= goal if direction == ">=" else value <= goal
        shown = f"{value:.1%}" if goal < 1 and "MFU" in figure else f"{value:.3g}"
        out.append((figure, shown, f"{direction} {goal:.0%}" if "MFU" in figure else f"{direction} {goal}",
                    "yes" if meets else "no"))
    summary = "not run"
    try:
        with open(os.path.join(results_dir, "tests.log"), errors="replace") as f:
            found = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$", f.read(), re.M)
        summary = found[-1] if found else "no pytest summary (stopped early?)"
    except OSError:
        pass
    passed = re.match(r"\d+ passed", summary) is not None and not re.search(r"failed|error", summary)
    out.append(("CUDA tests (tests/extractor)", summary, "all pass", "yes" if passed else "no"))
    return out


def table(results_dir: str) -> str:
    lines = ["| figure | value | goal | meets |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows(results_dir)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python benchmarks/gpu_summary.py RESULTS_DIR", file=sys.stderr)
        return 2
    text = table(argv[0])
    with open(os.path.join(argv[0], "summary.md"), "w") as f:
        f.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
