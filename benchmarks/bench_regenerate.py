"""`hsx regenerate` against live `hsx serve` processes: requests/s and generated tokens/s by --concurrency against one
server, and one regeneration of --prompts prompts through two servers vs one.

    python benchmarks/bench_regenerate.py --out bench-out              # CPU: a small random Llama, ~4 min
    python benchmarks/bench_regenerate.py --hidden-size 512 --max-tokens 64 --prompts 512

Each server is the real CLI (`hsx serve`, its own local Ray, one engine replica); each measurement is one `hsx
regenerate` (Python API) into a fresh output, greedy, --max-tokens per prompt, prompts of 3-40 words. hsx serve
writes every request's hidden-state file as well (it is an extraction server): on a GPU host serving from vLLM those
writes are not there. On a 2-core CPU machine two servers share the same cores, so two servers vs one shows the
spreading's cost, not a speed-up; on GPUs (a server each) the same command measures the scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_results  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--sweep-prompts", type=int, default=128, help="prompts per concurrency of the sweep")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--layers-model", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from harness.serving import API_KEY, ServeProcess
    from reference.tiny_models import build_tiny_model, sample_text
    from regeneration.config import RegenerateConfig
    from regeneration.regenerate import regenerate

    work = args.work or tempfile.mkdtemp(prefix="hsx-bench-regenerate-")
    model = build_tiny_model("llama", os.path.join(work, "model"), hidden_size=args.hidden_size,
                             intermediate_size=args.hidden_size * 2, num_hidden_layers=args.layers_model,
                             num_attention_heads=4, num_key_value_heads=2)
    corpus = os.path.join(work, "prompts.jsonl")
    with open(corpus, "w") as f:
        for i, text in enumerate(sample_text(max(args.prompts, args.sweep_prompts), seed=1)):
            f.write(json.dumps({"id": f"p{i}", "prompt": text}) + "\n")
    sweep_corpus = os.path.join(work, "sweep.jsonl")
    with open(corpus) as src, open(sweep_corpus, "w") as dst:
        dst.writelines(line for _, line in zip(range(args.sweep_prompts), src))
    layers = (1, args.layers_model // 2, args.layers_model)
    flags = {"layers": layers, "max_num_seqs": args.max_num_seqs, "max_queued_requests": 4096}
    servers = [ServeProcess(model, os.path.join(work, f"serve{i}"), os.path.join(work, f"serve{i}.log"), **flags)
               for i in range(2)]
    runs = 0

    def one(urls, path, concurrency) -> dict:
        nonlocal runs
        runs += 1
        t0 = time.perf_counter()
        r = regenerate(RegenerateConfig(server=tuple(urls), corpus=(path,), output=os.path.join(work, f"out{runs}"),
                                        api_key=API_KEY, max_tokens=args.max_tokens, concurrency=concurrency,
                                        progress=False))
        secs = time.perf_counter() - t0
        assert r.failed == 0 and r.ok == r.records, r.lines()
        generated = r.tokens - sum_prompt_tokens(os.path.join(work, f"out{runs}"))
        return {"servers": len(urls), "concurrency": concurrency, "records": r.ok, "seconds": secs,
                "requests/s": r.requests / secs, "generated tokens/s": generated / secs}

    try:
        one([servers[0].url], sweep_corpus, 4)  # warm-up
        sweep = [one([servers[0].url], sweep_corpus, c) for c in args.concurrency]
        c = max(args.concurrency[-1] // 2, 1)
        single = one([servers[0].url], corpus, 2 * c)
        double = one([s.url for s in servers], corpus, c)  # the same requests in flight in all
    finally:
        for s in servers:
            s.kill()
    rows = [*sweep, single, double]
    md = ["| servers | concurrency (per server) | records | seconds | requests/s | generated tokens/s |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['servers']} | {r['concurrency']} | {r['records']} | {r['seconds']:.1f} | {r['requests/s']:.1f} | "
           f"{r['generated tokens/s']:.0f} |" for r in rows]
    md.append(f"\ntwo servers / one, same requests in flight: {double['requests/s'] / single['requests/s']:.2f}x "
              f"({os.cpu_count()} CPU cores shared by both servers)")
    text = "\n".join(md) + "\n"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_results(args.out, "regenerate", {"rows": rows, "args": vars(args)}, text)
    else:
        print(text)


def sum_prompt_tokens(out: str) -> int:
    import pyarrow.compute as pc

    from connectors.manifest import read_manifest

    return int(pc.sum(read_manifest(out, columns=["num_prompt_tokens"])["num_prompt_tokens"]).as_py() or 0)


if __name__ == "__main__":
    main()
