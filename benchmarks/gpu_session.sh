#!/usr/bin/env bash
# Everything this project wants from a lent GPU machine, as one command that fits a short lease:
#
#     bash benchmarks/gpu_session.sh [OUTDIR [BACK]]   # OUTDIR: default benchmarks/results/gpu
#
# BACK (for a machine that returns only a few files, such as the device tool's $OUT): the .tgz of
# OUTDIR and its summaries (session.md, gpu_check.md, chunked_loss_results.md, fusion_results.md) are
# copied there:
#     bash benchmarks/gpu_session.sh /tmp/gpu "$OUT"
#
# Runs on the machine's own python3 and torch (such machines have no internet: autoshard is installed
# over them with --no-deps), each step under a timeout so that one slow step cannot eat the lease:
#   0. the planner on one GPU (benchmarks.gpu_planner): Cluster.measure() in bf16 beside the DGX-H100
#      preset, predicted against measured steps of GPTs with recompute none / selective / full, and a
#      layer's saved activation bytes in bf16 against Korthikanti et al.'s 16-bit formula (issues 26, 27);
#   1. gpu_check: parity with the single-device model on CUDA + NCCL with the compiled Triton kernels,
#      for every mesh the GPUs allow (1 GPU: about 60 s; the table is written after each rank count);
#   2. a rank's whole step (GPT and HF Llama, bf16, fused AdamW) against eager and torch.compile, both
#      codegen paths, with the profile's top kernels and any fp32 SIMT GEMM (benchmarks.step);
#   3-5 only with FULL=1 (each was measured on an H100 before; they do not fit a 15-minute lease with the rest):
#   3. dp=1 against DDP on one GPU, with autoshard's fusion and chunked loss on and off (which of them
#      costs the step time: the first H100 run measured 1.05x);
#   4. the chunked LM head + loss against the unchunked one at the dp runs' sizes;
#   5. the fusion patterns (eager / fused / torch.compile, each kernel's bandwidth, the host time to issue
#      a call); the two-layer GPT timing is left out (its torch.compile takes minutes: run
#      `python -m benchmarks.fusion` alone for it);
#   6. with 2 or more GPUs: the pipeline against torch.distributed.pipelining (issue 8's 0.95x target)
#      and data parallel against DDP at dp = 1, 2 (, 4) with the overlap share (issue 9).
# Everything lands in OUTDIR as .md and .log files, and in OUTDIR.tgz beside it (one file to bring back
# from a machine that returns few); the summary is printed last.
set -o pipefail
OUT=${1:-benchmarks/results/gpu}
OUT=${OUT%/}
BACK=${2:-}      # read now: the loop below resets the positional arguments
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
"$PY" -c "import autoshard.passes" 2>/dev/null ||
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
"$PY" -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '|',
           torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" |
    tee "$OUT/session.md"
[ "$GPUS" -ge 1 ] || { echo "gpu_session: no CUDA device here"; exit 2; }

echo "== the planner on one GPU: predicted against measured steps, a layer's bf16 bytes (issues 26, 27)"
timeout ${PLANNER_S:-200} "$PY" -m benchmarks.gpu_planner --steps 6 --out "$OUT" > "$OUT/gpu_planner.log" 2>&1
grep -E "^\|" "$OUT/gpu_planner.md" 2>/dev/null | tee -a "$OUT/session.md" || tail -5 "$OUT/gpu_planner.log"

echo "== gpu_check"
timeout $((60 + 90 * GPUS)) "$PY" -m tests.gpu_check --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log" |
    grep -E "^  (pass|FAIL)|tracebacks"

echo "== a rank's whole step against torch.compile: GPT and HF Llama, bf16, AdamW(fused) (issue 23)"
timeout ${STEP_S:-150} "$PY" -m benchmarks.step --device cuda --steps 10 --profile --variants ${STEP_VARIANTS:-eager torch.compile autoshard} --out "$OUT" > "$OUT/step.log" 2>&1
grep -E "^\||fp32 SIMT" "$OUT/step_results_gpu.md" 2>/dev/null | tee -a "$OUT/session.md"

DP="--steps 10 --hidden 1024 --layers 8 --seq 512 --batch 8 --vocab 32000"
if [ -n "${FULL:-}" ]; then
{ echo; echo "## dp=1 against DDP ($DP)"; echo; echo "| fuse | loss chunks | autoshard ms | DDP ms | ratio |"
  echo "|---|---|---|---|---|"; } >> "$OUT/session.md"
for v in "auto auto" "off auto" "off none"; do
    set -- $v
    echo "== dp=1, fuse=$1, loss_chunk_rows=$2"
    timeout 60 "$PY" -m benchmarks.dp --dp 1 $DP --fuse "$1" --loss-chunk-rows "$2" --out "$OUT/dp_tmp" \
        > "$OUT/dp_$1_$2.log" 2>&1
    row=$(grep -E "^\| 1 \|" "$OUT/dp_$1_$2.log" | head -1 | cut -d'|' -f3-5)
    echo "| $1 | $2 |$row |" | tee -a "$OUT/session.md"
done
rm -rf "$OUT/dp_tmp"

echo "== chunked LM head + loss against unchunked (the dp=1 suspect), V=32000 H=1024 as the dp runs"
timeout 90 "$PY" -m benchmarks.chunked_loss --rows 4096 --vocab 32000 --hidden 1024 --chunk auto 1024 4096 --kernel \
    --reps 5 --out "$OUT" > "$OUT/chunked_loss.log" 2>&1; grep -E "^\|" "$OUT/chunked_loss_results.md" 2>/dev/null | head -8

echo "== fusion patterns"
timeout 150 "$PY" -m benchmarks.fusion --iters 20 --no-loss --no-gpt --out "$OUT" > "$OUT/fusion.log" 2>&1
grep -E "^ *[a-z_]+: fwd" "$OUT/fusion.log"

fi

if [ "$GPUS" -ge 2 ]; then
    echo "== pipeline against torch.distributed.pipelining"
    timeout 300 "$PY" -m benchmarks.pp --only torch --hidden 1024 --seq 512 --batch 16 --vocab 32000 --steps 10 --out "$OUT" > "$OUT/pp.log" 2>&1; tail -15 "$OUT/pp.log"
    echo "== data parallel against DDP"
    SIZES="1 2"; [ "$GPUS" -ge 4 ] && SIZES="1 2 4"
    timeout 240 "$PY" -m benchmarks.dp --dp $SIZES $DP --out "$OUT" > "$OUT/dp.log" 2>&1; tail -8 "$OUT/dp.log"
fi
echo; echo "== summary ($OUT)"; cat "$OUT/session.md"; grep -E "^\| [0-9]" "$OUT/gpu_check.md" 2>/dev/null
tar -czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")" && echo "(all of it: $OUT.tgz)"
if [ -n "$BACK" ]; then
    mkdir -p "$BACK" && cp "$OUT.tgz" "$BACK/" && for f in session.md gpu_planner.md gpu_check.md step_results_gpu.md chunked_loss_results.md fusion_results.md; do
        [ -f "$OUT/$f" ] && cp "$OUT/$f" "$BACK/"; done
    echo "(copied to $BACK)"
fi
