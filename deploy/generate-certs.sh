#!/usr/bin/env bash
# Generate the deployment's TLS material and SuperNode keys into deploy/certs (git-ignored, never
# commit it): a CA, the SuperLink's certificate (for superlink, localhost, 127.0.0.1, ::1) and
# one P-384 key pair per SuperNode in OpenSSH format. Existing files are kept.
#
#   deploy/generate-certs.sh [NODES] [--host NAME ...] [--force]
#
# (--host adds a name or address of the SuperLink to its certificate; --force replaces
# everything.) It runs `fedpriv deploy certs` from this checkout, so it needs the project's
# dependencies installed (`pip install -e .`); without Python on the host,
# `docker compose run --rm setup` does the same inside the image.
set -euo pipefail
cd "$(dirname "$0")/.."
nodes="${1:-3}"
[[ $# -gt 0 ]] && shift
exec python3 -m fedpriv.cli deploy certs deploy/certs --nodes "$nodes" "$@"
