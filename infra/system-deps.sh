#!/usr/bin/env bash
# Debian packages the tests and the demo use beyond Python: espeak-ng (speech for the audio
# tests and demo). redis-server is installed by `mmstream up` itself. Installs what is
# missing when running as root; otherwise says, in one sentence, what to install.
set -u
missing=()
command -v espeak-ng >/dev/null || missing+=(espeak-ng)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "mmstream: please install ${missing[*]} (e.g. sudo apt-get install ${missing[*]}); it is used to synthesize speech for the audio tests and demo." >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 \
  || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "${missing[@]}" >/dev/null; } \
  || { echo "mmstream: could not install ${missing[*]} with apt-get; install it by hand." >&2; exit 1; }
