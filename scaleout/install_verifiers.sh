#!/usr/bin/env bash
# A virtualenv for scaleout/verifiers_countdown.py: verifiers 0.4.0 (PrimeIntellect's environment
# library, its training client and renderers), the transformers extra of renderers (the renderer
# loads the checkpoint's tokenizer with AutoTokenizer) and uv (verifiers' `null` harness runs its
# chat program as a uv script). Kept apart from the repo's own venv: verifiers pins its own
# openai / pydantic / httpx. No torch needed: the example only talks to scaleout/serve.py over HTTP.
#
#   bash scaleout/install_verifiers.sh              # -> /tmp/vf_venv
#   bash scaleout/install_verifiers.sh DIR          # -> DIR
#   DIR/bin/python scaleout/verifiers_countdown.py --base_url=http://127.0.0.1:8123
#
# The example puts the repository root on sys.path itself (tasks/countdown.py, tasks/countdown_feedback.py); nothing of
# the repo is installed. PYTHON picks the interpreter (3.11 or newer).
set -euo pipefail
VENV="${1:-/tmp/vf_venv}"
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "verifiers needs Python >= 3.11"'
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "verifiers==0.4.0" "renderers[transformers]" uv
"$VENV/bin/python" -c 'import verifiers, renderers, transformers
print("verifiers", verifiers.__version__, "renderers", renderers.__version__,
      "transformers", transformers.__version__)'
"$VENV/bin/uv" --version
