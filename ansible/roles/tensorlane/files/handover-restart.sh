# The hand-over restart of the agent's systemd unit (the role's "Restart tensorlane" handler under systemd).
# Run as `sh -c "$(cat handover-restart.sh)" handover UNIT STOP_TIMEOUT_S`. `systemctl restart` would stop the
# agent with SIGTERM (KillSignal): it restores the original qdiscs and deletes its nftables table, and the new agent
# takes over again (no queueing about 0.3 s, flows unmarked until their shims register again). Instead: SIGUSR2 to
# the agent's main process, which exits leaving its trees, table, flow marks and records in place (a clean exit:
# Restart=on-failure does not start it again), then `systemctl restart`, which starts the new agent (it adopts them;
# docs/deploy.md#what-running-jobs-see). A unit that is not active is just restarted (started). An agent that does
# not catch SIGUSR2 (its SigCgt in /proc/PID/status: an agent from before the hand-over, 2026-11-28, or one still
# starting) would be killed by it, without its restore: it gets the old restart, `systemctl restart` (SIGTERM,
# restore, take over again). Prints "handed over" and/or "started" ("restarted with SIGTERM" for the old restart);
# exit 1 (the agent left running) if the agent has not exited STOP_TIMEOUT_S after SIGUSR2.
unit=$1
timeout=$2

# Returns 0 when process $1 catches SIGUSR2 (12 on Linux: bit 11 of the SigCgt mask), i.e. has the hand-over stop.
catches_usr2() {
    mask=$(sed -n 's/^SigCgt:[[:space:]]*//p' "/proc/$1/status" 2>/dev/null)
    case $mask in '' | *[!0-9a-fA-F]*) return 1 ;; esac
    [ $(((0x${mask#"${mask%????}"} >> 11) & 1)) -eq 1 ]
}

systemctl daemon-reload || exit 1
pid=$(systemctl show -p MainPID --value "$unit") || exit 1
if [ "${pid:-0}" -gt 0 ] && systemctl is-active --quiet "$unit"; then
    if ! catches_usr2 "$pid"; then
        echo "$unit: pid $pid does not catch SIGUSR2 (an agent from before the hand-over): restarting with" \
            "SIGTERM (it restores the host, the new agent takes over again)"
        systemctl restart "$unit" || exit 1
        echo "restarted with SIGTERM; started"
        exit 0
    fi
    # --kill-who: spelt --kill-whom since systemd 252, which still accepts the old spelling
    systemctl kill --kill-who=main --signal=SIGUSR2 "$unit" || exit 1
    waited=0
    while [ -e "/proc/$pid" ] && [ "$(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null)" != Z ]; do
        if [ "$waited" -ge $((timeout * 10)) ]; then
            echo "$unit: pid $pid still runs $timeout s after SIGUSR2 (hand-over); left running" \
                "(journalctl -u $unit)" >&2
            exit 1
        fi
        sleep 0.1
        waited=$((waited + 1))
    done
    echo "handed over (pid $pid)"
fi
systemctl restart "$unit" || exit 1
echo "started"
