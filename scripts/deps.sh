#!/usr/bin/env bash
# Installs the Debian packages named as arguments that are missing: with apt-get when run as root,
# otherwise prints the command to run and fails. Sourced by the quick-start scripts (scripts/test.sh,
# scripts/demo.sh) and by CI's (.ci/run and the scripts beside it).
sdpa_install_missing() {
  local missing=()
  local pkg
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -eq 0 ]; then
    echo "sdpa: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo apt-get update -q >/dev/null && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
      --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "sdpa: missing packages; install them with:" >&2
    echo "  sudo apt-get install ${missing[*]}" >&2
    return 1
  fi
}

# Prints "-G Ninja" (one word per line, for mapfile) when Ninja is installed and the build dir $1 is new or
# already Ninja's, nothing otherwise: Ninja, unlike Make, compiles a test program's files while the
# kernels' library the program links is still compiling, which keeps both cores of a small machine busy.
# A build dir keeps the generator it was made with.
sdpa_generator_args() {
  if command -v ninja >/dev/null && { [ ! -f "$1/CMakeCache.txt" ] ||
    grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$1/CMakeCache.txt"; }; then
    printf '%s\n' -G Ninja
  fi
}
