#!/bin/sh
# SSH hardening: keys only (no passwords, no keyboard-interactive, no empty passwords).
# A drop-in named to be read first (sshd keeps the first value of a keyword, so it wins over
# later drop-ins such as cloud-init's 50-cloud-init.conf and over sshd_config itself); the
# main config gets the Include line when it lacks one. sshd checks the result before a reload;
# a config it refuses is put back as it was.
# Environment: HYPER_SSHD_CONFIG (default /etc/ssh/sshd_config).
set -eu
config=${HYPER_SSHD_CONFIG:-/etc/ssh/sshd_config}
dir=$(dirname "$config")/sshd_config.d
conf="$dir/01-hyper.conf"
want='# hypercli node: keys only
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitEmptyPasswords no'
changed=""
if ! [ -f "$conf" ] || [ "$(cat "$conf")" != "$want" ]; then
  mkdir -p "$dir"
  [ -f "$conf" ] && cp -p "$conf" "$conf.hyper-old"
  printf '%s\n' "$want" > "$conf.tmp"
  mv "$conf.tmp" "$conf"
  changed="$changed $conf"
fi
include="Include $dir/*.conf"
if [ -f "$config" ] && ! grep -qxF "$include" "$config"; then
  cp -p "$config" "$config.hyper-old"
  cp -p "$config" "$config.tmp"  # keeps owner and mode
  { printf '%s\n' "$include"; cat "$config.hyper-old"; } > "$config.tmp"
  mv "$config.tmp" "$config"
  changed="$changed $config"
fi
if [ -z "$changed" ]; then
  echo "hyper-provision: ssh: unchanged"
  exit 0
fi
sshd=$(command -v sshd || echo /usr/sbin/sshd)
if [ -x "$sshd" ] && [ -f "$config" ] && ! err=$("$sshd" -t -f "$config" 2>&1); then
  for f in "$config" "$conf"; do
    if [ -f "$f.hyper-old" ]; then mv "$f.hyper-old" "$f"; else rm -f "$f"; fi
  done
  echo "hyper-provision: ssh: sshd refuses the hardened config, left as it was: $err" >&2
  exit 1
fi
rm -f "$config.hyper-old" "$conf.hyper-old"
if command -v systemctl >/dev/null 2>&1; then
  systemctl reload ssh 2>/dev/null || systemctl reload sshd 2>/dev/null || true
fi
echo "hyper-provision: ssh: changed ($changed )"
