#!/usr/bin/env bash
# Toxiproxy for the chaos suite's network faults (latency, bandwidth, cuts between workers and
# the broker or Redis): built from the Go module proxy into ~/.cache/mmstream/bin as
# toxiproxy-server and toxiproxy-cli (the runner finds them there or on PATH). Needs Go;
# installs golang-go with apt-get when missing and running as root. Idempotent.
set -euo pipefail
VERSION=v2.12.0
BIN="${MMSTREAM_LOCAL_CACHE_DIR:-$HOME/.cache/mmstream}/bin"
if [ -x "$BIN/toxiproxy-server" ] && [ -x "$BIN/toxiproxy-cli" ]; then exit 0; fi
if ! command -v go >/dev/null; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq golang-go >/dev/null 2>&1 || { apt-get update -qq >/dev/null && apt-get install -y -qq golang-go >/dev/null; }
  else
    echo "mmstream: the chaos suite's network faults need Toxiproxy, built with Go: install Go (e.g. apt-get install golang-go) and run infra/chaos-tools.sh again." >&2
    exit 1
  fi
fi
mkdir -p "$BIN"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for cmd in server cli; do
  GOBIN="$tmp/$cmd" go install "github.com/Shopify/toxiproxy/v2/cmd/$cmd@$VERSION"
  mv "$tmp/$cmd/$cmd" "$BIN/toxiproxy-$cmd"
done
echo "toxiproxy $VERSION: $BIN/toxiproxy-server, $BIN/toxiproxy-cli"
