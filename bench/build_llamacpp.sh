#!/usr/bin/env bash
# Build llama.cpp from the source that llama-cpp-python's PyPI sdist vendors, so the
# comparison in bench/vs_llamacpp.py runs against a release users can reproduce with pip.
# Idempotent: does nothing when the binaries already exist.
#
# Usage: bash bench/build_llamacpp.sh            (prints the bin directory on its last line;
#        about 10-30 minutes on 2 cores the first time)
# Env:   LLAMACPP_VERSION (0.3.36), LLAMACPP_CACHE (~/.cache/astrai/llamacpp),
#        LLAMACPP_JOBS (2), PIP (pip of the project venv when present),
#        LLAMACPP_ISA (native: -march=native, every tool; avx2: x86-64-v3 only, AVX-512 and
#        AMX off, llama-bench and llama-quantize into build-avx2/, for comparing with astrai's
#        avx2 kernel level on a CPU that has more)
set -euo pipefail

version="${LLAMACPP_VERSION:-0.3.36}"
cache="${LLAMACPP_CACHE:-$HOME/.cache/astrai/llamacpp}"
jobs="${LLAMACPP_JOBS:-2}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PIP:-}" ]]; then
    if [[ -x "$here/.venv/bin/pip" ]]; then PIP="$here/.venv/bin/pip"; else PIP="pip"; fi
fi
# built in this order: the one-stream tools first, so they are usable while the server builds;
# llama-lookup and llama-speculative are the speculative-decoding peers (bench/speculative.py)
targets=(llama-bench llama-quantize llama-server llama-lookup llama-speculative)
isa="${LLAMACPP_ISA:-native}"
# convert_hf_to_gguf.py imports sentencepiece, which astrai does not need: kept beside the build
pydeps="$cache/pydeps"

src="$cache/llama_cpp_python-$version/vendor/llama.cpp"
case "$isa" in
    native) build="$src/build"; isa_flags=(-DGGML_NATIVE=ON) ;;
    avx2)
        build="$src/build-avx2"
        targets=(llama-bench llama-quantize llama-server)  # the AVX2-held decode, prefill and chat parts
        isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                   -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
                   -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
    *) echo "LLAMACPP_ISA must be native or avx2, got '$isa'" >&2; exit 1 ;;
esac
bin="$build/bin"

# GGML_NATIVE compiles for the CPU it builds on (-march=native): a build made on another CPU
# model may use instructions this one lacks, or miss ones it has, so the CPU is recorded
stamp="$build/astrai-cpu-stamp"
cpu_signature() {
    grep -m1 -E '^model name' /proc/cpuinfo 2>/dev/null || true
    grep -m1 -E '^flags' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' | sort | tr '\n' ' ' || true
}

all_built() {
    for t in "${targets[@]}"; do [[ -x "$bin/$t" ]] || return 1; done
    [[ -d "$pydeps/sentencepiece" ]] && [[ -f "$stamp" ]] && [[ "$(cat "$stamp")" == "$(cpu_signature)" ]]
}

if all_built; then
    echo "llama.cpp $version already built" >&2
    echo "$bin"
    exit 0
fi

mkdir -p "$cache"
if [[ ! -f "$src/CMakeLists.txt" ]]; then
    sdist="$(ls "$cache"/llama_cpp_python-"$version".tar.gz 2>/dev/null || true)"
    if [[ -z "$sdist" ]]; then
        "$PIP" download --no-deps --no-binary llama-cpp-python --dest "$cache" "llama-cpp-python==$version" >&2
        sdist="$cache/llama_cpp_python-$version.tar.gz"
    fi
    tar -xzf "$sdist" -C "$cache"
fi

if ! command -v cmake >/dev/null; then
    echo "cmake not found: install it (apt-get install -y cmake, or pip install cmake)" >&2
    exit 1
fi

if [[ ! -d "$pydeps/sentencepiece" ]]; then
    "$PIP" install --quiet --no-deps --target "$pydeps" sentencepiece >&2
fi

if [[ -f "$stamp" && "$(cat "$stamp")" != "$(cpu_signature)" ]]; then
    echo "llama.cpp was built on another CPU model: rebuilding from scratch" >&2
    rm -rf "$build"
fi

generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
cmake -S "$src" -B "$build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release "${isa_flags[@]}" -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON >&2
for t in "${targets[@]}"; do
    nice -n 10 cmake --build "$build" -j "$jobs" --target "$t" >&2
done

mkdir -p "$build"
cpu_signature > "$stamp"
all_built || { echo "llama.cpp build finished without all of: ${targets[*]}" >&2; exit 1; }
echo "$bin"
