#!/bin/sh
# SSH hardening: keys only, root by key only (sshd_config.d, read by Ubuntu's sshd_config).
set -eu
dir=${HYPER_SSHD_DIR:-/etc/ssh/sshd_config.d}
conf="$dir/50-hyper.conf"
want='# hypercli node: keys only
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
PermitEmptyPasswords no'
if [ -f "$conf" ] && [ "$(cat "$conf")" = "$want" ]; then
  echo "hyper-provision: ssh: unchanged"
  exit 0
fi
mkdir -p "$dir"
printf '%s\n' "$want" > "$conf.tmp"
mv "$conf.tmp" "$conf"
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet ssh 2>/dev/null; then
  systemctl reload ssh || true
fi
echo "hyper-provision: ssh: changed ($conf)"
