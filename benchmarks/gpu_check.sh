#!/bin/bash
# The GPU checks in one run, for a machine with one NVIDIA GPU and a CUDA build of torch (with triton):
# the codec tests (CPU and CUDA: Triton and CRC kernels) beside the GPU island tests, then the
# CUDA and CPU codec benchmarks and a short two-island training job of the 149M MoE on the GPU.
#
#   OUT=results/gpu_check bash benchmarks/gpu_check.sh        # from the repository root
#
# Every step has its own time limit and all share a deadline (BUDGET_S, default 540 s), so a step
# that hangs still leaves the others' logs in $OUT. WHEELS=folder installs wheels from that folder
# first (no index), and the package with them (for a machine that cannot reach a registry).
# PYTHON picks the interpreter (default python3). SKIP="bench_cpu train_gpu" leaves those steps out.
# QUALITY_STEPS=N (default 0: skipped) adds the
# quality benchmark's GPU setting (`benchmarks/quality.py --gpu`) at N steps, limited to QUALITY_LIMIT_S.
# docs/BENCHMARKS.md, "GPU (H200)", has what it printed on an H200.
OUT=${OUT:-results/gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
START=$(date +%s)
DEADLINE=$((START + ${BUDGET_S:-540}))
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
LOG=$OUT/log.txt
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  case " ${SKIP:-} " in *" $name "*) echo "=== SKIP $name (SKIP)" | tee -a "$LOG"; return;; esac
  local left=$((DEADLINE - $(date +%s) - 5))
  if [ "$left" -lt 20 ]; then echo "=== SKIP $name (only ${left}s left)" | tee -a "$LOG"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (limit ${limit}s, t=$(( $(date +%s) - START ))s)" | tee -a "$LOG"
  local t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name rc=$? in $(( $(date +%s) - t0 ))s" | tee -a "$LOG"
}
{
  nvidia-smi -L; nproc --all; free -g | head -2; lscpu | grep -E "Model name|L3|Flags" | cut -c1-200
  "$PY" -c "import torch, triton, lightning; print(torch.__version__, torch.version.cuda, triton.__version__, lightning.__version__, torch.cuda.get_device_name())"
} >> "$LOG" 2>&1
if [ -n "$WHEELS" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$WHEELS"/*.whl >> "$LOG" 2>&1
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir . >> "$LOG" 2>&1 \
    || { echo "install failed" >> "$LOG"; exit 1; }
fi
# correctness: codec tests (CPU and CUDA: Triton and CRC kernels) beside the GPU island tests
(step test_codecs 120 "$PY" -m pytest tests/test_codecs.py -q -p no:cacheprovider -rs) &
step test_gpu_islands 150 "$PY" -m pytest tests/test_islands.py -q -k "gpu" -p no:cacheprovider -rs
wait
# timings, one at a time
step bench_cuda 90 "$PY" benchmarks/codecs.py --device cuda --numel 67108864 --repeats 5 --warmup 2 \
  --out "$OUT/codecs_cuda.json"
# the CPU codecs (the torch path) on every core
step bench_cpu 75 "$PY" benchmarks/codecs.py --device cpu --threads "$(nproc)" --numel 67108864 --repeats 5 \
  --warmup 1 --out "$OUT/codecs_cpu.json"
step train_gpu 120 "$PY" -m lightning_islands.app.cli train trainer=gpu model=moe_gpu islands.gpus=shared \
  'islands.members=[{devices:1,batch_size:8},{devices:1,batch_size:16}]' trainer.max_steps=60 \
  islands.sync_every=20 islands.codec=int4 trainer.val_check_interval=60 trainer.limit_val_batches=4 \
  trainer.log_every_n_steps=10 hydra.run.dir=/tmp/train_gpu
cat /tmp/train_gpu/summary.json >> "$OUT/train_gpu.log" 2>/dev/null
# opt-in (QUALITY_STEPS=1800): the quality benchmark's GPU setting, four runs sharing the GPU
if [ "${QUALITY_STEPS:-0}" -gt 0 ]; then
  step quality_gpu "${QUALITY_LIMIT_S:-420}" "$PY" benchmarks/quality.py --gpu --steps "$QUALITY_STEPS" --H 24 \
    --codecs topk:0.1+int2,fp32 --parallel 4 --out "$OUT/quality"
fi
echo "=== total $(( $(date +%s) - START ))s" >> "$LOG"
cat "$LOG"; tail -n 15 "$OUT"/test_codecs.log; tail -n 30 "$OUT"/test_gpu_islands.log; tail -n 16 "$OUT"/bench_cuda.log; tail -n 12 "$OUT"/bench_cpu.log
grep -E "outer_step|step_seconds|val loss|exchang" "$OUT"/train_gpu.log | head -30
[ -f "$OUT"/quality_gpu.log ] && tail -n 20 "$OUT"/quality_gpu.log
