#!/usr/bin/env bash
# The GPU checks in one command, made to fit one 10-minute command on a GPU machine (each step has its own time limit,
# 560 s in all; a step that runs out leaves the others' results; the tests are stopped with SIGINT so their failures
# are still listed; bench_extraction writes its timings before it profiles). First lease (H200): the tests need more
# than 120 s in 4 processes, the default 256-sample extraction with --profile more than 230 s:
#   1. the engine's tests on CUDA: tests/extractor (every engine test runs on CUDA when one is present, plus the
#      CUDA-only fp32/bf16 oracle tests in test_cuda.py);
#   2. benchmarks/bench_extraction.py on the Llama-3-8B shape in bf16: tokens/s, b/a, b/c, early exit, MFU, storage,
#      and a torch.profiler breakdown (memory section skipped: it reloads the 8B model in subprocesses);
#   3. benchmarks/bench_regeneration.py on the same model: regeneration with output-token files vs generate;
#   4. benchmarks/bench_storage.py on the same model: bytes per token of bf16 vs fp8 files, fp8's error per layer;
#   5. benchmarks/bench_long_sample.py: host peak RSS of one 32k-token sample in 2048-token chunks, with and without
#      the connector's staging bound (its own small model, bf16; the states come to host memory chunk by chunk);
#   6. on a machine with 2 GPUs or more: benchmarks/bench_train_parallel.py --device cuda, drafter training on 2 Ray
#      Train replicas (NCCL) vs one process on the same global batch (target: >= 1.8x tokens/s).
#   7. where vLLM is installed (`pip install "hsx[vllm]"`): benchmarks/bench_engines.py on the same 8B model, hsx's
#      engine vs vLLM with hsx's plug-in: prompt tokens/s plain and extracting, each engine's extraction overhead.
#   Issue 46 added: 2b. the extraction with fp8 files (converted on the GPU); 2c. packed vs padded prefill (hsx and
#   the bare forward each way); 4b. bench_host_path.py (CPU-seconds per
#   GB written); and at the end benchmarks/gpu_summary.py prints its figures as one table (RESULTS_DIR/summary.md).
#   The whole script now needs more than one 10-minute command: run it with HSX_GPU_TESTS_S=0 after a tests-only call.
#
#   benchmarks/gpu_check.sh RESULTS_DIR [extra bench_extraction.py flags]
#
# Then, if the lease has time (a second command): early exit with fp8 files, whether it is bound by the host's writes
#   python3 benchmarks/bench_extraction.py --device cuda --model-dir /tmp/hsx-gpu/model --out /tmp/fp8 \
#       --sections extraction,early_exit --storage-dtype fp8 --num-samples 128 --repeats 2
#
# Needs python3 with CUDA torch, transformers, safetensors, fsspec, pyarrow, numpy, tqdm, pyyaml and pytest, and
# tenacity (step 6 also ray[train]). On a machine that cannot reach a package index, carry tenacity as a wheel in
# .whl/ (it is pure Python):
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl tenacity
# The random 8B model (16 GB) is built under $HSX_GPU_SCRATCH (default /tmp/hsx-gpu), not in RESULTS_DIR; only
# results.{json,md}, profiles.txt, machine.txt, regeneration.md, storage.md, long-sample.md and their logs land
# in RESULTS_DIR.
set -uo pipefail
results=${1:?usage: benchmarks/gpu_check.sh RESULTS_DIR [bench_extraction.py flags]}
shift
scratch=${HSX_GPU_SCRATCH:-/tmp/hsx-gpu}
cd "$(dirname "$0")/.."
mkdir -p "$results" "$scratch"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hsx-site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/hsx-site" || exit 1
fi
{ nvidia-smi; python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'device', torch.cuda.get_device_name())"; } 2>&1 | tee "$results/machine.txt"

status=0
xdist=$(python3 -c 'import xdist' 2>/dev/null && echo '-n 8')  # the tests' models are tiny: processes share the GPU
# tests/extractor needs ~270 s on an H200 in 8 processes (third lease): HSX_GPU_TESTS_S=300 runs all of it (then run
# the benchmarks as a second command with HSX_GPU_TESTS_S=0, which skips the tests)
[ "${HSX_GPU_TESTS_S:-100}" -gt 0 ] && timeout -s INT "${HSX_GPU_TESTS_S:-100}" python3 -m pytest -q -p no:cacheprovider $xdist tests/extractor tests/vllm_engine/test_rows.py 2>&1 | tee "$results/tests.log" || status=1

timeout 200 python3 benchmarks/bench_extraction.py --out "$scratch/bench" --model-dir "$scratch/model" \
    --device cuda --sections extraction,early_exit,storage --repeats 2 --num-samples 128 --profile "$@" 2>&1 \
    | tee "$results/bench.log" || status=1
cp "$scratch"/bench/results.json "$scratch"/bench/results.md "$results"/ 2>/dev/null
# 2b. the same extraction with fp8 files (issue 46: converted on the GPU before the copy; goal >= 0.97x the bare forward)
timeout 150 python3 benchmarks/bench_extraction.py --out "$scratch/bench-fp8" --model-dir "$scratch/model" \
    --device cuda --sections extraction --storage-dtype fp8 --repeats 2 --num-samples 128 2>&1 \
    | tee "$results/bench-fp8.log" || status=1
cp "$scratch"/bench-fp8/results.json "$results"/extraction-fp8.json 2>/dev/null
# 2c. packed vs padded prefill (issue 46 item 3): hsx and the bare forward, each packed and padded, on short prompts
#     (16-512 tokens: where padding costs most, and where packing's one attention call per prompt and layer adds the
#     most kernel launches)
timeout 150 python3 benchmarks/bench_extraction.py --out "$scratch/bench-packing" --model-dir "$scratch/model" \
    --device cuda --sections packing --repeats 2 --num-samples 512 --min-len 16 --max-len 512 2>&1 \
    | tee "$results/bench-packing.log" || status=1
cp "$scratch"/bench-packing/results.json "$results"/packing.json 2>/dev/null
for f in "$scratch"/bench/profile-*.txt; do [ -e "$f" ] && { echo "== $(basename "$f")"; cat "$f"; }; done \
    > "$results/profiles.txt"

# 3. regeneration (include_output_tokens, files written) vs transformers generate on the same 8B model
timeout 120 python3 benchmarks/bench_regeneration.py --out "$scratch/regen" --model-dir "$scratch/model" \
    --device cuda --num-prompts 128 --batch-size 64 --workloads fixed --repeats 1 2>&1 | tee "$results/regeneration.log" || status=1
cp "$scratch"/regen/results.md "$results"/regeneration.md 2>/dev/null
cp "$scratch"/regen/results.json "$results"/regeneration.json 2>/dev/null
# 4. storage dtypes on the 8B shape: bytes per token of bf16 vs fp8 files, fp8's error per layer
timeout 60 python3 benchmarks/bench_storage.py --out "$scratch/storage" --model-dir "$scratch/model" --device cuda \
    --num-samples 32 2>&1 | tee "$results/storage.log" || status=1
cp "$scratch"/storage/results-storage.md "$results"/storage.md 2>/dev/null
# 4b. the host path priced per byte (issue 46): CPU-seconds per GB the connector writes, bf16 and fp8, by stage
timeout 60 python3 benchmarks/bench_host_path.py --out "$scratch/host-path" --threads 8 --repeats 2 2>&1 \
    | tee "$results/host-path.log" || status=1
cp "$scratch"/host-path/host_path.md "$results"/host-path.md 2>/dev/null
cp "$scratch"/host-path/host_path.json "$results"/host_path.json 2>/dev/null
# 5. one long sample in bounded host memory: bounded vs unbounded staging, bf16 and fp8
timeout 80 python3 benchmarks/bench_long_sample.py --out "$scratch/long" --device cuda 2>&1 \
    | tee "$results/long-sample.log" || status=1
cp "$scratch"/long/results-long-sample.md "$results"/long-sample.md 2>/dev/null
# 6. drafter training on 2 replicas (one GPU each) vs one process, where there are 2 GPUs
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
    timeout 240 python3 benchmarks/bench_train_parallel.py --out "$scratch/train" --device cuda --samples 1024 \
        --hidden-size 1024 --batch-tokens 8192 --steps 30 2>&1 | tee "$results/train-parallel.log" || status=1
    cp "$scratch"/train/train-parallel.md "$results"/train-parallel.md 2>/dev/null
fi
# 7. hsx's engine vs vLLM (hsx's plug-in) on the same 8B model, where vLLM is installed
if python3 -c 'import vllm' 2>/dev/null; then
    timeout 200 python3 benchmarks/bench_engines.py --out "$scratch/engines" --model-dir "$scratch/model" \
        --device cuda --shape llama3-8b --dtype bfloat16 --num-samples 128 --max-len 2048 --repeats 2 2>&1 \
        | tee "$results/engines.log" || status=1
    cp "$scratch"/engines/results-engines.md "$results"/engines.md 2>/dev/null
fi
# 8. what each drafter family costs to train at the 8B shape, bf16, 16k-token batches (issue 52's GPU figure)
#    plain, then with the memory levers of `hsx train-drafter` (chunked cross-entropy, recomputed MLPs)
timeout 240 python3 benchmarks/bench_training_cost.py --out "$scratch/training-cost" --device cuda --dtype bfloat16 \
    --shapes 8b --batch-tokens 16384 --steps 3 2>&1 | tee "$results/training-cost.log" || status=1
cp "$scratch"/training-cost/training_cost.md "$results"/training-cost.md 2>/dev/null
timeout 240 python3 benchmarks/bench_training_cost.py --out "$scratch/training-cost-levers" --device cuda \
    --dtype bfloat16 --shapes 8b --batch-tokens 16384 --steps 3 \
    --memory '{"ce_chunk_tokens": 4096, "gradient_checkpointing": true}' 2>&1 | tee "$results/training-cost-levers.log" \
    || status=1
cp "$scratch"/training-cost-levers/training_cost.md "$results"/training-cost-levers.md 2>/dev/null
# issue 46's figures as one table (RESULTS_DIR/summary.md)
python3 benchmarks/gpu_summary.py "$results" || status=1
exit $status
