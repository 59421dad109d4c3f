"""Speculative decoding on hsx: generate with ngram or a draft model, print vLLM's acceptance figures.

    python examples/spec_decode.py --method ngram --num-spec-tokens 3
    python examples/spec_decode.py --method draft_model --model TARGET_DIR --draft-model DRAFT_DIR
    python examples/spec_decode.py --method eagle3 --model TARGET_DIR --draft-model HEAD_DIR   # hsx train-drafter
    python examples/spec_decode.py --method eagle --model TARGET_DIR --draft-model HEAD_DIR    # --kind eagle
    python examples/spec_decode.py --method eagle3 --parallel-drafting --model TARGET_DIR --draft-model HEAD_DIR  # peagle
    python examples/spec_decode.py --method mtp --model TARGET_DIR      # the target's own MTP layers (DeepSeek-V3 ...)
    python examples/spec_decode.py --dataset-path prompts.jsonl      # {"prompt": ...} or ShareGPT {"conversations": [...]}
    python examples/spec_decode.py --custom-mm-prompts --backend openai-chat --method eagle3 --model VL_TARGET \
        --draft-model HEAD_DIR
                                                     # image prompts (local pictures drawn here) on a VL target

Without --model it builds a tiny random Llama locally (reference.tiny_models, no downloads), and for draft_model a 2-layer
draft cut from it (same tokenizer); for mtp a tiny DeepSeek-V3-style target with one random MTP layer. Without
--dataset-path the prompts are lines of a Python standard-library source file, which ships with every Python. The printed lines are the ones vLLM's examples/offline_inference/spec_decode.py
prints, computed the same way from `llm.get_metrics()`: mean acceptance length = 1 + accepted / drafts, acceptance
at token i = drafts whose i-th token was accepted / drafts.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import textwrap

from extractor import LLM, SamplingParams
from extractor.config import drafter_methods, model_optional
from extractor.metrics import Counter, Vector


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    heads = drafter_methods()  # the registry's drafter families
    own = [m for m in heads if model_optional(m)]  # drafted by the target's own layers (mtp): no --draft-model
    p.add_argument("--method", choices=["ngram", "draft_model", *heads], default="ngram",
                   help=f"{' / '.join(heads)}: a head trained with `hsx train-drafter` (--draft-model DIR)")
    p.add_argument("--num-spec-tokens", type=int, default=3, help="k, tokens drafted per step")
    p.add_argument("--parallel-drafting", action="store_true",
                   help="all k drafts in one drafter forward (a head trained for it: hsx train-drafter --kind peagle)")
    p.add_argument("--prompt-lookup-max", type=int, default=5, help="ngram: longest suffix n-gram tried")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: shortest suffix n-gram tried")
    p.add_argument("--model", default=None, help="target model folder (default: a tiny Llama built locally)")
    p.add_argument("--draft-model", default=None,
                   help="draft_model: draft folder, same vocabulary (default with the tiny target: its first 2 layers); "
                        "a drafter family: the trained head's folder")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per prompt")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--dataset-path", default=None,
                   help='local JSONL: one {"prompt": ...} or ShareGPT {"conversations": [...]} object a line')
    p.add_argument("--backend", choices=["openai", "openai-chat"], default="openai",
                   help="openai: llm.generate on the prompts; openai-chat: llm.chat on them as user messages "
                        "(vLLM's flag; --custom-mm-prompts needs openai-chat)")
    p.add_argument("--custom-mm-prompts", action="store_true",
                   help="image prompts (vLLM's flag): chats with an image_url part each, about pictures drawn here "
                        "(reference/vl_target.py, no downloads); needs a vision-language --model (default: "
                        "a tiny random Qwen2.5-VL)")
    p.add_argument("--print-output", action="store_true", help="print each prompt's generated text")
    args = p.parse_args(argv)
    if args.custom_mm_prompts and args.backend != "openai-chat":
        p.error("--custom-mm-prompts are chat conversations with image parts: pass --backend openai-chat")
    if args.draft_model and args.method == "ngram":
        p.error(f"--draft-model needs --method draft_model or one of {', '.join(heads)}")
    if args.method in heads and args.method not in own and not (args.model and args.draft_model):
        p.error(f"--method {args.method} needs --model TARGET_DIR and --draft-model HEAD_DIR (a head trained on a run "
                "of that target: hsx train-drafter --kind ... --out HEAD_DIR)")
    if args.method == "draft_model" and args.model and not args.draft_model:
        p.error("--method draft_model with --model needs --draft-model DIR (a smaller model with the same vocabulary)")
    return args


def build_tiny_models(root: str, with_draft: bool, mtp: bool = False) -> tuple[str, str | None]:
    """A tiny random Llama (4 layers; with `mtp` a DeepSeek-V3-style target with one MTP layer) and, if asked, a draft
    holding its first 2 layers; returns their folders."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reference.tiny_models import add_mtp_layers, build_tiny_model

    if mtp:
        return add_mtp_layers(build_tiny_model("deepseek_v3", os.path.join(root, "target"))), None
    target = build_tiny_model("llama", os.path.join(root, "target"))
    if not with_draft:
        return target, None
    draft = os.path.join(root, "draft-2-layers")
    small = AutoModelForCausalLM.from_pretrained(target)
    small.model.layers = small.model.layers[:2]
    small.config.num_hidden_layers = 2
    small.save_pretrained(draft)
    AutoTokenizer.from_pretrained(target).save_pretrained(draft)
    return target, draft


def load_prompts(path: str | None, n: int) -> list[str]:
    """The first `n` prompts of a JSONL file ({"prompt"} or ShareGPT's first human turn), or stdlib source lines."""
    if path is None:
        lines = [ln.strip() for ln in open(textwrap.__file__, encoding="utf-8") if len(ln.strip()) > 20]
        return [" ".join(lines[3 * i:3 * i + 3]) for i in range(min(n, len(lines) // 3))]
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt" in row:
                prompts.append(str(row["prompt"]))
            elif "conversations" in row:
                turns = [t.get("value", t.get("content", "")) for t in row["conversations"]
                         if t.get("from", t.get("role")) in ("human", "user")]
                if turns:
                    prompts.append(str(turns[0]))
            else:
                raise ValueError(f"{path}:{lineno}: expected a 'prompt' or 'conversations' key, got {sorted(row)}")
            if len(prompts) == n:
                break
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def acceptance(metrics, k: int) -> dict:
    """vLLM's speculative-decoding counters summed from get_metrics(): drafts, draft and accepted tokens, per position."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "per_pos": [0] * k}
    names = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
    for m in metrics:
        if m.name in names:
            assert isinstance(m, Counter)
            out[names[m.name]] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            assert isinstance(m, Vector)
            for i, v in enumerate(m.values):
                out["per_pos"][i] += v
    return out


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hsx-spec-decode-") as root:
        model, draft = args.model, args.draft_model
        if model is None and args.custom_mm_prompts:
            from reference.tiny_models import build_tiny_vl_model

            model = build_tiny_vl_model(os.path.join(root, "target"))
        elif model is None:
            model, built_draft = build_tiny_models(root, with_draft=args.method == "draft_model" and not draft,
                                                   mtp=args.method == "mtp")
            draft = draft or built_draft
        k = args.num_spec_tokens
        if args.method == "ngram":
            spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": args.prompt_lookup_max,
                    "prompt_lookup_min": args.prompt_lookup_min}
        else:
            spec = {"method": args.method, "model": draft, "num_speculative_tokens": k}
            if draft is None:  # mtp: the target's own folder, as vLLM's script passes it
                del spec["model"]
            if args.parallel_drafting:
                spec["parallel_drafting"] = True
        params = SamplingParams(temperature=args.temp, max_tokens=args.output_len)
        if args.custom_mm_prompts:  # chats about pictures drawn here, loaded as vLLM loads local media
            from reference.vl_target import image_chats

            media = os.path.join(root, "images")
            records = image_chats(args.num_prompts, seed=20261207, folder=media, answers=False)
            llm = LLM(model=model, speculative_config=spec, allowed_local_media_path=media)
            prompts = [f"[{r['messages'][0]['content'][0]['image_url']['url']}] "
                       f"{r['messages'][0]['content'][1]['text']}" for r in records]
            outputs = llm.chat([r["messages"] for r in records], params)
        else:
            llm = LLM(model=model, speculative_config=spec)
            prompts = load_prompts(args.dataset_path, args.num_prompts)
            outputs = (llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
                       if args.backend == "openai-chat" else llm.generate(prompts, params))
        if args.print_output:
            for prompt, out in zip(prompts, outputs):
                print("-" * 50)
                print(f"prompt: {prompt}")
                print(f"generated text: {out.outputs[0].text}")
        failed = [o.error for o in outputs if o.error]
        if failed:
            raise SystemExit(f"{len(failed)} of {len(outputs)} requests failed, first: {failed[0]}")
        stats = acceptance(llm.get_metrics(), k)

    drafts = stats["num_drafts"]
    mean_al = 1 + stats["num_accepted_tokens"] / drafts if drafts else 1.0
    print("-" * 50)
    print(f"total_num_output_tokens: {sum(len(o.outputs[0].token_ids) for o in outputs)}")
    print(f"num_drafts: {drafts}")
    print(f"num_draft_tokens: {stats['num_draft_tokens']}")
    print(f"num_accepted_tokens: {stats['num_accepted_tokens']}")
    print(f"mean acceptance length: {mean_al:.2f}")
    print("-" * 50)
    for i, n in enumerate(stats["per_pos"]):
        print(f"acceptance at token {i}: {n / drafts if drafts else 0:.2f}")
    return mean_al


if __name__ == "__main__":
    main()
