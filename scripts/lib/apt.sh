# Sourced by scripts/system-deps.d/*.sh: install Debian packages idempotently, never start daemons.
#
#   apt_install_missing LABEL PKG...   installs the PKGs that are not installed yet (root only);
#                                      runs apt-get update only when something is missing.

apt_install_missing() {
    local label="$1"; shift
    local missing=() p
    for p in "$@"; do
        if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" != "install ok installed" ]; then
            missing+=("$p")
        fi
    done
    if [ "${#missing[@]}" -eq 0 ]; then
        echo "$label: already installed"
        return 0
    fi
    if [ "$(id -u)" != "0" ]; then
        echo "$label: need root to install ${missing[*]}" >&2
        return 1
    fi
    echo "$label: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # Other setup scripts may run apt concurrently: wait for the dpkg/apt locks instead of failing.
    local apt=(apt-get -o DPkg::Lock::Timeout=300)
    "${apt[@]}" update -qq
    # policy-rc.d 101: never start services from maintainer scripts, even where an init system exists.
    local policy=/usr/sbin/policy-rc.d created_policy=0 rc=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy"
        chmod +x "$policy"
        created_policy=1
    fi
    "${apt[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || rc=$?
    [ "$created_policy" = 1 ] && rm -f "$policy"
    return "$rc"
}

require_binaries() {
    local label="$1"; shift
    local b
    for b in "$@"; do
        command -v "$b" >/dev/null || [ -x "/usr/sbin/$b" ] || { echo "$label: $b missing after install" >&2; return 1; }
    done
}
