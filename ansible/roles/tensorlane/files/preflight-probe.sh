# Preflight probe of a host for the tensorlane agent; changes nothing that outlives it.
# Run as `sh -c "$(cat preflight-probe.sh)" probe IFACES PYTHON [GROUP [SUBNET...]]`, IFACES being the interface
# names separated by spaces, or `auto` (then the interfaces with a unicast route to the SUBNETs, as the agent finds
# them at start-up); prints one "key value" line per finding:
#   uid N | service_mgr systemd|other
#   route SUBNET DEV...       (auto) the interfaces that routes to SUBNET leave through; route_error when none does
#   link IFACE ok | link_error IFACE WHY
#   queues IFACE DEV...       the devices that carry IFACE's queues: its members for a bond or team, else itself
#   root_qdisc DEV [qdisc KIND HANDLE root ...]
#   speed DEV MBITS | speed DEV none [placeholder|STATE]   the driver's speed, as the agent reads it: none with
#                             placeholder for veth and tun, with the link's state when it is down (a speed comes
#                             with the carrier), bare when the link is up and still reports none
#   qdisc htb | qdisc prio | nftables yes | probe_error ...
#   python VERSION | python_error WHY | group ok | group_error WHY
ifaces=$1
python=$2
group=${3:-}
if [ $# -ge 3 ]; then shift 3; else set --; fi
set -f  # names and networks are split on spaces, never globbed
echo "uid $(id -u)"
# sd_booted(): systemd runs the host when /run/systemd/system exists.
if [ -d /run/systemd/system ]; then echo "service_mgr systemd"; else echo "service_mgr other"; fi

# The output devices of `ip -o route` lines on stdin (every next hop of a multipath route), never lo.
route_devs() {
    awk '{ for (i = 1; i < NF; i++) if ($i == "dev" && $(i + 1) != "lo") print $(i + 1) }'
}

# The speed the agent would shape DEV to without link_rate (agent/kernel/detect.py: veth and tun report a placeholder).
device_speed() {
    if ip -d -o link show dev "$1" 2>/dev/null | tr '\\' '\n' | awk '{ print $1 }' | grep -qx -e veth -e tun; then
        echo "none placeholder"; return
    fi
    mbits=$(cat "/sys/class/net/$1/speed" 2>/dev/null)
    case $mbits in ''|-*|0|*[!0-9]*) ;; *) echo "$mbits"; return ;; esac
    state=$(cat "/sys/class/net/$1/operstate" 2>/dev/null)
    case $state in up|unknown|'') echo none ;; *) echo "none $state" ;; esac
}

if [ "$ifaces" = auto ]; then
    # As the agent does: unicast routes of any table that overlap a subnet (inside it or containing it); the
    # default route counts only when no more specific route covers the subnet.
    found=
    for net in "$@"; do
        case $net in *:*) fam=-6 ;; *) fam=-4 ;; esac
        routes=$( { ip "$fam" -o route show table all type unicast to root "$net"
                    ip "$fam" -o route show table all type unicast to match "$net"; } 2>&1)
        specific=$(printf '%s\n' "$routes" | grep -v -e '^default ' -e '^0\.0\.0\.0/0 ' -e '^::/0 ' | route_devs)
        devs=${specific:-$(printf '%s\n' "$routes" | route_devs)}
        devs=$(printf '%s\n' "$devs" | awk 'NF && !seen[$0]++' | tr '\n' ' ')
        if [ -n "$devs" ]; then echo "route $net ${devs% }"; found="$found $devs"; fi
    done
    ifaces=$(printf '%s\n' $found | awk 'NF && !seen[$0]++' | tr '\n' ' ')
    [ -n "$ifaces" ] || echo "route_error no interface has a unicast route to $*"
fi

for iface in $ifaces; do
    if ! out=$(ip -d -o link show dev "$iface" 2>&1); then
        echo "link_error $iface $out" | head -n 1 | sed 's/\.$//'
        continue
    fi
    echo "link $iface ok"
    # `ip -d -o` separates a link's detail lines with a backslash; one starts with the link's kind.
    if printf '%s\n' "$out" | tr '\\' '\n' | awk '{ print $1 }' | grep -qx -e bond -e team; then
        queues=$(ip -o link show master "$iface" 2>/dev/null | awk -F': ' '{ sub(/@.*/, "", $2); print $2 }' | sort)
        if [ -z "$queues" ]; then
            echo "link_error $iface is a bond or team without members: its traffic has no queue to manage"
            continue
        fi
    else
        queues=$iface
    fi
    echo "queues $iface $(printf '%s\n' $queues | tr '\n' ' ' | sed 's/ $//')"
    for dev in $queues; do
        echo "root_qdisc $dev $(tc qdisc show dev "$dev" root 2>/dev/null | head -n 1)"
        echo "speed $dev $(device_speed "$dev")"
    done
done

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
