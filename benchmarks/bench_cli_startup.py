"""Measure how long the command line takes to answer `--help` (what every `hsx` invocation pays before it does work),
and to answer the re-run of a finished job (`hsx demo DIR` once more: nothing left, answered from run.json's plan key).

    python benchmarks/bench_cli_startup.py [--repeat 5] [--out DIR] [--demo-dir DIR]

Each command runs --repeat times, each in a fresh interpreter (`python -m cli ...`, no import cached), and the
median wall time is reported beside its target (0.5 s for --help, 2 s for the finished re-run), with a bare
`python -c pass` for the interpreter's own start. The demo is run once first, untimed (it builds its model and runs
the job on a local Ray). A last run of each lists the heavy packages it loaded (torch, transformers and ray must not
be among them).

Writes DIR/bench_cli_startup.json and DIR/bench_cli_startup.md with --out; never passes or fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_S = 0.5
RERUN_TARGET_S = 2.0
COMMANDS = {"python -c pass": ["-c", "pass"], "hsx --help": ["-m", "cli", "--help"],
            "hsx run --help": ["-m", "cli", "run", "--help"]}
RERUN = "hsx demo DIR (finished)"
HEAVY = ("torch", "transformers", "ray", "pyarrow", "numpy", "matplotlib")
PROBE = ("import json, runpy, sys\nsys.argv = ['hsx', *sys.argv[1:]]\ntry:\n    runpy.run_module('cli', run_name='__main__')\n"
         "except SystemExit:\n    pass\nsys.stdout = sys.__stderr__\n"
         "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(%r))), file=sys.__stderr__)")


def wall_times(args: list[str], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run([sys.executable, *args], cwd=REPO, stdout=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - start)
    return times


def heavy_loaded(args: list[str]) -> list[str]:
    """The heavy packages in sys.modules after the command ran (its own output discarded)."""
    if args[0] != "-m":
        return []
    done = subprocess.run([sys.executable, "-c", PROBE % (HEAVY,), *args[2:]], cwd=REPO, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stderr.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="fresh processes per command (the median is reported)")
    parser.add_argument("--out", help="write bench_cli_startup.json and .md here")
    parser.add_argument("--demo-dir", help="the demo's folder (default: a temporary one, removed at the end)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        demo = args.demo_dir or os.path.join(tmp, "demo")
        subprocess.run([sys.executable, "-m", "cli", "demo", demo], cwd=REPO, stdout=subprocess.DEVNULL, check=True)
        rows = {}
        for name, argv in {**COMMANDS, RERUN: ["-m", "cli", "demo", demo]}.items():
            times = wall_times(argv, args.repeat)
            rows[name] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                          "runs": times, "heavy_modules": heavy_loaded(argv),
                          "target_s": RERUN_TARGET_S if name == RERUN else TARGET_S}
    results = {"target_s": TARGET_S, "rerun_target_s": RERUN_TARGET_S, "repeat": args.repeat, "commands": rows,
               "machine": {"platform": platform.platform(), "python": platform.python_version(),
                           "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg())}}
    lines = [f"CLI start-up, median of {args.repeat} fresh processes; load average "
             f"{results['machine']['load_average'][0]:.1f} on {os.cpu_count()} CPUs", "",
             "| command | target s | median s | min s | max s | heavy packages loaded |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| `{name}` | {r['target_s']} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['max_s']:.3f} | "
                     f"{', '.join(r['heavy_modules']) or '-'} |")
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_cli_startup.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(args.out, "bench_cli_startup.md"), "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
