"""hsx reference models: targets built here, no downloads — used by `hsx demo`, `hsx eval-drafter` (its default
target), the benchmarks and the tests.

    tiny_models.py     small random causal LMs (one per family hsx runs) and a locally trained tokenizer: they measure
                       machinery, not drafters
    target.py          a small target trained locally on the standard library's sources, for acceptance figures
                       (a Llama, or a DeepSeek-V3 / Qwen3-Next with native MTP layers)
    stdlib_corpus.py   its corpus: the standard library's .py files split by a hash, the byte-level BPE trained on
                       them, the token blocks, the held-out blocks and prompts
    vl_target.py       a small Qwen2.5-VL trained locally on drawn pictures, for acceptance on image prompts; the VL
                       configs, tokenizer and folder layout tiny_models' random ones share

Imports drafters (MTP layers) and extractor; torch and transformers inside the functions that build models.
"""
