set -u
export PYTHONUNBUFFERED=1
t() { local name=$1; shift; local s=$(date +%s); timeout "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s)-s ))s"; grep -E "passed|failed|^E |Error" $OUT/$name.log | tail -6; }
t model_step 150 python -m benchmarks.model_step --out $OUT/h200_model_step.json
t ov_small 60 python -m benchmarks.overhead --out $OUT/h200_overhead_small.json
t ov_split 60 python -m benchmarks.overhead --seqs 1 --context 4096 --out $OUT/h200_overhead_split.json
t mixed 60 python -m triton_paged_ops bench --suite prefill --only mixed --no-sdpa --out $OUT/mixed_table.json --png $OUT/m1.png
HYPOTHESIS_PROFILE=smoke t launch_ops 150 python -m pytest -q -x tests/test_launch.py tests/test_ops.py -p no:cacheprovider
t models 110 python -m pytest -q -x tests/test_models.py tests/test_compile.py -m gpu -p no:cacheprovider
for f in model_step ov_small ov_split mixed; do echo "## $f"; grep -vE "^\s*$" $OUT/$f.log | tail -14; done
