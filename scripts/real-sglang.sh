#!/usr/bin/env bash
# The real_sglang study (experiments/real_sglang.yaml): real sglang 0.5.17 prefill + decode on one lent GPU
# behind the real sglang-router, driven by `python -m orchestrator`. The machine reaches no registry and one
# call carries at most 64 MiB, so sglang travels in parts, copied to /tmp there by back-to-back calls
# (a machine keeps /tmp while warm: 30 s after each call).
#
#   scripts/real-sglang.sh prepare [COMMIT]  here: sglang's wheels (the probe's list) as one slimmed site
#                                            dir, packed with mooncake and the tiny model into .rs-run/c1,
#                                            c2, c3; the orchestrator's site dir and a snapshot of COMMIT
#                                            (default HEAD) in c3 too (all ignored by git)
#   scripts/real-sglang.sh snap [COMMIT]     here: the snapshot alone, again (the parts stay)
#   scripts/real-sglang.sh rehearse          here, CPU: the same study from the snapshot against the
#                                            simulator (sequential start, router gate, forced tools, sweep)
#   device `run` x4, back to back:
#     carry [".rs-run/c1"]  command: bash scripts/real-sglang.sh stage .rs-run/c1    (then c2, c4 the same)
#     carry [".rs-run/c3"]  command: set -o pipefail; bash .rs-run/c3/tree/scripts/real-sglang.sh device \
#                                    2>&1 | tee $OUT/log
#                                            there: unpack, facts, the study (its preflight first), what is
#                                            left running; results to $OUT
#   scripts/real-sglang.sh collect DIR       here: DIR is the run's files_at; writes reports/$EXPERIMENT/
#   EXPERIMENT=real_determinism (default real_sglang) picks the study, for rehearse, device and collect
#
# What the probe learnt (../shared/real-sglang/FINDINGS.md): the device's transformers 5.17 breaks sglang
# 0.5.17 at import (5.12.1 + tokenizers 0.22.2 carried), flashinfer is imported at start-up, FA3 (1.1 GB)
# is not needed with the triton attention backend, mooncake-transfer-engine-cuda13 (not the CUDA 12 one)
# runs PD over TCP, prefill and decode on one GPU must start one after the other.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$SCRIPT_DIR/.." && pwd) # here: the checkout; on the device: the snapshot (.rs-run/c3/tree)
# PLATFORM, site_pack, snapshot, check_carry, device_facts, step
. "$SCRIPT_DIR/lib/carry.sh"
RUN=$ROOT/.rs-run
WHEELS=$ROOT/.rs-wheels
SGLANG_WHEELS=${SGLANG_WHEELS:-/work/shared/real-sglang/wheels.txt}
TINY=${TINY:-/work/shared/real-sglang/tiny}
ORCH_WHEELS=${ORCH_WHEELS:-/work/shared/gpu-probes/wheels-for-the-gpu-machine.txt}
# on the device: where the parts land and sglang is unpacked (the deployment's model_path is under it)
RS=/tmp/real-sglang
STUDY_TIMEOUT_S=${STUDY_TIMEOUT_S:-500}
EXPERIMENT=${EXPERIMENT:-real_sglang}
STEPS=${STEPS:-/tmp/real-sglang-steps.txt}
# the sglang wheels built for newer manylinux than the orchestrator's
SGLANG_PLATFORM=(--platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_24_x86_64
  --platform linux_x86_64 --platform any)

# the wheels of wheels.txt ("name-version size" lines) that the servers need: not anthropic or
# docstring_parser (unused), not the CUDA 12 mooncake, not nixl (mooncake_tcp is the backend), not the
# router (the orchestrator's site has the same 0.3.2)
sglang_wheels() {
  sed 's/ .*//' "$SGLANG_WHEELS" | grep -v -e '^anthropic' -e '^docstring' -e '^mooncake_transfer_engine-0' \
    -e '^nixl' -e '^sglang_router' | awk '{n=$0; sub(/-[^-]*$/, "", n); v=$0; sub(/.*-/, "", v); print n"=="v}'
}

download() {
  mkdir -p "$WHEELS/whl"
  sglang_wheels | while read -r req; do
    python3 -m pip download -q --no-deps "${PLATFORM[@]}" "${SGLANG_PLATFORM[@]}" -d "$WHEELS/whl" "$req"
  done
}

# the site dir: every wheel but the PD backend, slimmed (FA3, sm100 and py3.10 kernels, xgrammar's
# static lib), packed as one gzip stream in 58 MiB parts
sglang_site() {
  local site=$WHEELS/site parts=$WHEELS/parts
  rm -rf "$site" "$parts"
  mkdir -p "$site" "$parts"
  for w in "$WHEELS"/whl/*.whl; do
    case $(basename "$w") in mooncake* | msgpack* | sglang_router*) continue ;; esac
    (cd "$site" && unzip -q -o "$w")
  done
  rm -f "$site"/sgl_kernel/flash_ops.abi3.so "$site"/sgl_kernel/infllm_ops.cpython-310-*.so \
    "$site"/sgl_kernel/flashmla_ops.abi3.so "$site"/xgrammar/lib/libxgrammar.a
  rm -rf "$site/sgl_kernel/sm100"
  find "$site" -name __pycache__ -prune -exec rm -rf {} +
  du -sh "$site"
  tar -C "$site" -cf - . | gzip -6 | split -b 58m -d - "$parts/site.tgz.part"
}

# mooncake-transfer-engine-cuda13 (+ msgpack), without its store, EP and benchmark binaries
mooncake() {
  local mc=$WHEELS/mc
  rm -rf "$mc"
  mkdir -p "$mc"
  (cd "$mc" && unzip -q "$WHEELS"/whl/mooncake_transfer_engine_cuda13-*.whl && unzip -q -o "$WHEELS"/whl/msgpack-*.whl)
  rm -f "$mc"/mooncake/libmooncake_pg*.so "$mc"/mooncake/transfer_engine_bench "$mc"/mooncake/mooncake_client \
    "$mc"/mooncake/mooncake_master "$mc"/mooncake/store.so "$mc"/mooncake/_store*.so "$mc"/mooncake/_ep*.so \
    "$mc"/mooncake/libmooncake_ep_device.so "$mc"/mooncake/pg_*.so
  tar -C "$mc" -czf "$WHEELS/parts/mc.tgz" .
}

# the probe's tiny model, its context raised to 16384 positions (random weights: the limit is arbitrary,
# and three rounds of forced calls with tool schemas outgrow 4096)
tiny() {
  local dir=$WHEELS/tiny-model
  rm -rf "$dir"
  mkdir -p "$dir"
  cp -r "$TINY" "$dir/tiny"
  python3 - "$dir/tiny/config.json" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["max_position_embeddings"] = 16384
json.dump(config, open(sys.argv[1], "w"), indent=2)
PY
  tar -C "$dir" -czf "$WHEELS/parts/tiny.tgz" tiny
}

prepare() {
  local commit=${1:-HEAD}
  : >"$STEPS"
  [ -n "${SKIP_DL:-}" ] || step download download
  step sglang_site sglang_site
  step mooncake mooncake
  step tiny tiny
  step orchestrator_site site_pack "$ORCH_WHEELS" "$ROOT/.gpu-wheels" "$WHEELS/site-gpu.tar.xz"
  rm -rf "$RUN"
  mkdir -p "$RUN/c1" "$RUN/c2" "$RUN/c3" "$RUN/c4"
  cp "$WHEELS/parts/site.tgz.part00" "$RUN/c1/"
  cp "$WHEELS/parts/site.tgz.part01" "$RUN/c2/"
  # mooncake in a part of its own: with the orchestrator's site and the snapshot, c3 outgrew one call
  cp "$WHEELS/parts/mc.tgz" "$RUN/c4/"
  cp "$WHEELS"/parts/site.tgz.part0[2-9] "$WHEELS/parts/tiny.tgz" "$WHEELS/site-gpu.tar.xz" "$RUN/c3/"
  # the orchestrator's dependencies newer than the shared wheel list (httptools: workload/http1.py)
  python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$RUN/c3" httptools==0.9.0
  snap "$commit"
  cat "$STEPS"
}

# snap [COMMIT]: the snapshot alone, taken again into c3 (after a commit; the parts stay)
snap() {
  step snapshot snapshot "$ROOT" "${1:-HEAD}" "$RUN/c3/tree"
  for c in c1 c2 c3 c4; do check_carry "$RUN/$c" || exit 1; done
  echo "snapshot of $(head -1 "$RUN/c3/tree/SNAPSHOT_COMMIT") ready in $RUN (c1, c2, c4 staged; c3 runs)"
}

# stage DIR (on the device): copy a carried part to /tmp, where the machine keeps it while warm
stage() {
  mkdir -p "$RS/parts"
  find "$1" -maxdepth 1 -type f -exec cp {} "$RS/parts/" \;
  ls -la "$RS/parts"
}

rehearse() {
  # the study's shape on the CPU: the simulated deployment in sglang_tiny_pd's place, started the same way
  local out=/tmp/real-sglang-rehearsal
  rm -rf "$out"
  mkdir -p "$out"
  cd "$RUN/c3/tree"
  PYTHONPATH=$RUN/c3/tree timeout 900 python3 -m orchestrator -m +experiment=$EXPERIMENT \
    deployment=sim_dsv4 deployment.sequential_start=true \
    report.dir="$out/reports" tracking.uri="sqlite:///$out/mlruns.db" hydra.sweep.dir="$out/multirun" \
    "$@" 2>&1 | tail -40
  pack "$out" "$out/reports/$EXPERIMENT" "$out/results"
  echo "rehearsal results in $out/results (collect them with: scripts/real-sglang.sh collect $out/results)"
}

# pack WORK REPORT_DIR DEST: the report, every role's log of every start, the MLflow store, into DEST
pack() {
  local work=$1 report=$2 dest=$3
  mkdir -p "$dest/logs"
  cp -r "$report" "$dest/study" 2>/dev/null || echo "no report at $report" >&2
  for role in prefill decode router; do
    for d in "$HOME"/.cache/heisenhunt/local/"$role"/logs/"$EXPERIMENT"-*; do
      [ -f "$d/$role.log" ] && cp "$d/$role.log" "$dest/logs/$(basename "$d").$role.log"
    done
  done
  # the MLflow store (runs and artifacts): the report can be rebuilt here with `python -m orchestrator.report`
  cp "$work"/mlruns.db "$dest/" 2>/dev/null || true
  [ -d "$work/mlruns" ] && tar -C "$work" -czf "$dest/mlruns-artifacts.tgz" mlruns
  cp "$STEPS" "$dest/steps.txt" 2>/dev/null || true
}

# what is left running after the study: GPU processes and any sglang process
leftovers() {
  echo "GPU processes:"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader || true
  nvidia-smi --query-gpu=memory.used --format=csv,noheader || true
  echo "sglang processes:"
  ps -eo pid,pgid,etimes,args | grep -e sglang.launch_server -e sglang_router -e sglang:: | grep -v grep || echo none
}

device() {
  local t0=$SECONDS tree=$ROOT res=/tmp/real-sglang-results
  STEPS=$res/steps.txt
  rm -rf "$res" "$RS/site" "$RS/mc" "$RS/tiny" /tmp/site-gpu "$HOME"/.cache/heisenhunt/local/*/logs/"$EXPERIMENT"-*
  mkdir -p "$res" "$RS/site" "$RS/mc"
  stage "$(cd "$ROOT/.." && pwd)" >/dev/null # this call's part (c3), beside the tree
  step unpack_sglang sh -c "cat $RS/parts/site.tgz.part* | tar -xzf - -C $RS/site"
  step unpack_rest sh -c "tar -xzf $RS/parts/mc.tgz -C $RS/mc && tar -xzf $RS/parts/tiny.tgz -C $RS \
    && tar -C /tmp -xJf $RS/parts/site-gpu.tar.xz \
    && for w in $RS/parts/*.whl; do python3 -m zipfile -e \$w /tmp/site-gpu; done"
  # the servers' interpreter: the machine's python3 and torch, sglang's site ahead of its own packages
  printf '#!/bin/sh\nPYTHONPATH=%s/site:%s/mc exec python3 "$@"\n' "$RS" "$RS" >"$RS/python"
  chmod +x "$RS/python"
  export PYTHONPATH=/tmp/site-gpu:$tree PYTHONUNBUFFERED=1
  cd "$tree"
  {
    echo "snapshot: $(cat SNAPSHOT_COMMIT)"
    device_facts "$RS/python"
  } | tee "$res/device.txt"
  # the free-GPU gate on the real GPU: refused while a process of its own holds memory, then on (once)
  [ -n "${GATE_DEMO:-}" ] && step gpu_gate sh -c "python3 scripts/gpu_gate_demo.py +experiment=$EXPERIMENT \
    >$res/gpu_gate.txt 2>&1; tail -8 $res/gpu_gate.txt"
  step study timeout "$STUDY_TIMEOUT_S" python3 -m orchestrator -m +experiment=$EXPERIMENT \
    ++cluster.hosts.prefill.python=$RS/python ++cluster.hosts.decode.python=$RS/python "$@" \
    >"$res/study.log" 2>&1 || echo "study ended with status $?" | tee -a "$res/study.log"
  tail -30 "$res/study.log"
  leftovers | tee "$res/leftovers.txt"
  echo "total $((SECONDS - t0)) s" | tee -a "$STEPS"
  pack "$tree" "$tree/reports/$EXPERIMENT" "$res"
  tar -C "$res" -czf "${OUT:-/tmp}/${EXPERIMENT}_results.tar.gz" .
  ls -la "${OUT:-/tmp}"
}

collect() {
  local src=$1
  shift
  local dir=/tmp/$EXPERIMENT-collected dest=$ROOT/reports/$EXPERIMENT
  rm -rf "$dir"
  mkdir -p "$dir"
  tar -C "$dir" -xzf "$src/${EXPERIMENT}_results.tar.gz"
  python3 -m orchestrator.gpu.device_run "$dir" --out "$dest" "$@"
}

cmd=${1:-}
shift || true
case "$cmd" in
  prepare) prepare "$@" ;;
  snap) snap "$@" ;;
  rehearse) rehearse "$@" ;;
  stage) stage "$@" ;;
  device) device "$@" ;;
  collect) collect "$@" ;;
  *)
    sed -n '2,22p' "$0"
    exit 2
    ;;
esac
