#!/usr/bin/env bash
# SLURM + munge for the single-node SLURM tests (tests/fixtures/slurm.py, tests/e2e/test_slurm.py).
# Debian's packages (22.05 on Debian 12). Installs only: no daemon is started or enabled here
# (there is no systemd on CI machines; the test fixture runs munged, slurmctld and slurmd itself
# with a generated slurm.conf). Idempotent. Run as root.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/apt.sh"
apt_install_missing slurm slurm-wlm slurmctld slurmd slurm-client munge
require_binaries slurm slurmctld slurmd sbatch srun squeue scancel scontrol munged
echo "slurm: $(dpkg-query -W -f='${Version}' slurmctld)"
