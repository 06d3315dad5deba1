#!/usr/bin/env bash
# The gpu_race study (experiments/gpu_race.yaml) on a lent GPU machine that reaches no package registry.
#
#   scripts/gpu-race.sh prepare [COMMIT]   here: the wheels as one pre-installed, compressed site dir, and
#                                          a snapshot of COMMIT (default HEAD), both in .gpu-run/ (ignored);
#                                          OVERLAY="file ..." takes those files from HEAD over COMMIT
#   scripts/gpu-race.sh rehearse           here, CPU only: the same study from the snapshot, small, with a
#                                          CPU stand-in for the GPU step (checks configs, counters, report)
#   device `run`, carry [".gpu-run"], command:  bash .gpu-run/tree/scripts/gpu-race.sh device
#                                          there: unpack, probe, GPU tests, the study; results to $OUT
#   scripts/gpu-race.sh collect DIR [report options]
#                                          here: DIR is the run's files_at; writes reports/gpu_race/
#
# What was learnt getting here (2026-12-01, one H200, torch 2.11 + CUDA 13, python 3.12):
# - The 58 wheels are 68 MB as wheels, over one call's 64 MiB. Installed here with --target for
#   cp312/manylinux, the sglang-router .so stripped (92 -> 72 MB) and mlflow's web UI (27 MB, unused:
#   MLflow runs on sqlite) left out, the site dir packs with xz to 34 MB: one call carries it all,
#   so the whole run is one device command and needs no second call within the 30 s warm window.
# - antlr4-python3-runtime 4.9.3 (hydra-core's) exists only as an sdist: built here as a wheel first.
# - Pin hydra-core==1.3.2 omegaconf==2.3.0, or --only-binary=:all: falls back to hydra-core 0.11.3.
# - Console scripts installed here point at this machine's python; nothing uses them (every server
#   is started as `python -m module`).
# - The working tree changes under concurrent edits: the device gets a `git archive` of one commit.
#   A commit of the core can be broken too (03b6d5d: arm.py called run_bench_sync(url=...) after
#   bench.py changed): e76a138 ran both studies; rehearse before spending device time.
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$SCRIPT_DIR/.." && pwd) # here: the checkout; on the device: the snapshot (.gpu-run/tree)
# PLATFORM, site_pack, snapshot, check_carry, device_facts
. "$SCRIPT_DIR/lib/carry.sh"
RUN=$ROOT/.gpu-run
WHEELS=$ROOT/.gpu-wheels
WHEEL_LIST=${WHEEL_LIST:-/work/shared/gpu-probes/wheels-for-the-gpu-machine.txt}
STUDY_TIMEOUT_S=${STUDY_TIMEOUT_S:-480}
EXPERIMENT=${EXPERIMENT:-gpu_race} # or gpu_race_restarts (its study name is the experiment's name)

prepare() {
  local commit=${1:-HEAD}
  mkdir -p "$RUN"
  site_pack "$WHEEL_LIST" "$WHEELS" "$RUN/site.tar.xz"
  snapshot "$ROOT" "$commit" "$RUN/tree"
  du -sh "$RUN"
  check_carry "$RUN" || exit 1
  echo "snapshot of $(cat "$RUN/tree/SNAPSHOT_COMMIT") ready; run on the device: bash .gpu-run/tree/scripts/gpu-race.sh device"
}

rehearse() {
  # the study's shape on the CPU: a stand-in step (tests/gpu/scripted.py), few sessions, no bench sweep
  local out=/tmp/gpu-race-rehearsal
  rm -rf "$out"
  mkdir -p "$out"
  cd "$RUN/tree"
  PYTHONPATH=$RUN/tree timeout 600 python3 -m orchestrator -m +experiment="$EXPERIMENT" \
    deployment.roles.decode.env.HEISENHUNT_DECODE_ENGINE=tests.gpu.scripted:ScriptedRowsEngine \
    workload.sessions=12 workload.rounds=2 'bench.concurrency=[1]' bench.requests_per_worker=1 \
    report.dir="$out/reports" tracking.uri="sqlite:///$out/mlruns.db" \
    hydra.sweep.dir="$out/multirun" "$@" 2>&1 | tail -40
  pack "$out" "$out/reports/$EXPERIMENT" "$out/results"
  echo "rehearsal results in $out/results (collect them with: scripts/gpu-race.sh collect $out/results)"
}

# pack WORK REPORT_DIR DEST: the report, the decode logs, the per-start counters, into DEST
pack() {
  local work=$1 report=$2 dest=$3
  mkdir -p "$dest/logs"
  cp -r "$report" "$dest/study" 2>/dev/null || echo "no report at $report" >&2
  local decode_logs=$HOME/.cache/heisenhunt/local/decode/logs
  for d in "$decode_logs"/"$EXPERIMENT"-*; do
    [ -f "$d/decode.log" ] && cp "$d/decode.log" "$dest/logs/$(basename "$d").decode.log"
  done
  cp -r "$RUN/tree/gpu-counters" "$dest/counters" 2>/dev/null || mkdir -p "$dest/counters"
  # the MLflow store itself: the report can then be rebuilt here with `python -m orchestrator.report`
  cp "$work"/mlruns.db "$dest/" 2>/dev/null || true
}

device() {
  RUN=$(cd "$ROOT/.." && pwd) # this script runs from the snapshot, .gpu-run/tree/scripts/
  local t0=$SECONDS tree=$RUN/tree res=/tmp/gpu-race-results
  rm -rf "$res" /tmp/site-gpu "$tree/gpu-counters" "$HOME"/.cache/heisenhunt/local/decode/logs/"$EXPERIMENT"-*
  mkdir -p "$res"
  tar -C /tmp -xJf "$RUN/site.tar.xz"
  export PYTHONPATH=/tmp/site-gpu:$tree PYTHONUNBUFFERED=1
  cd "$tree"
  {
    echo "snapshot: $(cat SNAPSHOT_COMMIT)"
    device_facts
  } | tee "$res/device.txt"
  echo "== unpacked in $((SECONDS - t0)) s"
  local tests_rc=0
  if [ -z "${SKIP_PROBE:-}" ]; then
    python3 -m orchestrator.gpu.probe --replays 40 --starts 2 --workspace-kib 2 --out "$res/probe.json" \
      | tee "$res/probe.log" || echo "probe failed" >&2
    python3 -m pytest -q -p no:cacheprovider tests/gpu >"$res/gpu-tests.log" 2>&1 || tests_rc=$?
  else # the real engine behind the server, the one GPU test the study cannot do without
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernel_gpu.py -k real_engine \
      >"$res/gpu-tests.log" 2>&1 || tests_rc=$?
  fi
  tail -5 "$res/gpu-tests.log"
  echo "== probe and GPU tests (status $tests_rc) done at $((SECONDS - t0)) s"
  local t_study=$SECONDS
  if [ "$tests_rc" -ne 0 ] && [ -z "${FORCE_STUDY:-}" ]; then
    # a decode that cannot start would cost every arm its whole health timeout
    echo "GPU tests failed: study skipped (FORCE_STUDY=1 runs it anyway)" | tee "$res/study.log"
  else
    timeout "$STUDY_TIMEOUT_S" python3 -m orchestrator -m +experiment="$EXPERIMENT" "$@" >"$res/study.log" 2>&1 \
      || echo "study ended with status $?" | tee -a "$res/study.log"
    tail -25 "$res/study.log"
  fi
  echo "study_s=$((SECONDS - t_study)) total_s=$((SECONDS - t0))" | tee "$res/timing.txt"
  pack "$tree" "$tree/reports/$EXPERIMENT" "$res"
  tar -C "$res" -czf "${OUT:-/tmp}/${EXPERIMENT}_results.tar.gz" .
  ls -la "${OUT:-/tmp}"
}

collect() {
  local src=$1
  shift
  local dir=$src
  if [ -f "$src/${EXPERIMENT}_results.tar.gz" ]; then
    dir=/tmp/$EXPERIMENT-collected
    rm -rf "$dir"
    mkdir -p "$dir"
    tar -C "$dir" -xzf "$src/${EXPERIMENT}_results.tar.gz"
  fi
  local dest=$ROOT/reports/gpu_race
  [ "$EXPERIMENT" = gpu_race ] || dest=$dest/${EXPERIMENT#gpu_race_}
  python3 -m orchestrator.gpu.report "$dir" --out "$dest" "$@"
}

cmd=${1:-}
shift || true
case "$cmd" in
  prepare) prepare "$@" ;;
  rehearse) rehearse "$@" ;;
  device) device "$@" ;;
  collect) collect "$@" ;;
  *)
    sed -n '2,12p' "$0"
    exit 2
    ;;
esac
