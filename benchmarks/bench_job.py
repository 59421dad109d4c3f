"""Job benchmark: a whole `hsx run` (Ray Data, tokenizer actors, extraction workers, manifest) against the engine
alone and the bare forward pass, in one run, on one local Ray.

    python benchmarks/bench_job.py --out bench-out            # CPU: the small Llama-3 shape, a few minutes

Same model (bench_extraction.py's, built locally), dtype and corpus for every row. The corpus is text (JSONL
`{"id", "prompt"}`) with log-uniform lengths; the job tokenizes it in its tokenizer actors, the in-process rows get
the same ids from the same tokenizer call.

    (a) bare forward   the decoder stack over the batches the engine plans, nothing kept (the limit)
    (b) engine         `LLM.generate` in this process, prompt-only, files written (bench_extraction's (b))
    (j) job            `run_job` over the JSONL to a fresh output: read, tokenize, extract, write, commit the
                       manifest; worker start-up (model load) included, Ray start-up not (reported apart)
    (j1) fixed cost    the same job over the shortest sample alone: what every job pays around its samples
    resume             the finished job run again: every sample skipped from the manifest
    memory             peak RSS (VmHWM) of the driver, the tokenizer actor and the extraction worker over a job on the
                       corpus and on the corpus 10x; worker and tokenizer processes are new per job

Ratios: j/b (the whole pipeline vs the engine alone) and the steady-state j/b, with the fixed cost taken out.
Never pass/fail; writes results.json and results.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchmarks.common as bx  # noqa: E402
from extractor.layers import default_layer_ids  # noqa: E402
from jobs.config import JobConfig  # noqa: E402
from jobs.pipeline import run_job  # noqa: E402

TARGETS = {"memory_growth": 0.05}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for results.json, results.md, the model and scratch files")
    p.add_argument("--num-samples", type=int, default=32, help="corpus size in samples")
    p.add_argument("--min-len", type=int, default=32, help="shortest sample in tokens")
    p.add_argument("--max-len", type=int, default=2048, help="longest sample in tokens (log-uniform lengths)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="timed passes per approach; medians are reported")
    p.add_argument("--workers", type=int, default=1, help="extraction workers of the job")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the engine's token budget per forward")
    p.add_argument("--tokens-per-task", type=int, default=None,
                   help="the job's --tokens-per-task (default: the job's own, 32768). A worker's memory follows its "
                        "unit of work: compare corpora of several units each")
    p.add_argument("--memory-scale", type=int, default=10, help="the larger memory job is this many times the corpus")
    p.add_argument("--malloc-mmap-threshold", type=int, default=1 << 20,
                   help="MALLOC_MMAP_THRESHOLD_ (bytes) for Ray's processes (set before Ray starts, so its workers "
                        "inherit it); 0 = glibc's dynamic default. As in bench_extraction.py: pinned, freed "
                        "activations go back to the OS and peaks track live memory")
    p.add_argument("--sections", default="speed,memory", help="comma-separated subset of speed,memory")
    p.add_argument("--model-dir", default=None, help="where the random model is built or reused (default: "
                                                     "OUT/model-small-float32, shared with bench_extraction.py)")
    return p.parse_args(argv)


def write_corpus(path: str, texts: list[str], copies: int = 1) -> str:
    with open(path, "w") as f:
        for c in range(copies):
            for i, text in enumerate(texts):
                f.write(json.dumps({"id": f"c{c}-s{i}", "prompt": text}) + "\n")
    return path


def job_config(args, model_dir: str, corpus: str, output: str, layers) -> JobConfig:
    extra = {"tokens_per_task": args.tokens_per_task} if args.tokens_per_task else {}
    return JobConfig(model=model_dir, corpus=(corpus,), output=output, layers=tuple(layers), dtype="float32",
                     workers=args.workers, max_num_batched_tokens=args.max_num_batched_tokens, progress=False,
                     **extra)


def run_one_job(config: JobConfig, expect_ok: int):
    result = run_job(config)
    if result.ok != expect_ok or result.failed:
        raise RuntimeError(f"job over {config.corpus[0]}: {result.ok} ok, {result.failed} failed (expected "
                           f"{expect_ok} ok); first failures: {result.failures[:3]}")
    return result


class ProcessPeaks:
    """Samples VmHWM of this process's descendants (Ray's raylet starts the actors) every `period` seconds, and
    names each by its Ray process title; VmHWM only grows, so the last sample before a process exits is its peak."""

    def __init__(self, period: float = 0.1) -> None:
        import psutil

        self._psutil, self._period = psutil, period
        self.peaks: dict[int, tuple[str, int]] = {}
        self.anon: dict[int, int] = {}  # peak sampled RssAnon: private memory, without the object store's pages
        self.series: dict[int, list[int]] = {}  # every RssAnon sample, per process
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ProcessPeaks:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = self._psutil.Process()
        while not self._stop.is_set():
            for proc in me.children(recursive=True):
                try:
                    title = " ".join(proc.cmdline())[:200]
                    hwm, anon = bx.status_kb("VmHWM", proc.pid), bx.status_kb("RssAnon", proc.pid)
                except (self._psutil.Error, OSError, KeyError):
                    continue
                self.peaks[proc.pid] = (title, max(hwm, self.peaks.get(proc.pid, ("", 0))[1]))
                self.anon[proc.pid] = max(anon, self.anon.get(proc.pid, 0))
                self.series.setdefault(proc.pid, []).append(anon)
            self._stop.wait(self._period)

    def peak_of(self, marker: str, private: bool = False) -> int | None:
        found = [self.anon.get(pid, 0) if private else hwm for pid, (title, hwm) in self.peaks.items()
                 if marker in title]
        return max(found) if found else None


    def drift_of(self, marker: str) -> tuple[float, float] | None:
        """Mean private RSS over the middle and the last third of the longest-lived matching process's samples (the
        first third holds start-up and model loading); memory that only fluctuates has no drift, a leak has."""
        runs = [self.series[pid] for pid, (title, _) in self.peaks.items() if marker in title and pid in self.series]
        if not runs or len(max(runs, key=len)) < 9:
            return None
        xs = max(runs, key=len)
        k = len(xs) // 3
        return statistics.fmean(xs[k:2 * k]), statistics.fmean(xs[-k:])


def bench_speed(args, llm, ids: list[list[int]], corpus: str, one: str, layers, scratch: str) -> dict:
    batches = bx.plan(llm, ids)
    tokens = sum(map(len, ids))
    runs: dict[str, list[float]] = {k: [] for k in ("a", "b", "j", "j1")}
    job_tokens = None
    last_output = None
    def job(name: str, rep: int) -> float:
        nonlocal job_tokens, last_output
        out = os.path.join(scratch, f"{name}-{rep}")
        t0 = time.perf_counter()
        result = run_one_job(job_config(args, llm.config.model, corpus if name == "j" else one, out, layers),
                             len(ids) if name == "j" else 1)
        wall = time.perf_counter() - t0
        time.sleep(2)  # Ray tears the job's actors down after it returns: let that finish outside every timing
        if name == "j":
            job_tokens = result.tokens
            if last_output:
                shutil.rmtree(last_output, ignore_errors=True)
            last_output = out
        else:
            shutil.rmtree(out, ignore_errors=True)
        return wall

    def engine() -> float:
        wall = bx.timed(lambda: bx.run_hsx(llm, ids, os.path.join(scratch, "b")), llm.runner.device)[0]
        shutil.rmtree(os.path.join(scratch, "b"), ignore_errors=True)
        return wall

    order = ["a", "b", "j", "j1"]
    for rep in range(args.repeats + 1):  # pass 0 warms up (allocator, lazy imports, the OS's file cache)
        times = {}
        for name in order[rep % 4:] + order[:rep % 4]:  # rotate who goes first
            if name == "a":
                times["a"] = bx.timed(lambda: bx.run_bare(llm, batches), llm.runner.device)[0]
            elif name == "b":
                times["b"] = engine()
            else:
                times[name] = job(name, rep)
        if rep:
            for k, v in times.items():
                runs[k].append(v)
    if job_tokens != tokens:
        raise RuntimeError(f"the job extracted {job_tokens} tokens, the in-process rows {tokens}: not the same corpus")
    manifest_bytes = sum(f.stat().st_size for f in Path(last_output, "manifest").rglob("*") if f.is_file())
    t0 = time.perf_counter()
    again = run_job(job_config(args, llm.config.model, corpus, last_output, layers))
    resume_s = time.perf_counter() - t0
    if again.skipped != len(ids) or again.ok:
        raise RuntimeError(f"rerun of a finished job extracted {again.ok} and skipped {again.skipped} of {len(ids)}")
    shutil.rmtree(last_output, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in runs.items()}
    res = {"tokens": tokens, "samples": len(ids), "forwards": len(batches), "approaches": {}, "ratios": {},
           "resume_s": resume_s, "manifest_bytes": manifest_bytes, "manifest_bytes_per_sample": manifest_bytes / len(ids)}
    for k, v in runs.items():
        res["approaches"][k] = {"wall_s": v, "median_wall_s": med[k],
                                "tokens_per_s": (1 if k == "j1" else tokens) / med[k]}
    res["ratios"]["j_over_b"] = statistics.median(runs["b"][i] / runs["j"][i] for i in range(args.repeats))
    res["ratios"]["j_over_a"] = statistics.median(runs["a"][i] / runs["j"][i] for i in range(args.repeats))
    res["ratios"]["j_steady_over_b"] = statistics.median(
        runs["b"][i] / max(runs["j"][i] - runs["j1"][i], 1e-9) for i in range(args.repeats))
    return res


def bench_memory(args, model_dir: str, texts: list[str], tokens: int, layers, scratch: str) -> dict:
    """Jobs over the corpus and over it `memory_scale` times; units of work are at most a quarter of the corpus, so
    that both sizes run several (a worker's memory follows its unit of work, not the corpus)."""
    res = {}
    unit = min(args.tokens_per_task or 32768, max(1, tokens // 4))
    args = argparse.Namespace(**{**vars(args), "tokens_per_task": unit})
    res["tokens_per_task"] = unit
    for scale in (1, args.memory_scale):
        corpus = write_corpus(os.path.join(scratch, f"memory-x{scale}.jsonl"), texts, copies=scale)
        out = os.path.join(scratch, f"memory-job-x{scale}")
        bx.reset_peak_rss()
        with ProcessPeaks() as peaks:
            t0 = time.perf_counter()
            result = run_one_job(job_config(args, model_dir, corpus, out, layers), len(texts) * scale)
            wall = time.perf_counter() - t0
        res[f"x{scale}"] = {"samples": len(texts) * scale, "tokens": result.tokens, "wall_s": wall,
                            "driver_peak_rss_bytes": bx.peak_rss(),
                            "worker_peak_rss_bytes": peaks.peak_of("ExtractionWorker"),
                            "tokenizer_peak_rss_bytes": peaks.peak_of("TokenizeStage"),
                            "worker_peak_private_bytes": peaks.peak_of("ExtractionWorker", private=True),
                            "tokenizer_peak_private_bytes": peaks.peak_of("TokenizeStage", private=True),
                            "worker_private_thirds_bytes": peaks.drift_of("ExtractionWorker")}
        shutil.rmtree(out, ignore_errors=True)
    res["malloc_mmap_threshold"] = os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default (dynamic)")
    k = f"x{args.memory_scale}"
    for who in ("driver", "worker", "tokenizer", "worker_private", "tokenizer_private"):
        key = f"{who}_bytes" if who.endswith("private") else f"{who}_rss_bytes"
        key = key.replace("_private_bytes", "_peak_private_bytes").replace("_rss_bytes", "_peak_rss_bytes")
        small, large = res["x1"][key], res[k][key]
        res[f"{who}_growth"] = (large / small - 1) if small and large else None
    return res


def markdown(r: dict) -> str:
    c = r["config"]
    lines = [f"## hsx job benchmark — small, float32, cpu, {c['workers']} worker(s)", "",
             f"Machine: {r['machine']['cpu_model']}; {r['machine']['cpu_affinity']} CPU cores usable; torch "
             f"{r['machine']['torch']}; Ray {r['ray']} (local, {r['ray_cpus']} logical CPUs, started in "
             f"{r['ray_start_s']:.1f} s); load average {r['load_before']} before, {r['load_after']} after.", ""]
    s = r.get("speed")
    if s:
        lines += [f"Corpus: {s['samples']} samples, {s['tokens']} tokens, log-uniform lengths {c['min_len']}-"
                  f"{c['max_len']}; layers {c['layers']}; {c['repeats']} repeats after a warm-up, medians.", "",
                  "| approach | tokens/s | wall s (median) |", "|---|---:|---:|"]
        names = {"a": "(a) bare forward over the engine's batches (limit)", "b": "(b) engine alone, files written",
                 "j": "(j) `hsx run` job: read, tokenize, extract, write, manifest", "j1": "(j1) job over one sample "
                 "(fixed cost: actors start, model loads)"}
        for key, row in s["approaches"].items():
            rate = f"{row['tokens_per_s']:,.0f}" if key != "j1" else "-"
            lines.append(f"| {names[key]} | {rate} | {row['median_wall_s']:.2f} |")
        lines += ["", "| ratio | value |", "|---|---:|",
                  f"| j/b (whole job vs engine alone) | {s['ratios']['j_over_b']:.3f} |",
                  f"| j/a (whole job vs the limit) | {s['ratios']['j_over_a']:.3f} |",
                  f"| steady j/b (fixed cost taken out) | {s['ratios']['j_steady_over_b']:.3f} |", "",
                  f"Rerun of the finished job (all {s['samples']} skipped from the manifest): {s['resume_s']:.1f} s. "
                  f"Manifest: {s['manifest_bytes']:,} bytes ({s['manifest_bytes_per_sample']:.0f} per sample)."]
    m = r.get("memory")
    if m:
        k = f"x{c['memory_scale']}"
        lines += ["", f"Memory: one job per size, --tokens-per-task {m['tokens_per_task']}; MALLOC_MMAP_THRESHOLD_ = "
                  f"{m['malloc_mmap_threshold']}.", "",
                  "| memory job | samples | tokens | driver peak | tokenizer peak | worker peak | wall s |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for key in ("x1", k):
            row = m[key]
            lines.append(f"| {key} | {row['samples']} | {row['tokens']} | {_mib(row['driver_peak_rss_bytes'])} | "
                         f"{_mib(row['tokenizer_peak_rss_bytes'])} | {_mib(row['worker_peak_rss_bytes'])} | "
                         f"{row['wall_s']:.1f} |")
        lines += ["", "| memory job | tokenizer private peak | worker private peak | worker private, middle -> last "
                  "third of the job |", "|---|---:|---:|---:|"]
        for key in ("x1", k):
            row = m[key]
            thirds = row["worker_private_thirds_bytes"]
            drift = (f"{_mib(thirds[0])} -> {_mib(thirds[1])} ({thirds[1] / thirds[0] - 1:+.1%})" if thirds
                     else "n/a")
            lines.append(f"| {key} | {_mib(row['tokenizer_peak_private_bytes'])} | "
                         f"{_mib(row['worker_peak_private_bytes'])} | {drift} |")
        growth = ", ".join(f"{who.replace('_', ' ')} {_pct(m[f'{who}_growth'])}"
                           for who in ("driver", "tokenizer", "worker", "tokenizer_private", "worker_private"))
        ok = all(m[f"{who}_growth"] is not None and m[f"{who}_growth"] <= TARGETS["memory_growth"]
                 for who in ("worker", "tokenizer"))
        lines.append(f"\nPeak RSS growth x1 -> {k}: {growth} (target <= {TARGETS['memory_growth']:.0%} for the "
                     f"actors: {'yes' if ok else 'no'}). Peaks are VmHWM per process (the driver's reset before "
                     "each job; it includes the in-process engine of the speed section); private = RssAnon sampled "
                     "every 0.1 s, without the object store's shared pages. A peak over a longer run also meets "
                     "rarer coincidences (a long batch while writes are in flight); a leak shows as drift between "
                     "the middle and the last third.")
    return "\n".join(lines) + "\n"


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:+.2%}"


def main(argv: list[str] | None = None) -> None:
    import ray

    args = parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    os.makedirs(args.out, exist_ok=True)
    bargs = argparse.Namespace(shape="small", dtype="float32", vocab_size=None, device="cpu", seed=0,
                               model_dir=args.model_dir or os.path.join(args.out, "model-small-float32"))
    bx.build_model(bargs)
    scratch = os.path.join(args.out, "scratch-job")
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    load_before = [round(x, 2) for x in os.getloadavg()]
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.malloc_mmap_threshold:
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(args.malloc_mmap_threshold))
    t0 = time.perf_counter()
    ray_cpus = max(4, os.cpu_count() or 1)  # what `hsx run` starts when no cluster is given
    ray.init(num_cpus=ray_cpus, include_dashboard=False, logging_level="WARNING")
    ray_start = time.perf_counter() - t0
    try:
        num_layers = json.load(open(os.path.join(bargs.model_dir, "config.json")))["num_hidden_layers"]
        layers = list(default_layer_ids(num_layers))
        llm = bx.make_llm(argparse.Namespace(model_dir=bargs.model_dir, dtype="float32", device="cpu", attn="sdpa",
                                             max_num_batched_tokens=args.max_num_batched_tokens),
                          layers, os.path.join(scratch, "b"))
        token_stream = bx.make_corpus(llm.tokenizer, args.num_samples, args.min_len, args.max_len, args.seed)
        texts = [llm.tokenizer.decode(s) for s in token_stream]
        ids = [list(llm.tokenizer(t).input_ids) for t in texts]  # what the job's tokenizer actors compute
        corpus = write_corpus(os.path.join(scratch, "corpus.jsonl"), texts)
        shortest = min(range(len(ids)), key=lambda i: len(ids[i]))
        one = write_corpus(os.path.join(scratch, "one.jsonl"), [texts[shortest]])
        results = {"config": {"num_samples": args.num_samples, "min_len": args.min_len, "max_len": args.max_len,
                              "repeats": args.repeats, "workers": args.workers, "layers": layers,
                              "max_num_batched_tokens": args.max_num_batched_tokens,
                              "memory_scale": args.memory_scale},
                   "machine": bx.machine_info(llm.runner.device), "ray": ray.__version__, "ray_cpus": ray_cpus,
                   "ray_start_s": ray_start, "load_before": load_before}
        if "speed" in args.sections:
            results["speed"] = bench_speed(args, llm, ids, corpus, one, layers, scratch)
        llm.shutdown()
        if "memory" in args.sections:
            results["memory"] = bench_memory(args, bargs.model_dir, texts, sum(map(len, ids)), layers, scratch)
    finally:
        ray.shutdown()
    results["load_after"] = [round(x, 2) for x in os.getloadavg()]
    shutil.rmtree(scratch, ignore_errors=True)
    bx.write_results(args.out, "results-job", results, markdown(results))


if __name__ == "__main__":
    main()
