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
# The agent reads its config with tomllib (Python 3.11); the role builds its virtualenv with venv and ensurepip.
if ! v=$("$python" -c 'import sys; print(sys.version.split()[0])' 2>&1); then
    echo "python_error cannot run it: $v" | tr '\n' ' '; echo
elif ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "python_error it is Python $v, older than 3.11 (the agent needs tomllib)"
elif ! e=$("$python" -c 'import venv, ensurepip' 2>&1); then
    echo "python_error Python $v lacks venv or ensurepip: $e" | tr '\n' ' '; echo
else echo "python $v"; fi
if [ -n "$group" ]; then
    if getent group "$group" >/dev/null; then echo "group ok"; else echo "group_error no group $group"; fi
fi
exit 0
