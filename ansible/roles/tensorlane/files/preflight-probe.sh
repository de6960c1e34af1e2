# Preflight probe of a host for the tensorlane agent; changes nothing that outlives it.
# Run as `sh -c "$(cat preflight-probe.sh)" probe INTERFACE PYTHON [GROUP]`; prints one "key value" line per
# finding.
iface=$1
python=$2
group=${3:-}
echo "uid $(id -u)"
# sd_booted(): systemd runs the host when /run/systemd/system exists.
if [ -d /run/systemd/system ]; then echo "service_mgr systemd"; else echo "service_mgr other"; fi
if out=$(ip -o link show dev "$iface" 2>&1); then echo "link ok"; else echo "link_error $out" | head -n 1; fi
echo "root_qdisc $(tc qdisc show dev "$iface" root 2>/dev/null | head -n 1)"
# Which qdiscs and whether nf_tables: tried on the loopback of a throwaway network namespace.
unshare --net -- sh -c '
    ip link set lo up
    for q in htb prio; do
        tc qdisc add dev lo root handle 1: "$q" >/dev/null 2>&1 && echo "qdisc $q" && tc qdisc del dev lo root
    done
    nft add table inet tensorlane_probe >/dev/null 2>&1 && echo "nftables yes"
' 2>&1 | sed 's/^unshare: /probe_error unshare: /'
if v=$("$python" -c 'import sys, venv, ensurepip; print(sys.version.split()[0]); sys.exit(sys.version_info < (3, 11))' 2>&1)
then echo "python $v"; else echo "python_error $v" | tr '\n' ' '; echo; fi
if [ -n "$group" ]; then
    if getent group "$group" >/dev/null; then echo "group ok"; else echo "group_error no group $group"; fi
fi
exit 0
