#!/usr/bin/env bash
# On a CUDA machine whose python has astrai's requirements: the device tests on the GPU, the
# trainer, alignment and quick-start tests (whose 'auto' device is the GPU there), then the
# GPU benchmarks. Logs and JSON go to the folder given (default gpu-check/).
#   bash scripts/gpu_check.sh [OUT] [PARTS]    PARTS: any of tests,suite,train,generate (default all)
# SUITE_PATHS replaces the suite's test paths; *_SECONDS cap each part.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}; parts=${2:-tests,suite,train,generate}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
has() { [[ ",$parts," == *",$1,"* ]]; }
nvidia-smi -L 2>&1 | tee "$out/gpu.txt"
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
  2>&1 | tee -a "$out/gpu.txt"
pids=()
if has tests; then
  timeout "${TESTS_SECONDS:-170}" $py -m pytest tests/device --device cuda -q -p no:cacheprovider -rfE \
    >"$out/device_tests.log" 2>&1 & pids+=($!)
fi
if has suite; then
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 timeout "${SUITE_SECONDS:-170}" $py -m pytest ${SUITE_PATHS:-tests/trainer tests/alignment tests/quickstart} -q \
    -n 8 -p no:cacheprovider -rfE --timeout 150 >"$out/suite.log" 2>&1 & pids+=($!)
fi
for pid in "${pids[@]}"; do wait "$pid"; done
tail -n 25 "$out/device_tests.log" "$out/suite.log" 2>/dev/null
if has train; then  # eager first: compiling the 1b model's training step takes minutes on its own
  for compile in "" "--compile"; do
    timeout "${TRAIN_SECONDS:-400}" $py bench/train.py --device cuda --presets 1b --precisions bf16 --batch 8 \
      --seq 2048 --warmup 2 --steps 2 --rounds 2 $compile --out "$out/train${compile:+-compiled}.json" \
      >"$out/train${compile:+-compiled}.log" 2>&1
    grep -E "^(matmul|1b|Traceback|RuntimeError|ValueError|wrote)|Error" "$out/train${compile:+-compiled}.log" | tail -n 8
  done
fi
if has generate; then
  timeout "${GENERATE_SECONDS:-240}" $py bench/gpu_generate.py --preset 1b --rounds 1 --out "$out/gpu_generate.json" \
    >"$out/generate.log" 2>&1
  grep -v "Loading weights" "$out/generate.log" | tail -n 20
fi
