#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server` (the peer `ember bench agentic` compares against) into
# third_party/llama.cpp/ (gitignored). Debian packages no llama.cpp; its sources ship inside
# the llama-cpp-python source distribution. Nothing is downloaded at build time (no web UI,
# no curl). About 5 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=third_party/llama.cpp
if [ -x "$out/bin/llama-server" ]; then echo "$out/bin/llama-server already built"; exit 0; fi
python=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$work"
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON > "$work/cmake.log"
cmake --build "$work/build" --target llama-server -j "$(nproc)" > "$work/build.log"
mkdir -p "$out/bin"
cp "$work/build/bin/llama-server" "$out/bin/"
cp -P "$work"/build/bin/*.so* "$out/bin/" 2>/dev/null || true
echo "built $out/bin/llama-server"
