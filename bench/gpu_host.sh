#!/usr/bin/env bash
# On a GPU host without TVM: install the runtime bundle (../shared/tools/gpu_bundle.sh .gpu)
# into a private directory, then run the GPU tests on artifacts prepared elsewhere and the
# GPU benchmark (docs/cuda.md, "Testing and benchmarking on a GPU host").
#   [MODELS='gcn sage'] [TESTS_K=EXPR] bench/gpu_host.sh BUNDLE ARTIFACTS OUT [bench.gpu run options...]
# ARTIFACTS holds tests/ (GCOMP_GPU_PREPARE=ARTIFACTS/tests pytest tests/gpu) and bench/
# (python -m bench.gpu prepare ARTIFACTS/bench); OUT receives the logs and results.
# TESTS_K: run only the GPU tests pytest -k selects (those prepared with the same -k).
set -uo pipefail
bundle=$(realpath "$1") arts=$(realpath "$2") out=$(realpath -m "$3")
shift 3
site=$(mktemp -d) work=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$site" "$bundle"/*.whl
tar xzf "$bundle/tvm-runtime.tgz" -C "$site"
# gcomp as pip would install it (gcomp.models is models/), without build tools or network;
# the tests and benchmarks run from another directory, so the checkout's gcomp/ (which has
# no models/) does not shadow it
cp -r gcomp "$site/" && cp -r models "$site/gcomp/models" && cp -r tests bench "$work/"
# TVM's CUDA plugin links libcudart.so.13: the toolkit's, or the one PyTorch's wheels bring
cudart=$(python3 -c 'import glob, site; print(":".join(d for p in site.getsitepackages() for d in glob.glob(p + "/nvidia/*/lib")))')
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1
# synthetic graphs are made once per run and read back by the next model's process
# (a Reddit-size graph takes minutes to make)
export GCOMP_BENCH_GRAPHS="$work/graphs"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
mkdir -p "$out"
cd "$work"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/device.txt"
if [ -d "$arts/tests" ]; then
  GCOMP_GPU_ARTIFACTS="$arts/tests" python3 -m pytest tests/gpu -q -rs -p no:cacheprovider \
    ${TESTS_K:+-k "$TESTS_K"} \
    2>&1 | tee "$out/gpu-tests.log"
fi
if [ -d "$arts/bench" ]; then
  # one process per model: a peer's CUDA error (seen in torch.compile'd kernels) ends its
  # process, and only that model's remaining peers are lost
  once=""  # the SpMM cases and the accuracy runs run with the first model only
  for m in ${MODELS:-gcn sage gin gat}; do
    python3 -m bench.gpu run "$arts/bench" --out "$out" --models "$m" $once "$@" 2>&1 | tee -a "$out/bench.log"
    once="--no-spmm --no-accuracy"
  done
  python3 -m bench.gpu report "$(ls "$out"/gpu-2*.json | paste -sd,)" --out "$out" > /dev/null
fi
