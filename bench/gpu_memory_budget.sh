#!/usr/bin/env bash
# On a machine with one GPU (torch and Triton installed; no network needed), in the repository
# root: memory_budget= against the allocator's peak (torch.cuda.max_memory_allocated), as rank 0
# of a fake world of 8 on this GPU, the cluster being the GPU's preset. Everything lands in $OUT.
#
#     OUT=/tmp/gpu bash bench/gpu_memory_budget.sh [seconds, default 420]
source "$(dirname "$0")/gpu_common.sh" "${1:-420}"

timeout $(( $(left) - 20 )) "$PY" bench/gpu_memory_budget.py --fake-world 8 --out "$OUT" 2>&1 \
    | tee "$OUT/memory_budget.log" | tail -15
