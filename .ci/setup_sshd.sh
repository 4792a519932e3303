#!/usr/bin/env bash
# Install the OpenSSH server needed by tests/test_deploy_ssh.py (a loopback
# sshd on 127.0.0.1, started per test session by tests/sshd.py; this script
# only installs the binary, it never starts or enables a system service).
# Idempotent: does nothing when openssh-server is already installed. Exits nonzero when it
# cannot be installed: CI treats a skip of the ssh deploy tests as a failure (tests/ci_skips.py),
# so a machine without sshd must stop here, with the reason, not pass them silently.
set -euo pipefail
if dpkg -s openssh-server >/dev/null 2>&1 && [ -x /usr/sbin/sshd ]; then
    echo "setup_sshd: openssh-server already installed"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "setup_sshd: error: not root and no sudo: cannot install openssh-server (the ssh deploy tests need it)" >&2
        exit 1
    fi
    SUDO=sudo
else
    SUDO=
fi
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d: keep apt from starting a system sshd on port 22
tmp_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod +x /usr/sbin/policy-rc.d
    tmp_policy=1
fi
$SUDO apt-get update -qq || true
rc=0
$SUDO apt-get install -y -qq --no-install-recommends openssh-server openssh-client >/dev/null || rc=$?
if [ "$tmp_policy" = 1 ]; then $SUDO rm -f /usr/sbin/policy-rc.d; fi
if [ "$rc" != 0 ] || [ ! -x /usr/sbin/sshd ]; then
    echo "setup_sshd: error: apt-get install openssh-server failed (exit $rc); the ssh deploy tests need it" >&2
    exit 1
fi
/usr/sbin/sshd -V 2>&1 | head -1 || true
echo "setup_sshd: installed openssh-server"
