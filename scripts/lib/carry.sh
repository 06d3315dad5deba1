# Shared by the scripts that run a study on a lent GPU machine that reaches no package registry
# (scripts/gpu-race.sh, scripts/real-sglang.sh): source it. What each does there is in its header.
# - the orchestrator's own dependencies as one pre-installed, compressed site dir (site_pack);
# - a snapshot of one commit (snapshot): the working tree changes under concurrent edits, so the
#   device runs a `git archive` of a commit, carried in a folder git ignores;
# - the size a call may carry (check_carry), the machine's facts (device_facts), per-step timing (step).

# pip's view of the device: cp312 on manylinux x86_64
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
  --platform manylinux1_x86_64)
# what one call carries beside the working tree (the limit is 64 MiB for both together)
CARRY_LIMIT_KIB=$((60 * 1024))

# site_pack WHEEL_LIST WHEELS OUT: the orchestrator's wheels (WHEEL_LIST: wheel file names), installed for
# cp312 into WHEELS/site-gpu and packed with xz into OUT (site-gpu/ at its root). Skipped if OUT exists.
site_pack() {
  local list=$1 wheels=$2 out=$3
  [ -s "$out" ] && return 0
  mkdir -p "$wheels/whl"
  # NAME==VERSION from the wheel file names; antlr4 is built from its sdist
  awk -F- '{print $1"=="$2}' "$list" | grep -v '^antlr4' >"$wheels/requirements.txt"
  python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$wheels/whl" -r "$wheels/requirements.txt"
  (cd "$wheels/whl" && python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3)
  rm -rf "$wheels/site-gpu"
  python3 -m pip install -q --no-deps --no-index --target "$wheels/site-gpu" "${PLATFORM[@]}" "$wheels"/whl/*.whl
  strip --strip-unneeded "$wheels"/site-gpu/sglang_router/sglang_router_rs*.so
  rm -rf "$wheels/site-gpu/mlflow/server/js"
  find "$wheels/site-gpu" -name __pycache__ -prune -exec rm -rf {} +
  tar -C "$wheels" -cJf "$out" site-gpu
}

# snapshot ROOT COMMIT DEST: `git archive` of COMMIT into DEST (emptied first), its SHA in
# DEST/SNAPSHOT_COMMIT; OVERLAY="path ...": those files as HEAD has them, over an older commit
snapshot() {
  local root=$1 commit=$2 dest=$3
  rm -rf "$dest"
  mkdir -p "$dest"
  git -C "$root" archive "$commit" | tar -x -C "$dest"
  git -C "$root" rev-parse "$commit" >"$dest/SNAPSHOT_COMMIT"
  for path in ${OVERLAY:-}; do
    git -C "$root" show "HEAD:$path" >"$dest/$path"
    echo "overlay: $path from $(git -C "$root" rev-parse --short HEAD)" >>"$dest/SNAPSHOT_COMMIT"
  done
}

# check_carry DIR: refuse a folder one call cannot carry beside the working tree
check_carry() {
  local kib
  kib=$(du -sk "$1" | cut -f1)
  echo "$1: ${kib} KiB"
  if [ "$kib" -gt "$CARRY_LIMIT_KIB" ]; then
    echo "$1 is ${kib} KiB: over what one call carries beside the working tree" >&2
    return 1
  fi
}

# device_facts [PYTHON]: GPU, driver, memory, python, torch (and sglang, where PYTHON has it)
device_facts() {
  local python=${1:-python3}
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  "$python" -c 'import importlib.metadata as m; print("sglang", m.version("sglang"))' 2>/dev/null || true
}

# step NAME COMMAND...: run it, then append "NAME <seconds>" to $STEPS (a file), whatever it returned
step() {
  local name=$1 t0=$SECONDS rc=0
  shift
  "$@" || rc=$?
  echo "$name $((SECONDS - t0)) s (status $rc)" | tee -a "${STEPS:-/dev/null}"
  return "$rc"
}
