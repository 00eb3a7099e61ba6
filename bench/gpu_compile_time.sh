#!/usr/bin/env bash
# On a machine with one GPU (torch and Triton installed; no network needed), in the repository
# root: compile time on CUDA under Inductor (Triton kernels generated and compiled), cold and
# warm, against plain torch.compile in the same run; then the CUDA and offload tests. Everything
# lands in $OUT. Each step has its own share of one deadline, so a slow step costs the steps
# after it, never the results already written.
#
#     OUT=/tmp/gpu bash bench/gpu_compile_time.sh [seconds, default 520]
source "$(dirname "$0")/gpu_common.sh" "${1:-520}"

caveat="one run each (one GPU, nothing else running); world 1: the collectives move nothing"
common=(--device cuda --compilers inductor --variants plain fsdp fsdp_warm --out "$OUT" --caveat "$caveat")
# The shallow depth first, on its own: its rows are written even if the deeper one runs out of time.
timeout $(( $(left) * 2 / 5 )) "$PY" bench/compile_time.py "${common[@]}" --layers 4 --timeout 200 \
    2>&1 | tee "$OUT/bench_4.log"
timeout $(( $(left) * 3 / 4 )) "$PY" bench/compile_time.py "${common[@]}" --layers 16 --timeout 300 --append \
    2>&1 | tee "$OUT/bench_16.log"
timeout "$(left)" "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_offload.py \
    2>&1 | tee "$OUT/tests.log" | tail -15
