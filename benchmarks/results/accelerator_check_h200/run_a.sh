# Device call A: stash the first half of SmolLM2, then the steps that need no real weights.
mkdir -p ${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1
mkdir -p /tmp/jx && cp .p0/smol.part00 /tmp/jx/ 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl || exit 9
export PYTHONPATH=/tmp/site
cd .dev/src && timeout ${A_TIMEOUT:-300} python3 benchmarks/accelerator_check.py --out ${OUT:-/tmp/out}/a \
  --budget-s ${A_BUDGET:-280} --golden-dir ../golden --steps "kernel check,kernel bandwidth,roofline llama-1b" 2>&1 | tee ${OUT:-/tmp/out}/a.log | grep --line-buffered -v "^check .* ok$"
