#!/bin/sh
# Give a worker that is not root a compile child of another user (SECURITY.md, "What a worker
# trusts"). Run as root, once, where the worker runs: docker/Dockerfile runs it at build time,
# tests/integration/test_compile_user.py runs it on the test host.
#
#   compile-sandbox.sh WORKER_USER COMPILE_USER LAUNCHER_PATH
#
# - COMPILE_USER: a system user and group of its own, no home, no shell; it owns nothing, so
#   the child it runs can read only what is open to every user plus the box the worker shares
#   with it.
# - WORKER_USER joins COMPILE_USER's group: the box is the worker's, shared with that group.
#   The compile user is in no group of the worker's.
# - LAUNCHER_PATH: a copy of util-linux setpriv, owned by root and WORKER_USER's group, mode
#   0750, with the file capabilities cap_setuid,cap_setgid. Only the worker (and root) may run
#   it; the worker runs it to start its compile child as COMPILE_USER (FARM_COMPILE_LAUNCHER).
#   setcap comes from libcap2-bin.
set -eu
worker=$1 compile=$2 launcher=$3

getent group "$compile" >/dev/null || groupadd --system "$compile"
getent passwd "$compile" >/dev/null || useradd --system --gid "$compile" --no-create-home \
    --home-dir /nonexistent --shell /usr/sbin/nologin "$compile"
usermod --append --groups "$compile" "$worker"

install -d -m 0755 "$(dirname "$launcher")"
install -o root -g "$(id -gn "$worker")" -m 0750 "$(command -v setpriv)" "$launcher"
setcap cap_setuid,cap_setgid+ep "$launcher"
