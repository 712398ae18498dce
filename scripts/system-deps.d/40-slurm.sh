#!/usr/bin/env bash
# SLURM + munge for the single-node SLURM tests (tests/fixtures/slurm.py, tests/e2e/test_slurm.py).
#
# Debian's packages (22.05 on Debian 12). Installs only: no daemon is started or enabled here
# (there is no systemd on CI machines; the test fixture runs munged, slurmctld and slurmd itself
# with a generated slurm.conf). Idempotent; runs apt-get update only when something is missing.
# Run as root.
set -euo pipefail

PACKAGES=(slurm-wlm slurmctld slurmd slurm-client munge)

missing=()
for p in "${PACKAGES[@]}"; do
    if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" != "install ok installed" ]; then
        missing+=("$p")
    fi
done

if [ "${#missing[@]}" -eq 0 ]; then
    echo "slurm: already installed (slurm $(dpkg-query -W -f="\${Version}" slurmctld))"
    exit 0
fi

if [ "$(id -u)" != "0" ]; then
    echo "slurm: need root to install ${missing[*]}" >&2
    exit 1
fi

echo "slurm: installing ${missing[*]}"
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
"${APT[@]}" install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
for b in slurmctld slurmd sbatch srun squeue scancel scontrol munged; do
    command -v "$b" >/dev/null || [ -x "/usr/sbin/$b" ] || { echo "slurm: $b missing after install" >&2; exit 1; }
done
echo "slurm: installed (slurm $(dpkg-query -W -f="\${Version}" slurmctld))"
