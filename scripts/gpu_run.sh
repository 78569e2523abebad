#!/usr/bin/env bash
# The GPU checks, run on the GPU machine in the checkout's root once DALI's kit is installed:
#   . .gpu/pN/install.sh && bash scripts/gpu_run.sh [tests|bench|all]     (default: all)
# It installs the wheels of scripts/gpu_extras.sh (.gpu/extra/*.whl, or /tmp/kit/extra/*.whl when they came
# with an earlier transfer) into /tmp/site, then runs the GPU tests (`pytest -m gpu`) and the GPU benchmark
# (`python -m benchmarks gpu`, < 6 minutes), teeing their output into $OUT (the folder whose files come back):
# $OUT/gpu_tests.log, $OUT/gpu_bench.log and $OUT/gpu.json. Exits non-zero if either failed.
#
# From the session here (see ../shared/gpu/README.md for the kit):
#   bash ../shared/gpu/pack.sh && bash scripts/gpu_extras.sh       # the kit's parts .gpu/p1..pN, .gpu/extra
#   run(carry=[".gpu/p1"]):  mkdir -p /tmp/kit && cp .gpu/p1/part /tmp/kit/part.1       # ... up to N-1
#   run(carry=[".gpu/pN", ".gpu/extra"], timeout_s=600):
#       cp .gpu/pN/part /tmp/kit/part.N && . .gpu/pN/install.sh && bash scripts/gpu_run.sh
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

wheels=$(ls .gpu/extra/*.whl /tmp/kit/extra/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  # shellcheck disable=SC2086 - one argument per wheel
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site --upgrade $wheels \
    || echo "gpu_run: installing the extra wheels failed" >&2
else
  echo "gpu_run: no .gpu/extra/*.whl (scripts/gpu_extras.sh): Pillow, tqdm and hypothesis only if the machine has them"
fi
python3 - <<'PY' 2>&1 | tee "$OUT/gpu_env.log"
import importlib.util, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
for m in ("nvidia.dali", "nvidia.nvimgcodec", "PIL", "tqdm", "hypothesis", "torchvision"):
    try:
        found = importlib.util.find_spec(m) is not None
    except ModuleNotFoundError:
        found = False
    print(f"  {m}: {'yes' if found else 'MISSING'}")
PY
nproc; free -g | head -2; df -h /dev/shm /var/tmp | tail -2

status=0
if [ "$what" = all ] || [ "$what" = tests ]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  python3 -m benchmarks gpu --out "$OUT/gpu.json" 2>&1 | tee "$OUT/gpu_bench.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
exit $status
