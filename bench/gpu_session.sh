#!/usr/bin/env bash
# One device call (issue #25 and the runtime's GPU check): everything under $OUT, each piece time-boxed.
#   1. pipesched under MPS (25 % of the SMs per process): calibration, then the matrix's runs -> raw_mps.json
#   2. the runtime's GPU check (tests/gpu_runtime_check.py, short)            -> runtime_gpu.{json,md}
#   3. pipesched time-sliced (MPS stopped): the same                            -> raw_ts.json
# The raw files are evaluated on any machine: bench/bench_pipesched_gpu.py --evaluate raw_mps.json raw_ts.json
# Usage: bench/gpu_session.sh OUT [MPS_S RUNTIME_S TS_S]   (a time of 0 skips that piece; COLLECT_ARGS: more collect options)
set -u
OUT=${1:?usage: gpu_session.sh OUT [MPS_S RUNTIME_S TS_S]}
MPS_S=${2:-175}; RUNTIME_S=${3:-70}; TS_S=${4:-145}
mkdir -p "$OUT"
LOG="$OUT/session.log"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
say() { echo "[gpu_session $(date -u +%T)] $*" | tee -a "$LOG"; }
say "start; $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/gpu-session-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/gpu-session-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
COLLECT_ARGS=${COLLECT_ARGS:-}
if [ "$MPS_S" = 0 ]; then
  say "MPS runs skipped"
elif nvidia-cuda-mps-control -d >>"$LOG" 2>&1; then
  say "MPS daemon started"
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 timeout -k 5 "$MPS_S" $PY bench/bench_pipesched_gpu.py --collect "$OUT/raw_mps.json" --sharing mps $COLLECT_ARGS 2>&1 | tee -a "$LOG"
  say "mps collect exit ${PIPESTATUS[0]}; MPS servers: $(echo get_server_list | nvidia-cuda-mps-control 2>&1 | tr '\n' ' ')"
  tail -5 "$CUDA_MPS_LOG_DIRECTORY/control.log" >>"$LOG" 2>/dev/null
  echo quit | nvidia-cuda-mps-control >>"$LOG" 2>&1
  sleep 2
  say "MPS daemon stopped"
else
  say "MPS daemon did not start: no MPS runs"
fi
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
if [ "$RUNTIME_S" != 0 ]; then
  mkdir -p "$OUT/runtime"
  timeout -k 5 "$RUNTIME_S" $PY tests/gpu_runtime_check.py --out-dir "$OUT/runtime" --steps 10 --width 256 --depth 4 2>&1 | tee -a "$LOG"
  say "runtime check exit ${PIPESTATUS[0]}"
fi
if [ "$TS_S" != 0 ]; then
  timeout -k 5 "$TS_S" $PY bench/bench_pipesched_gpu.py --collect "$OUT/raw_ts.json" --sharing time-slice $COLLECT_ARGS 2>&1 | tee -a "$LOG"
  say "time-slice collect exit ${PIPESTATUS[0]}"
fi
ls -la "$OUT" "$OUT/runtime" | tee -a "$LOG"
