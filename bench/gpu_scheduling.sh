#!/usr/bin/env bash
# On a lent GPU machine (one GPU, torch and Triton preinstalled, no network), in the repository
# root: does Inductor's Triton code keep our collective schedule, and what does keeping it
# (Inductor's peak-memory reordering off for graphs with collectives) cost in peak memory and
# step time against the same compile without our schedule? One GPU has no second rank, so the
# step runs as rank 0 of a fake world (no collective moves data). Everything lands in $OUT.
#
#     OUT=/tmp/gpu bash bench/gpu_scheduling.sh [seconds, default 480]
set -u
OUT=${OUT:?set OUT to a directory for the results}
deadline=$((SECONDS + ${1:-480}))
left() { echo $((deadline - SECONDS)); }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=$(command -v python3 || command -v python)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

timeout $(( $(left) / 3 )) "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/tests.log" | tail -15
variants=(--variants plain fsdp2 fsdp_compile fsdp_compile_nosched)
for world in 2 8; do
    timeout $(( $(left) * (world == 2 ? 1 : 2) / 2 )) "$PY" bench/single_gpu_step.py --fake-world "$world" "${variants[@]}" \
        --out "$OUT" --name "single_gpu_step_cuda_fake_world_$world" 2>&1 | tee "$OUT/step_$world.log" | tail -12
done
