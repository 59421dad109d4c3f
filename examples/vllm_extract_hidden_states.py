"""vLLM's `extract_hidden_states` example, with hsx's connector as the plug-in: real vLLM captures the layers, hsx
writes them (any fsspec URL, fp8, checksums, the custom-path policy), and either loader reads them back.

    python examples/vllm_extract_hidden_states.py --model MODEL_DIR --output /tmp/hs
    python examples/vllm_extract_hidden_states.py --model MODEL_DIR --output s3://bucket/hs \
        --storage-options '{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}'

Needs vLLM (docs/engines.md: on CPU, infra/vllm_cpu_venv.sh's venv). Prints each request's file and what it holds.
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a local model folder")
    p.add_argument("--output", required=True, help="a local folder or an fsspec URL (s3://bucket/prefix)")
    p.add_argument("--storage-options", default="{}", help="fsspec options for --output, as JSON")
    p.add_argument("--layers", default="1,2,3,4", help="layer ids (vLLM's: 0 = embeddings, k = after layer k-1)")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; a CPU build's default is larger than this needs

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from connectors import load_hidden_states

    options = json.loads(args.storage_options)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=512,
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {
                                      "eagle_aux_hidden_state_layer_ids": [int(i) for i in args.layers.split(",")]}}},
              kv_transfer_config=KVTransferConfig(
                  kv_connector="HsxHiddenStatesConnector", kv_connector_module_path="vllm_engine.connector",
                  kv_role="kv_producer",
                  kv_connector_extra_config={"shared_storage_path": args.output, "allow_custom_save_path": True,
                                             "storage_options": options}))
    prompts = ["Hello, my name is", "The capital of France is"]
    params = [SamplingParams(max_tokens=1),
              SamplingParams(max_tokens=10, extra_args={"kv_transfer_params": {
                  "hidden_states_path": args.output.rstrip("/") + "/custom_output.safetensors",
                  "include_output_tokens": True}})]
    for out in llm.generate(prompts, params):
        path = out.kv_transfer_params.get("hidden_states_path")
        obj = load_hidden_states(path, storage_options=options)  # waits for the file if it is still being written
        print(json.dumps({"prompt": out.prompt, "path": path, "token_ids": obj["token_ids"].shape[0],
                          "hidden_states": list(obj["hidden_states"].shape)}), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps it from running this again
    main()
