#!/usr/bin/env bash
# The probe on one GPU, in one short run (about 6-8 minutes on an H200):
#   1. tests/test_probe_cuda.py: device statistics equal the CPU ones, CUDA-event timings, peak memory, NVML rows;
#   2. benchmarks/full_coverage.py --device cuda on the reference workload at d=1024 (12 layers): every
#      statistic of every tensor at every step against the optimizer step and one read pass over the bytes
#      the statistics read (the device's bandwidth floor), and its in-process A/B (5 rounds);
#   3. benchmarks/probe_overhead.py --device cuda at d=2048 (12 layers, batch 16x256): the
#      cross-process ratio (5 interleaved rounds of fresh processes) and the in-process A/B (5 rounds),
#      the rotation length of the default set, and the allocator's peak extra memory of the default set
#      with a window at every step (the worst case), as a share of parameter bytes.
# Goals: step time <= 1.01x (default set), <= 1.10x (full coverage); peak extra memory <= 10% of parameter bytes.
# Output goes to stdout and to $OUT/gpu_check/ (or /tmp/gpu_check/).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}/gpu_check"
mkdir -p "$out"
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
  | tee -a "$out/gpu.txt"

timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_probe_cuda.py 2>&1 | tee "$out/test_probe_cuda.txt"
status=$(( status | PIPESTATUS[0] ))

timeout 150 python3 benchmarks/full_coverage.py --workloads reference --device cuda --d-model 1024 --layers 12 \
  --batch 16 --seq 256 --rounds 5 --ab-rounds 5 2>&1 | tee "$out/full_coverage_d1024.txt"
status=$(( status | PIPESTATUS[0] ))

for d in 2048; do
  # --sizes "$d": the memory child of the same size (memory_budget=0.1, a window every step).
  timeout 240 python3 benchmarks/probe_overhead.py --device cuda --d-model "$d" --layers 12 --batch 16 --seq 256 \
    --configs none,ds-default --steps 20 --warmup 5 --rounds 5 \
    --ab-configs ds-default --ab-rounds 5 --block 16 --drop 4 --rotation-steps 100 \
    --sizes "$d" --mem-configs ds-default --mem-steps 16 2>&1 | tee "$out/probe_overhead_d$d.txt"
  status=$(( status | PIPESTATUS[0] ))
done
echo "gpu_check: exit status $status (results in $out)"
exit "$status"
