#!/usr/bin/env bash
# Prometheus server + promtool (Debian's package, 2.42 on Debian 12) for the metrics tests:
# tests/fixtures/prometheus.py starts the binary itself on 127.0.0.1 with a temporary config and
# TSDB; promtool checks the exposition, the alert rules and the rule unit tests.
#
# Installs only: no daemon is started or enabled here. Idempotent; runs apt-get update only when
# the package is missing. Run as root.
set -euo pipefail

if [ "$(dpkg-query -W -f='${Status}' prometheus 2>/dev/null || true)" = "install ok installed" ] \
    && command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    echo "prometheus: already installed ($(dpkg-query -W -f='${Version}' prometheus))"
    exit 0
fi

if [ "$(id -u)" != "0" ]; then
    echo "prometheus: need root to install the prometheus package" >&2
    exit 1
fi

echo "prometheus: installing"
export DEBIAN_FRONTEND=noninteractive
# Other setup scripts may run apt concurrently: wait for the dpkg/apt locks instead of failing.
APT=(apt-get -o DPkg::Lock::Timeout=300)
"${APT[@]}" update -qq
# policy-rc.d 101: never start services from maintainer scripts, even where an init system exists.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod +x "$policy"
    created_policy=1
fi
trap '[ "$created_policy" = 1 ] && rm -f "$policy"' EXIT
"${APT[@]}" install -y -qq --no-install-recommends prometheus >/dev/null
for b in prometheus promtool; do
    command -v "$b" >/dev/null || { echo "prometheus: $b missing after install" >&2; exit 1; }
done
echo "prometheus: installed ($(dpkg-query -W -f='${Version}' prometheus))"
