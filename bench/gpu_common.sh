# Sourced by the bench/gpu_*.sh scripts, with the run's budget in seconds as its argument:
# checks $OUT, starts the deadline that each step takes its share of (`left` prints the seconds
# remaining), sets $PY, and records the GPU and the torch and Triton versions in $OUT/gpu.txt.
set -u
OUT=${OUT:?set OUT to a directory for the results}
deadline=$((SECONDS + $1))
left() { echo $((deadline - SECONDS)); }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=$(command -v python3 || command -v python)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
