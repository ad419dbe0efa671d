#!/usr/bin/env bash
# On the GPU machine (device tool, carry=["carry/pkg.tgz"]): set up the carried libraries without
# shadowing the machine's own (a library is linked in only where its soname is missing), then run
# the steps named in $@ (test, engine, bench, nccl, multi) with every log and result in one archive,
# $OUT/run.tgz (the device tool brings back only a handful of files; tests/bench/gpu_results.py
# reads the archive), and the summary lines of each step on stdout.
set -u
cd "$(dirname "$0")/../.."
. tests/gpu/carry_env.sh # $OUT holds loose files until the end (a run cut short still brings them back)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export DSBATCH=$PWD/carry/gpu/dsbatch GOLDEN=$PWD/carry/golden
nvidia-smi -L > "$OUT/device.txt" 2>&1
ldd carry/gpu/dsbatch | grep "not found" >> "$OUT/device.txt"
for step in "$@"; do
  case $step in
    test)
      for t in carry/gpu/tests/test_cuda_*; do echo "== $t"; timeout ${T_TEST:-300} "$t" 2>&1; done > "$OUT/test_cuda.txt" 2>&1 ;;
    engine)
      timeout ${T_ENGINE:-500} bash tests/cli/test_cuda_engine.sh > "$OUT/test_cuda_engine.txt" 2>&1
      # the benchmarks' op checks (tests/cli/test_bench_baselines.sh) on the CUDA backend
      for op in attn moe; do
        d=$(mktemp -d)
        [ $op = attn ] && args="--rows 8" || args="--tokens 8"
        if timeout 120 carry/gpu/bench/bench_$op --backend cuda $args --iters 1 --dump "$d" > /dev/null 2>&1 &&
           python3 tests/bench/torch_${op}_baseline.py --check "$d" > "$d/check" 2>&1; then
          echo "ok - bench_$op's CUDA output is the op torch_${op}_baseline.py times: $(cat "$d/check")"
        else echo "not ok - bench_$op on the CUDA backend against the op: $(cat "$d/check" 2>/dev/null)"; fi >> "$OUT/test_cuda_engine.txt"
        rm -rf "$d"
      done ;;
    nccl)
      MPITESTS=$PWD/carry/gpu/mpitests timeout 120 bash tests/cli/test_nccl.sh > "$OUT/test_nccl.txt" 2>&1 ;;
    bench)
      ( timeout ${T_BENCH:-300} carry/gpu/bench/bench_step --backend cuda --csv "$OUT/cuda_step.csv" \
          --profile "$OUT/cuda_step_profile.csv" ${BENCH_STEP_ARGS:-}
        timeout ${T_BENCH:-300} carry/gpu/bench/bench_step --backend cuda --exact-linears --csv "$OUT/cuda_step_exact.csv" \
          ${BENCH_EXACT_ARGS:-}
        timeout ${T_BENCH:-300} carry/gpu/bench/bench_step --backend cuda --eager --csv "$OUT/cuda_step_eager.csv" \
          ${BENCH_EAGER_ARGS:---ctx 64 --batch 1,8,64,256 --steps 4 --prefill ""}
        timeout ${T_BENCH:-300} carry/gpu/bench/bench_step --backend cuda --ctx 2048 --batch 1,8 --prefill "" \
          --csv "$OUT/cuda_step_ctx2048.csv" ${BENCH_CTX_ARGS:-}
        timeout 120 carry/gpu/bench/bench_linear_cuda "$OUT/cuda_linear_decode.csv"
        timeout 120 python3 tests/bench/torch_gemm_ceiling.py "$OUT/cuda_gemm_ceiling.csv"
        timeout 120 python3 tests/bench/torch_linear_baseline.py "$OUT/torch_linear_decode.csv"
        timeout 200 carry/gpu/bench/bench_attn --csv "$OUT/cuda_attn.csv"
        timeout 300 python3 tests/bench/torch_attn_baseline.py "$OUT/cuda_attn.csv"
        timeout 300 carry/gpu/bench/bench_moe --csv "$OUT/cuda_moe.csv"
        timeout 300 python3 tests/bench/torch_moe_baseline.py "$OUT/cuda_moe.csv" ) > "$OUT/bench.txt" 2>&1 ;;
    multi) OUT="$OUT" timeout ${T_MULTI:-590} bash tests/gpu/multi_gpu.sh ;;  # issue #7, 8 GPUs: see its header
  esac
done
grep -hE "PASSED|FAILED|FATAL" "$OUT"/test_cuda.txt 2>/dev/null
grep -hE "^(ok|not ok)" "$OUT"/test_cuda_engine.txt "$OUT"/test_nccl.txt 2>/dev/null
grep -hE "^(decode|prefill) " "$OUT"/bench.txt 2>/dev/null
A=$(mktemp -u /tmp/run.XXXXXX.tgz)
tar -C "$OUT" --exclude=./run.tgz -czf "$A" . && find "$OUT" -mindepth 1 -delete && mv "$A" "$OUT/run.tgz"
