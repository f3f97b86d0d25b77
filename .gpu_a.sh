set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
t() { local name=$1; shift; local s=$(date +%s); timeout "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s)-s ))s"; grep -E "passed|failed|^E |Error" $OUT/$name.log | tail -8; }
t launch_ops 150 python -m pytest -q -x tests/test_launch.py tests/test_ops.py -p no:cacheprovider
t attn 200 python -m pytest -q -x tests/test_attention.py -k "split or graph or dispatch or mixed or wider or planner" -p no:cacheprovider
t invariant 110 python -m pytest -q -x tests/test_batch_invariant.py -p no:cacheprovider
t models 120 python -m pytest -q -x tests/test_models.py tests/test_compile.py -m gpu -p no:cacheprovider
