#!/usr/bin/env bash
# What a fresh machine must already have; each miss is one sentence saying what to install.
set -u
fail() { echo "mmstream: $1" >&2; exit 1; }
py=${PYTHON:-python3}
command -v "$py" >/dev/null || fail "Python 3.11 or newer is needed: install python3 (e.g. apt-get install python3 python3-venv)."
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || fail "Python 3.11 or newer is needed; $py is $("$py" -c 'import platform; print(platform.python_version())')."
"$py" -c 'import venv, ensurepip' 2>/dev/null \
  || fail "Python's venv module is missing: install it (e.g. apt-get install python3-venv)."
command -v java >/dev/null \
  || fail "Java 17 or newer is needed to run the local Kafka broker: apt-get install openjdk-17-jre-headless."
jv=$(java -XshowSettings:properties -version 2>&1 | awk -F'= ' '/java.specification.version/ {print $2}')
[ "${jv%%.*}" -ge 17 ] 2>/dev/null || fail "Java 17 or newer is needed to run the local Kafka broker; found Java $jv."
command -v mvn >/dev/null \
  || fail "Maven is needed to fetch the Kafka broker jars from Maven Central: apt-get install maven."
# llama-cpp-python has no wheel for this platform: setup builds it from source (infra/llama-cpp.sh).
command -v cmake >/dev/null && { command -v c++ >/dev/null || command -v g++ >/dev/null; } \
  || fail "cmake and a C++ compiler are needed to build llama.cpp (the generator's engine): apt-get install cmake g++."
exit 0
