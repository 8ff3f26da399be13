#!/usr/bin/env bash
# One prepared GPU check of KV parking: the copy engine, the store and the capture lock
# on a real CUDA device. Made for the nvidia-h200 machine (sm_90, python3 with torch+CUDA, NO
# SGLang, no network); finishes in under 8 minutes (CHECK_BUDGET_S, default 450 s, caps every step).
#
#   bash tools/gpu/check.sh [--dry-run] [--quick] [DIR]
#
# Results go to DIR (the argument) or, without one, to $OUT (the device tool's return folder):
#   check.json  one JSON summary (keys: tools/gpu/summarize.py KEYS): env, steps, imports without
#               sglang, the bench figures, targets met/unmet, tests, capture probe, ok, problems
#   check.log   everything the steps printed
#   tests.xml   pytest's JUnit XML
#   (plus the step parts: env.json imports.json bench.out probe.json steps.tsv)
#
# Steps:
#   1 env      python, torch, CUDA device, whether sglang / pytest import (sglang should not)
#   2 imports  adapter.switches.kv_park.{engine,capture,store,host_pool,host_ledger,state,tree,park,restore,pool_boot,outcomes,switch}, devkit.bench.kv_park, adapter.ops.cli import with
#              sglang blocked (the GPU machine has no SGLang)
#   3 bench    python -m adapter bench kv-park --device cuda: save and restore through the park pool
#              (page-locked once with cudaHostRegister, carved rows, chunks pipelined over two streams)
#              vs a pinned D2H / H2D memcpy of the same bytes vs SGLang's get_cpu_copy, beside the
#              pageable page-major and per-view schedules; GB/s; bytes identical; targets (check.json
#              "targets"): pool save and pool restore each >= 0.8x the pinned memcpy's speed, pool
#              save <= 1x stock get_cpu_copy's time (the CPU dry run keeps the CPU targets)
#   4 tests    pytest -m cuda tests/unit/test_kv_park_cuda.py (byte identity on the device, pageable and
#              through pinned pool rows; the pool page-locked once and unlocked at close; IndexError
#              before device indexing; the copy-stream fence; pool rows not reused before a restore
#              read them; a park and a restore that never synchronize the scheduler thread, ordered
#              after / before the forward stream on the device; the wrapped get_next_batch_to_run
#              restoring a request while its park's copy is in flight, under
#              torch.cuda.set_sync_debug_mode("error"); copies vs a concurrent global /
#              thread-local CUDA graph capture)
#   5 probe    tools/gpu/capture_probe.py: what an unlocked / locked / thread-local capture does to
#              copies on another thread (observations; the locked and thread-local ones must be clean)
#
# --dry-run: the same steps on CPU (bench --device cpu --quick, the CUDA tests collected and skipped,
#   the probe's scenarios "skipped"), the same JSON with "device": "cpu", "dry_run": true. CI runs it
#   (tests/unit/test_gpu_check_script.py), so the script cannot rot. PYTHON overrides python3.
#
# pytest: the H200 image has pytest (/work/.library/device/KINDS.md). Where it is missing, carry
# wheels in .whl/ (ignored by git) and this script installs them into /tmp/site first. Here:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform any -d .whl pytest==8.3.5 pluggy==1.5.0 iniconfig==2.0.0 packaging==24.2
# and name ".whl" in the run tool's carry. Without pytest the tests step reads "skipped: pytest
# missing" in check.json and "ok" is false; the other steps still run.
#
# The run tool command (nvidia-h200; no carry needed while the image has pytest; add ".whl" if not):
#   nvidia-smi -L; bash tools/gpu/check.sh; echo "check rc=$?"      (timeout_s 540; no "| tail": a
#   killed pipeline returns nothing; the files come back from $OUT, at most 8: this writes 8)
set -u

DRY=0 QUICK=0 DIR=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --quick) QUICK=1 ;;
    -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
    -*) echo "check.sh: unknown option $arg" >&2; exit 2 ;;
    *) DIR="$arg" ;;
  esac
done
DIR="${DIR:-${OUT:-}}"
if [ -z "$DIR" ]; then
  echo "check.sh: give a results folder (or set OUT)" >&2
  exit 2
fi
mkdir -p "$DIR" || exit 2
DIR="$(cd "$DIR" && pwd)"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT" || exit 2
PY="${PYTHON:-python3}"
BUDGET="${CHECK_BUDGET_S:-450}"
LOG="$DIR/check.log"
: >"$LOG"
: >"$DIR/steps.tsv"
rm -f "$DIR"/{env.json,imports.json,bench.out,tests.xml,probe.json,check.json}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if [ "$DRY" = 1 ]; then DEVICE=cpu; else DEVICE=cuda; fi

log() { echo "[check] $*" | tee -a "$LOG"; }

# step NAME MAX_SECONDS CMD...: runs CMD with a timeout of min(MAX, what is left of the budget).
step() {
  local name="$1" max="$2"; shift 2
  local left=$((BUDGET - SECONDS - 15)) t0=$SECONDS rc status
  [ "$max" -lt "$left" ] || max="$left"
  if [ "$max" -le 5 ]; then
    log "$name: skipped (budget spent)"
    printf '%s\t%s\t%s\t%s\n' "$name" 124 0 "skipped: budget spent" >>"$DIR/steps.tsv"
    return 0
  fi
  log "$name: start (limit ${max}s): $*"
  timeout --kill-after=10 "$max" "$@" >>"$LOG" 2>&1
  rc=$?
  case "$rc" in
    0) status=ok ;;
    124|137) status=timeout ;;
    *) status=failed ;;
  esac
  log "$name: $status rc=$rc in $((SECONDS - t0))s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$status" >>"$DIR/steps.tsv"
}

log "kv_park GPU check: device=$DEVICE dry_run=$DRY quick=$QUICK results=$DIR python=$PY budget=${BUDGET}s"

# Carried wheels (pytest where the image lacks it).
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import pytest" 2>/dev/null; then
  step wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

# 1 env
step env 60 "$PY" - "$DIR/env.json" "$DEVICE" <<'EOF'
import importlib.util, json, platform, shutil, subprocess, sys
import torch
env = {
    "python": platform.python_version(),
    "torch": torch.__version__,
    "torch_cuda": torch.version.cuda,
    "cuda_available": torch.cuda.is_available(),
    "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    "capability": list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None,
    "sglang_importable": importlib.util.find_spec("sglang") is not None,
    "pytest_available": importlib.util.find_spec("pytest") is not None,
    "cpu_count": __import__("os").cpu_count(),
}
if shutil.which("nvidia-smi"):
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem", "--format=csv,noheader"], capture_output=True, text=True)
    env["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps(env))
if sys.argv[2] == "cuda" and not env["cuda_available"]:
    sys.exit("torch sees no CUDA device")
EOF

# 2 imports without sglang
step imports 60 "$PY" - "$DIR/imports.json" <<'EOF'
import importlib, importlib.abc, json, sys
class NoSGLang(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "sglang" or name.startswith("sglang."):
            raise ImportError(f"sglang is blocked in this check ({name})")
        return None
sys.meta_path.insert(0, NoSGLang())
mods = ["adapter.switches.kv_park.page_format", "adapter.switches.kv_park.engine", "adapter.switches.kv_park.capture", "adapter.switches.kv_park.store", "adapter.switches.kv_park.save_worker", "adapter.switches.kv_park.host_pool", "adapter.switches.kv_park.host_ledger", "adapter.switches.kv_park.state", "adapter.switches.kv_park.tree", "adapter.switches.kv_park.park", "adapter.switches.kv_park.restore", "adapter.switches.kv_park.pool_boot", "adapter.switches.kv_park.outcomes", "adapter.switches.kv_park.switch", "devkit.bench.kv_park", "adapter.ops.cli"]
out = {"ok": True, "modules": mods, "error": None}
try:
    for m in mods:
        importlib.import_module(m)
except Exception as exc:
    out.update(ok=False, error=f"{m}: {type(exc).__name__}: {exc}")
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(json.dumps(out))
sys.exit(0 if out["ok"] else 1)
EOF

# 3 bench (its stdout also goes to bench.out; the last line is its JSON)
bench_args=(--device "$DEVICE")
if [ "$DRY" = 1 ] || [ "$QUICK" = 1 ]; then bench_args+=(--quick); fi
step bench 240 bash -c '"$0" -m adapter bench kv-park "${@:2}" | tee "$1"; exit "${PIPESTATUS[0]}"' "$PY" "$DIR/bench.out" "${bench_args[@]}"

# 4 tests
if "$PY" -c "import pytest" 2>/dev/null; then
  step tests 150 "$PY" -m pytest -p no:cacheprovider -q -rA -m cuda --junitxml="$DIR/tests.xml" tests/unit/test_kv_park_cuda.py
else
  log "tests: skipped: pytest missing (carry wheels in .whl/, see the header)"
  printf '%s\t%s\t%s\t%s\n' tests 127 0 "skipped: pytest missing" >>"$DIR/steps.tsv"
fi

# 5 capture probe
step probe 120 env PROBE_SCENARIO_TIMEOUT_S=35 "$PY" tools/gpu/capture_probe.py "$DIR/probe.json"

args=("$DIR" --device "$DEVICE" --elapsed "$SECONDS")
[ "$DRY" = 1 ] && args+=(--dry-run)
"$PY" tools/gpu/summarize.py "${args[@]}" 2>&1 | tee -a "$LOG"
log "done in ${SECONDS}s: $DIR/check.json"
"$PY" -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))["ok"] else 1)' "$DIR/check.json"
