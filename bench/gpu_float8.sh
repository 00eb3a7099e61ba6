#!/usr/bin/env bash
# On a machine with one GPU (torch and Triton installed; no network needed), in the repository
# root: the float8 copy-in kernel bit for bit against the torch ops on the GPU, then its time
# against torchao's cast plus FSDP2's copy-in on the same shards (fp32 and bf16 rows beside it,
# for scale). Everything lands in $OUT.
#
#     OUT=/tmp/gpu bash bench/gpu_float8.sh [seconds, default 300]
source "$(dirname "$0")/gpu_common.sh" "${1:-300}"

"$PY" -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tee -a "$OUT/gpu.txt"
timeout $(( $(left) / 3 )) "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 \
    | tee "$OUT/tests.log" | tail -5
timeout "$(left)" "$PY" bench/copy_in_kernel.py --dtypes bf16 float8 --out "$OUT" 2>&1 | tee "$OUT/bench.log"
