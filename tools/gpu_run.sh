#!/usr/bin/env bash
# The one prepared GPU check (`make test-gpu`): tests/gpu on one lent GPU, as the machine is (docs/gpu.md).
#
#   here, once, with internet:  make gpu-wheels        # the lock's wheels the GPU image lacks -> .gpu-wheels/
#   on the GPU (device tool):   run(command="bash tools/gpu_run.sh", carry=[".gpu-wheels"], timeout_s=540)
#   the GPU benchmark:          run(command="bash tools/gpu_run.sh bench", carry=[".gpu-wheels"], timeout_s=420)
#
# The GPU image has python3 with a CUDA torch (2.11 when last read) and no pydantic, and no internet: the
# wheels in .gpu-wheels are installed with --no-index into a folder of their own, put first on PYTHONPATH
# with the checkout's src/. Output: the device line, pytest's log and JUnit XML under $OUT (or ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT_DIR"
PY=${GPU_PY:-python3}
SITE=/tmp/zerodp-gpu-site
if compgen -G ".gpu-wheels/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu-wheels/*.whl \
        || { echo "gpu_run: installing .gpu-wheels failed"; exit 3; }
    export PYTHONPATH="$SITE:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "gpu_run: no .gpu-wheels/ (run 'make gpu-wheels' where pip reaches PyPI, and carry .gpu-wheels)"
    export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch, pydantic, zerodp; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'gpus', torch.cuda.device_count(), 'pydantic', pydantic.VERSION, 'zerodp', zerodp.__file__)"
} 2>&1 | tee "$OUT_DIR/device.txt"
if [ "${1:-}" = bench ]; then  # `make bench-gpu`: the side-by-side table (bench/gpu_bench.py), about 6 minutes
    $PY -m bench.gpu_bench --results "$OUT_DIR/gpu_bench.md" ${GPU_BENCH_ARGS:-} 2>&1 | tee "$OUT_DIR/gpu_bench.log"
    status=${PIPESTATUS[0]}
    echo "gpu_run: bench exit $status" | tee -a "$OUT_DIR/gpu_bench.log"
    exit "$status"
fi
# 8 minutes at most for the whole suite (issue 31); each test has pytest-timeout's 300 s of pyproject.toml
timeout 480 $PY -m pytest -q -rfEs -p no:cacheprovider --durations 15 --junitxml "$OUT_DIR/junit.xml" tests/gpu \
    2>&1 | tee "$OUT_DIR/pytest.log"
status=${PIPESTATUS[0]}
echo "gpu_run: pytest exit $status" | tee -a "$OUT_DIR/pytest.log"
exit "$status"
