#!/usr/bin/env bash
# pdrt on one GPU, from nothing but this repository and the package index: installs a CUDA build of torch
# and the project, fetches SmolLM2, runs the GPU tests, then scripts/gpu_check.py (equality, CUDA IPC, a node
# both ways, decode speed), whose last line is `gpu equal=... ipc_vs_d2d=... handoff_vs_prefill_2048=...
# decode_b64_vs_hf=...`. Usage: bash scripts/gpu_check.sh   (VENV=dir to choose where it installs)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv-gpu}"
python3 -m venv "$venv"
. "$venv/bin/activate"
pip install -q --upgrade pip
pip install -q torch                       # the default Linux wheel is a CUDA build
pip install -q -e '.[gpu,test]'
# FlashInfer's paged kernels (prebuilt ones where the wheel has them); without it attention falls back to SDPA
pip install -q flashinfer-python flashinfer-cubin || echo "FlashInfer did not install: attention will use SDPA"
python -c 'import torch, sys; ok = torch.cuda.is_available(); print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPU", torch.cuda.get_device_name(0) if ok else None); sys.exit(0 if ok else 1)'
pdrt model fetch >/dev/null
python -m pytest -q -m gpu tests/
timeout 600 python scripts/gpu_check.py
