#!/usr/bin/env bash
# Stop exactly what up.sh started, put back every host setting it changed, and remove its state.
#
#   hack/cluster/down.sh
#
# Only the processes recorded under FRACGPU_CLUSTER_STATE/pids are signalled (by pid and start time,
# so a reused pid is never hit), and the containerd shims whose command line names this cluster's
# own containerd socket. Pods are deleted through the API first, so kubelet tears their sandboxes
# down (network, mounts, cgroups) the way it does on a real node.
set -uo pipefail
source "$(cd "$(dirname "$0")" && pwd)/common.sh"
need_root down.sh
[[ -d $R ]] || { log "nothing to stop ($R does not exist)"; exit 0; }
T0=$SECONDS
K=("$R/kubectl" --kubeconfig "$KUBECONFIG_OUT" --request-timeout=10s)

shims() {
    local d
    for d in /proc/[0-9]*; do
        tr '\0' ' ' 2>/dev/null <"$d/cmdline" | grep -qF -- "-address $CONTAINERD_SOCKET " && echo "${d#/proc/}"
    done
}

# 1. Nothing creates or places pods any more; 2. kubelet takes every pod down.
stop kube-scheduler
stop kube-controller-manager
if alive kubelet >/dev/null && alive kube-apiserver >/dev/null; then
    if [[ -n $("${K[@]}" get pods -A -o name 2>/dev/null) ]]; then
        "${K[@]}" delete pods -A --all --force --grace-period=0 --wait=false >/dev/null 2>&1
        end=$((SECONDS + 45))
        while [[ -n $(ctr_ tasks ls -q 2>/dev/null) ]] && ((SECONDS < end)); do sleep 0.5; done
    fi
fi
# 3. kubelet, what tasks are left, containerd, its shims.
stop kubelet 30
rm -f "$DEVICE_PLUGIN_DIR/kubelet.sock" "$DEVICE_PLUGIN_DIR/kubelet_internal_checkpoint"
if alive containerd >/dev/null; then
    for t in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks kill -s SIGKILL "$t" >/dev/null 2>&1; done
    sleep 0.5
    for t in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks delete -f "$t" >/dev/null 2>&1; done
fi
stop containerd 30
for pid in $(shims); do kill -KILL "$pid" 2>/dev/null; done
end=$((SECONDS + 10))
while [[ -n $(shims) ]] && ((SECONDS < end)); do sleep 0.1; done
# 4. kube-proxy, then its rules (KUBE-* chains in iptables' nat and filter tables); the control plane.
stop kube-proxy 30
if [[ -x $KUBE_BIN/kube-proxy ]] && [[ -f $R/kube-proxy.yaml ]]; then
    "$KUBE_BIN/kube-proxy" --cleanup --config "$R/kube-proxy.yaml" >>"$LOGS/kube-proxy.log" 2>&1 ||
        log "kube-proxy --cleanup failed: see $LOGS/kube-proxy.log"
fi
stop kube-apiserver 30
stop etcd 30

# Whatever a stop above left (one that was skipped, or outlived its signals) gets one more.
left=()
for f in "$PIDS"/*.pid; do
    [[ -e $f ]] || continue
    n=$(basename "$f" .pid)
    pid=$(alive "$n") || continue
    log "$n (pid $pid) still running after the stops: $(describe "$pid")"
    stop "$n" 5 || left+=("$n:$pid")
done
left_shims=$(shims | tr '\n' ' ')

# 5. Host settings and files: mounts under the state folder, sysctls, the bridge, kubelet's links
# and empty pod cgroups.
for m in $(findmnt -rn -o TARGET | grep "^$R/" | sort -r); do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "could not unmount $m"
done
if [[ -f $R/sysctl.orig ]]; then
    while read -r k v; do echo "$v" >"/proc/sys/$k" 2>/dev/null || log "could not restore $k=$v"; done <"$R/sysctl.orig"
fi
ip link show "$BRIDGE" >/dev/null 2>&1 && ip link delete "$BRIDGE"
for l in /var/log/containers/*.log /var/log/pods/*; do
    [[ -L $l && $(readlink "$l") == "$R/"* ]] && rm -f "$l"
done
for h in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do
    [[ -d $h ]] && find "$h" -depth -type d -exec rmdir {} + 2>/dev/null
done
if [[ -f $R/made-var-lib-kubelet ]]; then
    rmdir "$DEVICE_PLUGIN_DIR" /var/lib/kubelet 2>/dev/null
fi

if ((${#left[@]})) || [[ -n ${left_shims// /} ]]; then
    die "still running: ${left[*]:-} ${left_shims:+shims: $left_shims}; state kept in $R"
fi
findmnt -rn -o TARGET | grep -q "^$R/" && die "mounts remain under $R; state kept"
rm -rf --one-file-system "$R"
log "stopped in $((SECONDS - T0)) s; $R removed, host settings restored"
