set -u
export PYTHONUNBUFFERED=1
t() { local name=$1; shift; local s=$(date +%s); timeout "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s)-s ))s"; grep -E "passed|failed|^E |Error" $OUT/$name.log | tail -8; }
t ov_small 80 python -m benchmarks.overhead --out $OUT/h200_overhead_small.json
t ov_split 80 python -m benchmarks.overhead --seqs 1 --context 4096 --out $OUT/h200_overhead_split.json
t model_step 150 python -m benchmarks.model_step --out $OUT/h200_model_step.json
t mixed_default 70 python -m triton_paged_ops bench --suite prefill --only mixed --no-sdpa --out $OUT/mixed_default.json --png $OUT/m1.png
t mixed_sn128 70 python -m triton_paged_ops bench --suite prefill --only mixed --no-sdpa --config small_block_n=128 --out $OUT/mixed_sn128.json --png $OUT/m2.png
t fp8inv 90 python -m triton_paged_ops bench --only fp8 --no-sdpa --batch-invariant --out $OUT/fp8inv.json --png $OUT/m3.png
HYPOTHESIS_PROFILE=explicit t invariant 60 python -m pytest -q -x tests/test_batch_invariant.py -p no:cacheprovider
for f in ov_small ov_split model_step mixed_default mixed_sn128 fp8inv; do echo "## $f"; grep -vE "^\s*$" $OUT/$f.log | tail -14; done
