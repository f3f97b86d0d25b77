set -u
export PYTHONUNBUFFERED=1
t() { local name=$1; shift; local s=$(date +%s); timeout "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s)-s ))s"; grep -E "passed|failed|^E |Error" $OUT/$name.log | tail -6; }
t bench 130 python -m triton_paged_ops bench --no-sdpa --batch-invariant --only B1x32k B8x4k B32x4k D64 Hq8 --out $OUT/h200_decode_invariant_reduce.json --png $OUT/x.png
HYPOTHESIS_PROFILE=explicit t inv 80 python -m pytest -q -x tests/test_batch_invariant.py tests/test_merge.py -p no:cacheprovider
HYPOTHESIS_PROFILE=smoke t inv_smoke 100 python -m pytest -q -x tests/test_batch_invariant.py tests/test_attention.py -k "invariant or dispatch" -p no:cacheprovider
grep -vE "^\s*$" $OUT/bench.log | tail -14
