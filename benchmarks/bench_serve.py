"""Online vs offline: `hsx serve` with concurrent clients against `LLM.generate` on the same prompts.

    python benchmarks/bench_serve.py                         # CPU: a small random Llama, 256 prompts, 16 clients
    python benchmarks/bench_serve.py --hidden-size 1024 --layers-model 16 --repeats 3   # CPU, a model with real work
    python benchmarks/bench_serve.py --device cuda --prompts 2048 --hidden-size 1024 --layers-model 16

Both sides run the same engine settings (model, layers, dtype, max_num_seqs, max_num_batched_tokens) and the same
prompts: real text (the Python standard library's sources) through the local BPE tokenizer, cut to log-uniform
lengths in [--min-len, --max-len], sent as token ids with max_tokens=1 (what speculators' data generation sends).

    offline   one `LLM.generate` over every prompt (files durable when it returns); per-request latency = that call
    online    `hsx serve` (the real CLI, its own local Ray, one replica with as many CPU threads as this process)
              and --clients threads of the official openai client, each sending one prompt at a time from a shared
              queue; per-request latency = send to answer (file durable); throughput = prompts / wall time

    offline, matched   when the replica holds fewer CPU threads than this process (--replica-cpus 1 on a 2-core
              machine, where the HTTP side needs the other core), the offline engine also runs with the replica's
              thread count: the same compute on both sides, so the ratio isolates what serving costs (HTTP, the
              gather window, smaller batches), as it would on a GPU host whose HTTP side runs on spare host cores

Warm-up on both sides first; --repeats rounds, offline and online alternating; medians reported. Never pass/fail: the
issue's target (online/offline throughput >= 0.9) is printed beside the figure.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET_RATIO = 0.9


def stdlib_prompts(tokenizer, n: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """n token-id prompts of log-uniform lengths cut from the standard library's sources."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    rng = random.Random(seed)
    stream: list[int] = []
    for path in rng.sample(files, min(len(files), 40)):
        with open(path, encoding="utf-8", errors="replace") as f:
            stream += tokenizer(f.read()).input_ids
        if len(stream) > n * max_len:
            break
    prompts, pos = [], 0
    for _ in range(n):
        length = int(math.exp(rng.uniform(math.log(min_len), math.log(max_len))))
        if pos + length > len(stream):
            pos = 0
        prompts.append(stream[pos:pos + length])
        pos += length
    return prompts


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def run_offline(llm, prompts: list[list[int]], threads: int | None = None) -> dict:
    import torch

    from extractor import SamplingParams

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1))
        wall = time.perf_counter() - start
    finally:
        torch.set_num_threads(previous)
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error][:3]
    return {"wall": wall, "latencies": [wall] * len(prompts)}


def run_online(server, prompts: list[list[int]], clients: int) -> dict:
    todo = list(enumerate(prompts))
    lock = threading.Lock()
    latencies: list[float] = []
    errors: list[str] = []

    def client_loop():
        client = server.client()
        while True:
            with lock:
                if not todo:
                    return
                _, ids = todo.pop()
            t0 = time.perf_counter()
            try:
                r = client.completions.create(model=server.model, prompt=ids, max_tokens=1,
                                              extra_body={"return_token_ids": True})
                assert r.kv_transfer_params["hidden_states_path"]
            except Exception as e:  # counted, reported
                errors.append(f"{type(e).__name__}: {e}")
                continue
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} online requests failed, e.g. {errors[0]}")
    return {"wall": wall, "latencies": latencies}


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) so far of every process on this machine, by pid, with a short role label."""
    import psutil

    out = {}
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            t = p.cpu_times()
        except (psutil.Error, OSError):
            continue
        cmd = " ".join(p.info["cmdline"] or [])
        label = ("this process (the clients)" if p.pid == os.getpid() else
                 "hsx serve (the driver)" if "cli.main" in cmd or " -m cli " in f" {cmd} " else
                 cmd.split()[0].replace(".perform_graceful_shutdown", "") if cmd.startswith("ray::") else
                 "other Ray processes" if "ray" in cmd else "everything else")
        out[p.pid] = (label, t.user + t.system)
    return out


def engine_thread_schedstat() -> dict[int, tuple[float, float]]:
    """Per engine replica pid: (seconds on a CPU, seconds runnable but waiting for one) so far of its compute thread,
    from Linux's /proc/<pid>/task/<tid>/schedstat (empty where there is none). serve.engine names that thread
    hsx-engine; threads it starts without a name of their own (torch's intra-op pool) inherit it, so the one with the
    most CPU time is taken."""
    import psutil

    out = {}
    for p in psutil.process_iter(["cmdline"]):
        if "ServeReplica:hsx:Engine" not in " ".join(p.info["cmdline"] or []):
            continue
        for task in glob.glob(f"/proc/{p.pid}/task/*"):
            try:
                with open(f"{task}/comm") as f:
                    if f.read().strip() != "hsx-engine":
                        continue
                with open(f"{task}/schedstat") as f:
                    run_ns, wait_ns, _ = (int(x) for x in f.read().split())
            except (OSError, ValueError):
                continue
            if run_ns / 1e9 > out.get(p.pid, (-1.0, 0.0))[0]:
                out[p.pid] = (run_ns / 1e9, wait_ns / 1e9)
    return out


def cpu_by_role(before: dict, after: dict) -> dict[str, float]:
    roles: dict[str, float] = {}
    for pid, (label, seconds) in after.items():
        roles[label] = roles.get(label, 0.0) + seconds - before.get(pid, (label, 0.0))[1]
    return roles


def main() -> None:
    import torch

    from connectors import KVTransferConfig
    from extractor import LLM
    from harness.serving import ServeProcess
    from harness.specs import spec_config
    from reference.tiny_models import build_tiny_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--layers-model", type=int, default=4, help="decoder layers of the random model")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--replica-cpus", type=int, help="--cpus-per-replica (= the replica's torch threads); default "
                                                      "this process's torch threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", help="working folder (default: a temp folder, removed)")
    args = ap.parse_args()

    work = args.work or tempfile.mkdtemp(prefix="hsx-bench-serve-")
    model_dir = os.path.join(work, "model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        h = args.hidden_size
        build_tiny_model("llama", model_dir, hidden_size=h, intermediate_size=int(h * 3.5),
                         num_hidden_layers=args.layers_model, num_attention_heads=max(4, h // 64),
                         num_key_value_heads=max(1, h // 256), initializer_range=0.02)
    n = args.layers_model
    layers = sorted({2 % (n + 1), n // 2, max(0, n - 3), n})
    threads = torch.get_num_threads()
    llm = LLM(model=model_dir, speculative_config=spec_config(layers), device=args.device,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_transfer_config=KVTransferConfig(kv_connector_extra_config={
                  "shared_storage_path": os.path.join(work, "offline")}))
    prompts = stdlib_prompts(llm.get_tokenizer(), args.prompts, args.min_len, args.max_len, args.seed)
    tokens = sum(len(p) for p in prompts)
    run_offline(llm, prompts[:16])  # warm-up

    server = ServeProcess(model_dir, os.path.join(work, "online"), os.path.join(work, "serve.log"), layers=layers,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          device=args.device, cpus_per_replica=args.replica_cpus or threads, max_queued_requests=4 * args.clients,
                          max_prompt_tokens=args.max_len)
    try:
        run_online(server, prompts[:32], args.clients)  # warm-up
        replica_threads = args.replica_cpus or threads
        matched = replica_threads < threads
        rounds = {"offline": [], "online": [], "matched": []}
        cpu: dict[str, float] = {}
        engine_thread = [0.0, 0.0]  # the engine thread's seconds on a CPU, runnable waiting for one
        before = server.metrics()
        for _ in range(args.repeats):
            rounds["offline"].append(run_offline(llm, prompts))
            if matched:
                rounds["matched"].append(run_offline(llm, prompts, replica_threads))
            snap, sched = cpu_seconds(), engine_thread_schedstat()
            rounds["online"].append(run_online(server, prompts, args.clients))
            for role, seconds in cpu_by_role(snap, cpu_seconds()).items():
                cpu[role] = cpu.get(role, 0.0) + seconds
            for pid, after_pid in engine_thread_schedstat().items():
                if pid in sched:
                    engine_thread = [a + (y - x) for a, x, y in zip(engine_thread, sched[pid], after_pid)]
        after = server.metrics()
        engine = {k: after.get(k, 0) - before.get(k, 0) for k in
                  ("hsx_serve_batch_size_count", "hsx_serve_batch_size_sum", "hsx_serve_batch_seconds_sum")}
    finally:
        server.stop()
        server.kill()
        llm.shutdown()

    def summary(rs: list[dict]) -> dict:
        wall = statistics.median(r["wall"] for r in rs)
        lat = [x for r in rs for x in r["latencies"]]
        return {"prompts/s": len(prompts) / wall, "tokens/s": tokens / wall, "p50": percentile(lat, 0.5),
                "p99": percentile(lat, 0.99), "wall": wall}

    off, on = summary(rounds["offline"]), summary(rounds["online"])
    ratios = [len(prompts) / b["wall"] / (len(prompts) / a["wall"]) for a, b in zip(rounds["offline"], rounds["online"])]
    ratio = statistics.median(ratios)
    print(f"\n{len(prompts)} prompts, {tokens} tokens (lengths {args.min_len}-{args.max_len}), layers {layers}, "
          f"hidden {args.hidden_size} x {n} layers, {args.device}, {threads} threads offline, "
          f"{args.replica_cpus or threads} in the replica, max_num_seqs "
          f"{args.max_num_seqs}, {args.repeats} rounds (medians), load average {os.getloadavg()[0]:.1f}\n")
    print("| | prompts/s | tokens/s | p50 latency | p99 latency | wall |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| offline `LLM.generate` ({threads} threads) | {off['prompts/s']:.1f} | {off['tokens/s']:.0f} | "
          f"{off['p50']:.2f} s | {off['p99']:.2f} s | {off['wall']:.2f} s |")
    if matched:
        m = summary(rounds["matched"])
        print(f"| offline `LLM.generate` ({replica_threads} thread{'s' if replica_threads > 1 else ''}, as the "
              f"replica) | {m['prompts/s']:.1f} | {m['tokens/s']:.0f} | {m['p50']:.2f} s | {m['p99']:.2f} s | "
              f"{m['wall']:.2f} s |")
    print(f"| `hsx serve`, {args.clients} clients | {on['prompts/s']:.1f} | {on['tokens/s']:.0f} | "
          f"{on['p50'] * 1000:.0f} ms | {on['p99'] * 1000:.0f} ms | {on['wall']:.2f} s |")
    online_wall = sum(r["wall"] for r in rounds["online"])
    print(f"\nonline engine: {engine['hsx_serve_batch_size_count']:.0f} batches, "
          f"{engine['hsx_serve_batch_size_sum'] / max(1, engine['hsx_serve_batch_size_count']):.1f} prompts per batch, "
          f"busy {engine['hsx_serve_batch_seconds_sum'] / online_wall:.0%} of the wall time "
          f"({engine['hsx_serve_batch_seconds_sum']:.1f} s in engine calls)")
    if any(engine_thread):
        print(f"the engine's compute thread over the online rounds ({online_wall:.1f} s): on a CPU "
              f"{engine_thread[0] / online_wall:.0%}, runnable but waiting for a CPU {engine_thread[1] / online_wall:.0%}, "
              f"neither (waiting for work, the GIL or durable writes) "
              f"{max(0.0, online_wall - sum(engine_thread)) / online_wall:.0%}")
    print(f"CPU during the online rounds, in cores ({os.cpu_count()} on this machine): " + ", ".join(
        f"{role} {seconds / online_wall:.2f}" for role, seconds in sorted(cpu.items(), key=lambda kv: -kv[1])
        if seconds / online_wall >= 0.01))
    print(f"throughput online / offline: {ratio:.2f} (target >= {TARGET_RATIO}); per round: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}")
    if matched:
        same = [a["wall"] / b["wall"] for a, b in zip(rounds["matched"], rounds["online"])]
        print(f"throughput online / offline at the same {replica_threads} thread(s): {statistics.median(same):.2f} "
              f"(target >= {TARGET_RATIO}); per round: {', '.join(f'{r:.2f}' for r in same)}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
