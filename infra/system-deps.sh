#!/usr/bin/env bash
# Debian packages the tests and the demo use beyond Python: espeak-ng (speech for the audio
# tests and demo; required) and promtool from the `prometheus` package (the tests check the
# alert rules with it; they skip without it, except in CI where they fail). redis-server is
# installed by `mmstream up` itself. Installs what is missing when running as root (CI
# does); otherwise says, in one sentence each, what to install. --no-install-recommends
# keeps `prometheus` from pulling in node-exporter; promtool is all the tests use.
set -u
required=() optional=()
command -v espeak-ng >/dev/null || required+=(espeak-ng)
command -v promtool >/dev/null || optional+=(prometheus)
missing=("${required[@]}" "${optional[@]}")
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  if [ ${#optional[@]} -gt 0 ]; then
    echo "mmstream: promtool is missing, so the alert rule tests will skip (install it with: sudo apt-get install --no-install-recommends prometheus)." >&2
  fi
  if [ ${#required[@]} -gt 0 ]; then
    echo "mmstream: please install espeak-ng (e.g. sudo apt-get install espeak-ng); it is used to synthesize speech for the audio tests and demo." >&2
    exit 1
  fi
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
  || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; } \
  || { echo "mmstream: could not install ${missing[*]} with apt-get; install it by hand." >&2; exit 1; }
