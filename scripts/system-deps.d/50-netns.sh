#!/usr/bin/env bash
# iproute2 (ip netns, veth, bridge, tc) and nftables for the virtual cluster of network namespaces:
# tests/fixtures/netcluster.py builds one namespace per node on a bridge and injects faults with
# nftables rules (silent node, partition, random loss) and tc rate limits.
# Installs only: no daemon is started or enabled here. Idempotent. Run as root.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/apt.sh"
apt_install_missing netns iproute2 nftables
require_binaries netns ip tc nft
echo "netns: iproute2 $(dpkg-query -W -f='${Version}' iproute2), nftables $(dpkg-query -W -f='${Version}' nftables)"
