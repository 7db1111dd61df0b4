"""
vLLM's entry point for this project's weight-transfer backend (pyproject.toml beside this
file): vLLM calls register() in each of its processes (API server, engine core, workers).
The project's modules are not an installed package, so the checkout this file lives in
goes at the end of sys.path, where it shadows nothing of vLLM's.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def register():
    if ROOT not in sys.path:
        sys.path.append(ROOT)
    from scaleout import vllm_gloo
    vllm_gloo.register()
