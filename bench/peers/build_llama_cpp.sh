#!/usr/bin/env bash
# Build llama.cpp's own tools (llama-bench, llama-completion, llama-speculative-simple) from the sources
# vendored in the llama-cpp-python sdist on PyPI, the one route to llama.cpp on a machine whose only network is
# the package registries. The binaries are the peer `verispec bench --peer llama.cpp` and bench/llama_race.py
# time against; they are built for the host CPU (GGML_NATIVE), as a llama.cpp user would build them.
#
#   bash bench/peers/build_llama_cpp.sh [OUT_DIR]      # default ~/.cache/verispec/peers/llama.cpp
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
OUT=${1:-${VERISPEC_HOME:-$HOME/.cache/verispec}/peers/llama.cpp}
SRC="$OUT/src"
mkdir -p "$OUT"
if [ ! -d "$SRC/vendor/llama.cpp" ]; then
  echo "[1/3] downloading llama-cpp-python==$VERSION (sdist) from PyPI"
  python -m pip download "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d "$OUT/dl" -q
  mkdir -p "$SRC"
  tar xzf "$OUT/dl/llama_cpp_python-$VERSION.tar.gz" -C "$SRC" --strip-components=1
fi
command -v cmake >/dev/null || python -m pip install -q cmake
# On a CPU with AMX (Intel Xeon, Sapphire Rapids and later) GGML_NATIVE compiles ggml's AMX matrix kernels,
# which died with SIGILL (tilezero in ggml_backend_amx_mul_mat) on the first prompt on such a Xeon here
# (llama-cpp-python 0.3.36's llama.cpp); a user there builds without them, and so does this script.
# Decoding one token (what the races compare) runs ggml's AVX-512 VNNI kernels either way.
NO_AMX=""
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
echo "[2/3] configuring (Release, GGML_NATIVE${NO_AMX:+ without AMX}, CPU only)"
cmake -S "$SRC/vendor/llama.cpp" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF \
  $(command -v ninja >/dev/null && echo -G Ninja) > "$OUT/configure.log"
echo "[3/3] building llama-bench llama-completion llama-speculative-simple (~10 min on 2 cores)"
cmake --build "$OUT/build" -j "$(nproc)" --target llama-bench llama-completion llama-speculative-simple
echo "built: $OUT/build/bin"
ls "$OUT/build/bin"
