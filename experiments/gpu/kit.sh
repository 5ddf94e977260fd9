# experiments/gpu/kit.sh — sourced by check.sh and bare_check.sh beside it, not run: stages with
# their own status line and time limit, and the build of dpzero from the kit that pack.sh made
# (.gpu-kit/), with no Debian -dev package, no scikit-build-core and no pip install.
# Needs $out and $py (env.sh). Sets $kitdir (the unpacked prefix) and $site (where dpzero is
# importable from: PYTHONPATH).

export kit=${DPZERO_KIT:-$PWD/.gpu-kit}
export kitdir=${DPZERO_KIT_UNPACKED:-/tmp/dpzero-kit}
export site=$kitdir/site out py
status=$out/status.txt
: "${budget_s:=470}"  # the whole script's time; each stage gets at most what is left of it
t_start=$SECONDS

# stage NAME LIMIT_S COMMAND...: runs COMMAND under min(LIMIT_S, what is left of $budget_s) and
# appends one line to $out/status.txt before and one after (echoed on stderr), so that a run cut
# off anywhere still says how far it got. Returns COMMAND's status (124: timed out).
stage() {
  local name=$1 limit=$2 rc
  shift 2
  local left=$((budget_s - (SECONDS - t_start)))
  ((limit > left)) && limit=$left
  if ((limit <= 0)); then
    printf '%s  %-10s SKIPPED  no time left of %ss\n' "$(date +%T)" "$name" "$budget_s" | tee -a "$status" >&2
    return 124
  fi
  printf '%s  %-10s started  (limit %ss, %ss elapsed)\n' "$(date +%T)" "$name" "$limit" \
    $((SECONDS - t_start)) | tee -a "$status" >&2
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" bash -c '"$@"' "$name" "$@"  # a new bash: functions are exported
  rc=$?
  local verdict=ok
  ((rc == 124 || rc == 137)) && verdict="TIMED OUT"
  ((rc != 0 && rc != 124 && rc != 137)) && verdict="FAILED rc=$rc"
  printf '%s  %-10s %s  (%ss)\n' "$(date +%T)" "$name" "$verdict" $((SECONDS - t0)) | tee -a "$status" >&2
  return $rc
}

# Unpacks the Debian prefix and installs the kit's wheels (pure Python) into $site.
unpack_kit() {
  [ -f "$kit/prefix.tar.xz" ] || { echo "kit.sh: no $kit/prefix.tar.xz; run experiments/gpu/pack.sh first" >&2; return 1; }
  rm -rf "$kitdir" && mkdir -p "$kitdir" "$site"
  tar -C "$kitdir" -xJf "$kit/prefix.tar.xz"
  if compgen -G "$kit/wheels/*.whl" >/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --target "$site" "$kit"/wheels/*.whl
  fi
  echo "unpacked $(du -sh "$kitdir" | cut -f1) into $kitdir"
}

# configure_dpzero BUILD_DIR CUDA(ON|OFF) ARCHS: CMake with ninja and the kit's prefix on
# CMAKE_PREFIX_PATH (the reference values are the checkout's, tests/reference).
configure_dpzero() {
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDPZERO_BUILD_TESTS=ON \
    -DDPZERO_CUDA="$2" -DCMAKE_CUDA_ARCHITECTURES="$3" \
    -DCMAKE_PREFIX_PATH="$kitdir/usr" -DDPZERO_REFERENCE_DIR="$PWD/tests/reference" \
    -DPython3_EXECUTABLE="$(command -v "$py")"
}

# build_dpzero BUILD_DIR CUDA(ON|OFF) ARCHS: configures with the kit's prefix on CMAKE_PREFIX_PATH,
# builds with ninja on every core, and makes dpzero importable from $site (the package's Python
# files and the freshly built dpzero._C). The whole log goes to $out/build.log.
build_dpzero() {
  local bdir=$1 cuda=$2 archs=$3
  { configure_dpzero "$bdir" "$cuda" "$archs" && cmake --build "$bdir" -j "$(nproc)"; } \
    >>"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; return 1; }
  rm -rf "$site/dpzero" && cp -r python/dpzero "$site/dpzero"
  cp "$bdir"/python/_C.*.so "$site/dpzero/"
  echo "$PWD/$bdir" >"$site/build-dir"  # for DPZERO_BUILD_DIR (ensure_dpzero)
  PYTHONPATH=$site $py -c "import dpzero; print('dpzero', dpzero.__version__, 'CUDA kernels:', dpzero._C.with_cuda)"
}

# dpzero importable from $site on this machine: built from the kit unless an earlier script did it
# (a lent machine stays warm only ~30 s between calls, so a later call usually finds it bare).
ensure_dpzero() {
  if ! compgen -G "$site/dpzero/_C.*.so" >/dev/null; then
    unpack_kit && build_dpzero build-gpu ON "${DPZERO_CUDA_ARCHS:-90}" || return 1
  fi
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} DPZERO_REFERENCE_DIR=$PWD/tests/reference \
    DPZERO_BUILD_DIR=$(cat "$site/build-dir")
}

export -f unpack_kit configure_dpzero build_dpzero
