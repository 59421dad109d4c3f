"""EAGLE-3 on image prompts: a head trained with the target's vision embeddings at image tokens (what vLLM's proposer
feeds it) against one trained with the image placeholder's embedding (what peers' trainers fed), both decoded the way
vLLM serves them (the vision embeddings at image tokens), on held-out pictures.

    python benchmarks/bench_vl_drafters.py --quick          # few scenes and steps: the plumbing (~2 min)
    python benchmarks/bench_vl_drafters.py --out bench-out  # the figures in docs/drafters.md (results-vl-drafters.*)

1. The reference vision-language target (reference/vl_target.py: a small Qwen2.5-VL trained here on drawn
   pictures of shapes, colours and digits with questions only the picture answers), cached.
2. A corpus of --train-scenes pictures (PNG files) with chats about them, and an hsx run of it (the `hsx run` job,
   --allowed-local-media-path, --mm-embeds: the merged embeddings at image tokens stored).
3. `hsx train-drafter --kind eagle3` on that run twice, same seed and steps: --image-inputs vision and placeholder.
4. Greedy decoding of --eval-scenes held-out pictures' questions (another seed) with each head in hsx's engine, which
   feeds EAGLE-3 heads the vision embeddings at image tokens as vLLM does; every output checked equal to plain greedy
   decoding; mean acceptance length and tokens per target step from vLLM's metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few scenes and steps: proves the plumbing")
    ap.add_argument("--target-steps", type=int, default=None, help="reference target steps (default its own)")
    ap.add_argument("--train-scenes", type=int, default=2000)
    ap.add_argument("--eval-scenes", type=int, default=48)
    ap.add_argument("--steps", type=int, default=400, help="drafter training steps (each head)")
    ap.add_argument("-k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--work", default=None, help="work folder (default $HSX_CACHE/bench-vl-drafters)")
    ap.add_argument("--out", default=None, help="write results.json and table.md here")
    args = ap.parse_args(argv)
    if args.quick:
        args.train_scenes, args.eval_scenes, args.steps = 64, 8, 10
        args.target_steps = args.target_steps or 40
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from PIL import Image
    from transformers import AutoTokenizer

    from benchmarks.common import lossless_status, write_results
    from jobs.config import JobConfig
    from jobs.pipeline import run_job
    from reference.vl_target import VLTargetConfig, build_vl_target, heldout_seed, image_chats
    from training.evaluate import comparison_table, evaluate_speculation
    from training.train_config import TrainDrafterConfig
    from training_jobs.train import train_drafter

    started = time.time()
    base = args.work or os.path.join(os.environ.get("HSX_CACHE") or os.path.expanduser("~/.cache/hsx"),
                                     "bench-vl-drafters" + ("-quick" if args.quick else ""))
    target_config = VLTargetConfig(**({"steps": args.target_steps} if args.target_steps else {}),
                                   **({"train_scenes": 400, "heldout_scenes": 8} if args.quick else {}),
                                   threads=args.threads)
    target = build_vl_target(target_config)
    print(f"target {target.path} (cached {target.cached}): held-out answer accuracy "
          f"{target.report['heldout_answer_accuracy']:.0%}", flush=True)
    work = os.path.join(base, target_config.digest() + f"-{args.train_scenes}")
    images = os.path.join(work, "images")
    corpus = os.path.join(work, "corpus.jsonl")
    if not os.path.exists(corpus):
        records = image_chats(args.train_scenes, seed=7, folder=images)
        with open(corpus + ".tmp", "w") as f:
            f.writelines(json.dumps({"id": r["id"], "messages": r["messages"]}) + "\n" for r in records)
        os.replace(corpus + ".tmp", corpus)
    run = os.path.join(work, "run")
    result = run_job(JobConfig(model=target.path, corpus=(corpus,), output=run, workers=1, dtype="float32",
                               cpus_per_worker=args.threads, progress=False, fail_on_error=True,
                               allowed_local_media_path=images, mm_embeds=True))
    print(f"run {run}: {result.ok} samples", flush=True)
    heads = {}
    for mode in ("vision", "placeholder"):
        out = os.path.join(work, f"eagle3-{mode}-{args.steps}")
        if not os.path.exists(os.path.join(out, "config.json")):
            train_drafter(TrainDrafterConfig(run=run, model=target.path, out=out, kind="eagle3", steps=args.steps,
                                             batch_tokens=2048, lr=1e-3, device="cpu", progress=False, seed=0,
                                             image_inputs=mode))
        heads[mode] = out

    tokenizer = AutoTokenizer.from_pretrained(target.path)
    held = os.path.join(work, "heldout")
    prompts = []
    for r in image_chats(args.eval_scenes, seed=heldout_seed(target_config), folder=held, answers=False):
        url = r["messages"][0]["content"][0]["image_url"]["url"]
        user = [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                  "text": r["messages"][0]["content"][1]["text"]}]}]
        text = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        prompts.append({"prompt": text, "multi_modal_data": {"image": [Image.open(os.path.join(held, url))]}})
    methods = {f"eagle3 trained on {mode} embeddings k={args.k}": {
        "method": "eagle3", "model": path, "num_speculative_tokens": args.k} for mode, path in heads.items()}
    results = evaluate_speculation(target.path, prompts, methods, args.max_tokens, ignore_eos=False,
                                   threads=args.threads, max_num_seqs=1)
    table = comparison_table(results)
    summary = {"target": target.path, "target_report": {k: v for k, v in target.report.items() if k != "loss_curve"},
               "train_scenes": args.train_scenes, "eval_scenes": args.eval_scenes, "steps": args.steps, "k": args.k,
               "results": [{"method": r.method, "mean_acceptance_length": r.mean_acceptance_length,
                            "tokens_per_target_step": r.tokens_per_target_step, "lossless": r.lossless,
                            "acceptance_per_position": r.acceptance_per_position} for r in results],
               "seconds": round(time.time() - started, 1)}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_results(args.out, "results-vl-drafters", summary, "\n".join(table) + "\n")
    else:
        print("\n".join(table))
    return lossless_status([r.method for r in results if not r.lossless])


if __name__ == "__main__":
    sys.exit(main())
