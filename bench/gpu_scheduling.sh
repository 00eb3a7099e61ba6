#!/usr/bin/env bash
# On a machine with one GPU (torch and Triton installed; no network needed), in the repository
# root: does Inductor's Triton code keep our collective schedule, and what does keeping it
# (Inductor's peak-memory reordering off for graphs with collectives) cost in peak memory and
# step time against the same compile without our schedule? One GPU has no second rank, so the
# step runs as rank 0 of a fake world (no collective moves data). Everything lands in $OUT.
#
#     OUT=/tmp/gpu bash bench/gpu_scheduling.sh [seconds, default 480]
source "$(dirname "$0")/gpu_common.sh" "${1:-480}"

timeout $(( $(left) / 3 )) "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/tests.log" | tail -15
variants=(--variants plain fsdp2 fsdp_compile fsdp_compile_nosched)
for world in 2 8; do
    timeout $(( $(left) * (world == 2 ? 1 : 2) / 2 )) "$PY" bench/single_gpu_step.py --fake-world "$world" "${variants[@]}" \
        --out "$OUT" --name "single_gpu_step_cuda_fake_world_$world" 2>&1 | tee "$OUT/step_$world.log" | tail -12
done
