#!/bin/sh
# hypercli's code for the node in $HYPER_PREFIX/<digest> (current: a link to it): the node
# agent, the chunked mount and output pushes (hyper-node = python3 -m hypercli.mount.node),
# the node watcher (preemption notices, idle watchdog) and its systemd unit. The unit is not
# enabled here: a cloud node's boot document enables it with the node's own settings, and an
# SSH host you own is never powered off by an idle watchdog.
set -eu
bundle=${HYPER_BUNDLE:?HYPER_BUNDLE names the tar of hypercli made by hyper image build}
root=${HYPER_PREFIX:-/opt/hypercli}
digest=$(sha256sum "$bundle" | cut -c1-16)
changed=""
if [ ! -d "$root/$digest" ]; then
  mkdir -p "$root/$digest.tmp"
  tar -C "$root/$digest.tmp" -xf "$bundle"
  rm -rf "${root:?}/${digest:?}"
  mv "$root/$digest.tmp" "$root/$digest"
  changed="$changed code"
fi
if [ "$(readlink "$root/current" 2>/dev/null || true)" != "$root/$digest" ]; then
  ln -sfn "$root/$digest" "$root/current"
  changed="$changed link"
fi
put() {  # put FILE MODE: install stdin as FILE when its content differs
  tmp=$(mktemp)
  cat > "$tmp"
  if [ -f "$1" ] && cmp -s "$tmp" "$1"; then
    rm -f "$tmp"
  else
    mkdir -p "$(dirname "$1")"
    install -m "$2" "$tmp" "$1"
    rm -f "$tmp"
    changed="$changed $(basename "$1")"
  fi
}
put "${HYPER_BIN:-/usr/local/bin}/hyper-node" 0755 <<EOS
#!/bin/sh
PYTHONPATH=$root/current exec python3 -m hypercli.mount.node "\$@"
EOS
put "${HYPER_LIB:-/usr/local/lib/hyper}/watch.py" 0644 < "$root/current/hypercli/node/watch.py"
put "${HYPER_UNITS:-/etc/systemd/system}/hyper-watch.service" 0644 <<'EOS'
[Unit]
Description=hypercli node watcher (preemption notices, idle watchdog)
After=network-online.target
[Service]
ExecStart=/usr/bin/python3 /usr/local/lib/hyper/watch.py --config /etc/hyper/node.json
Restart=always
RestartSec=5
[Install]
WantedBy=multi-user.target
EOS
case "$changed" in
  *hyper-watch.service*)  # systemd reads units again only when asked (started by the boot)
    if [ -d /run/systemd/system ]; then systemctl daemon-reload || true; fi ;;
esac
if [ -n "$changed" ]; then
  echo "hyper-provision: hypercli: changed ($changed )"
else
  echo "hyper-provision: hypercli: unchanged"
fi
