#!/usr/bin/env bash
# Prometheus server + promtool (Debian's package, 2.42 on Debian 12) for the metrics tests:
# tests/fixtures/prometheus.py starts the binary itself on 127.0.0.1 with a temporary config and
# TSDB; promtool checks the exposition, the alert rules and the rule unit tests.
# Installs only: no daemon is started or enabled here. Idempotent. Run as root.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/apt.sh"
apt_install_missing prometheus prometheus
require_binaries prometheus prometheus promtool
echo "prometheus: $(dpkg-query -W -f='${Version}' prometheus)"
