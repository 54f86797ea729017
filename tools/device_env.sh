#!/usr/bin/env bash
# Prepares .gpu/ for running this repo on a GPU machine whose Python (3.12 there) already has torch
# 2.11 + torchaudio/torchvision but no internet: spear-tts's pure-Python dependencies as wheels, and
# import stubs for fairseq and wandb, which audiolm-pytorch imports at import time but tts_specdec
# never calls (fairseq 0.12.2 does not import on Python >= 3.11). Run here, then on the GPU machine:
#   source .gpu/setup.sh && python3 recipes/device_check.py --device cuda
#   source .gpu/setup.sh && python3 recipes/benchmark.py --model default --device cuda --sentences 10
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYVER=${PYVER:-3.12}
mkdir -p .gpu/whl .gpu/stubs/fairseq .gpu/stubs/wandb
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.gpu/ >> .git/info/exclude; }
for p in audiolm-pytorch==2.4.0 spear-tts-pytorch==0.4.8 x-clip==0.14.4 beartype==0.23.1 einx==0.4.3 \
         ema-pytorch==0.8.3 frozendict==2.5.1 ftfy==6.3.1 gateloop-transformer==0.2.5 hyper-connections==0.4.11 \
         local-attention==1.11.2 loguru==0.7.3 pytorch-warmup==0.2.0 rotary-embedding-torch==0.9.1 \
         soundfile==0.14.0 cffi==2.1.1 pycparser==3.11 torch-einops-utils==0.2.0 \
         vector-quantize-pytorch==1.32.0 wcwidth==0.9.4; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl "$p"
done
# published as a source archive only; PEP 517 builds it in an isolated env (the venv has no `wheel`)
"$PY" -m pip wheel -q --use-pep517 --no-deps -w .gpu/whl encodec==0.1.1
echo '"""Import stub: audiolm-pytorch imports fairseq at import time; tts_specdec never calls it."""' \
  > .gpu/stubs/fairseq/__init__.py
echo '"""Import stub: audiolm-pytorch trainer imports wandb at import time; tts_specdec never calls it."""' \
  > .gpu/stubs/wandb/__init__.py
cat > .gpu/setup.sh <<'SETUP'
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD/.gpu/stubs:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/ext
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
# the last loan's compiled graphs, where its archive was copied here (tools/compile_cache.py)
if [ -f .gpu/compile-cache.tar.gz ]; then python3 tools/compile_cache.py load .gpu/compile-cache.tar.gz || true; fi
SETUP
echo "prepared .gpu/ ($(du -sh .gpu | cut -f1))"
