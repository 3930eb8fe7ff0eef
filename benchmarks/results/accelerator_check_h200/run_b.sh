# Device call B: the second half of SmolLM2 joins the first (left in /tmp by call A), then the rest.
mkdir -p ${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1
[ -f /tmp/jx/smol.part00 ] || { echo "NO PART00: a fresh machine"; exit 8; }
export JAXSERVE_CACHE=/tmp/jxcache
M=$JAXSERVE_CACHE/models/smollm2-135m-instruct; mkdir -p $M
cat /tmp/jx/smol.part00 .p1/smol.part01 > $M/SmolLM2-135M-Instruct.Q4_1.gguf && sha256sum $M/*.gguf
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl || exit 9
export PYTHONPATH=/tmp/site
cd .dev/src && timeout ${B_TIMEOUT:-370} python3 benchmarks/accelerator_check.py --out ${OUT:-/tmp/out}/b \
  --budget-s ${B_BUDGET:-340} --golden-dir ../golden --steps "${B_STEPS:-golden,roofline smollm2,engine decode,tests}" 2>&1 | tee ${OUT:-/tmp/out}/b.log | grep --line-buffered -v "^check .* ok$"
