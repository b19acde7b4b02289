# shellcheck shell=bash disable=SC2034
# Settings and helpers shared by build.sh, up.sh, down.sh and e2e.sh (sourced, not run).
#
# Three places, each overridable:
#   FRACGPU_CLUSTER_CACHE  (<repo>/.build)          Go module and build caches, binaries, images:
#                                                    git-ignored, kept between runs so a rebuild is quick
#   FRACGPU_CLUSTER_STATE  (/var/lib/fracgpu-cluster) one running cluster: etcd data, certificates,
#                                                    containerd, kubelet, logs, pid files; removed by down.sh.
#                                                    Short on purpose: unix socket paths hold 107 bytes.
#   KUBE_VERSION           (1.37)                    the Kubernetes minor version; its patch release
#                                                    is the one hack/cluster/modules/k8s-<minor>/go.mod pins

HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HACK/../.." && pwd)"
: "${FRACGPU_CLUSTER_CACHE:=$ROOT/.build}"
: "${FRACGPU_CLUSTER_STATE:=/var/lib/fracgpu-cluster}"
: "${KUBE_VERSION:=1.37}"
KUBE_VERSION="${KUBE_VERSION#v}"
KUBE_MINOR="$(cut -d. -f1,2 <<<"$KUBE_VERSION")"
C="$FRACGPU_CLUSTER_CACHE"
R="$FRACGPU_CLUSTER_STATE"

# The Go toolchain: the machine's own (never an older one earlier on PATH, never a download).
for g in /usr/local/go/bin/go "$(command -v go 2>/dev/null)"; do
    [[ -x $g ]] && { GO="$g"; break; }
done
export GOTOOLCHAIN=local GOMODCACHE="$C/go/mod" GOCACHE="$C/go/cache" GOFLAGS="-trimpath -buildvcs=false"

MODULES="$HACK/modules"
TOOLS_BIN="$C/cluster/tools"            # etcd, containerd, its shim, ctr: one build for every version
IMAGES="$C/cluster/images"
PAUSE_IMAGE="localhost/fracgpu/pause:1.0"
BUSYBOX_IMAGE="localhost/fracgpu/busybox:1.0"
# fracgpu's own image (hack/image/build.sh, `make image`), tagged with the chart's appVersion, and
# the base it is built on (Debian's Python, made by mmdebstrap).
FRACGPU_VERSION="$(awk '$1 == "appVersion:" { gsub(/"/, "", $2); print $2 }' "$ROOT/deploy/helm/fracgpu/Chart.yaml")"
FRACGPU_IMAGE="localhost/fracgpu:$FRACGPU_VERSION"
BASE_IMAGE="localhost/fracgpu/python:3.11-bookworm"
IMAGE_ARCHIVE="$IMAGES/fracgpu.tar"
# kube-scheduler from this cluster's build, for the chart's scheduler Deployment (tagged v<patch>).
SCHEDULER_IMAGE_REPO="localhost/fracgpu/kube-scheduler"
# Names test suites use for the pause image; with no registry the local one stands in for them.
PAUSE_ALIASES=(registry.k8s.io/pause:3.10)

# mod_version GO.MOD MODULE -> the version that go.mod requires of MODULE ("" if none).
mod_version() {
    [[ -f $1 ]] && awk -v m="$2" '$1 == m { print $2; exit } $1 == "require" && $2 == m { print $3; exit }' "$1"
}
KUBE_PATCH="$(mod_version "$MODULES/k8s-$KUBE_MINOR/go.mod" k8s.io/kubernetes)"
KUBE_PATCH="${KUBE_PATCH#v}"
KUBE_BIN="$C/cluster/kubernetes-v$KUBE_PATCH"

PIDS="$R/pids"
LOGS="$R/logs"
PKI="$R/pki"
KUBECONFIG_OUT="$R/kubeconfig"
: "${CLUSTER_APISERVER_PORT:=6443}"
: "${CLUSTER_ETCD_PORT:=2379}"
: "${CLUSTER_ETCD_PEER_PORT:=2380}"
: "${CLUSTER_KCM_PORT:=10257}"
: "${CLUSTER_SCHEDULER_PORT:=10259}"
: "${CLUSTER_KUBELET_PORT:=10250}"
: "${CLUSTER_KUBELET_HEALTHZ_PORT:=10248}"
# kubelet refuses a loopback --node-ip, but takes a node *name* that is an IP as the node's
# InternalIP: the API server then reaches kubelet on 127.0.0.1 (logs, exec, port-forward).
NODE_NAME=127.0.0.1
SERVICE_CIDR=10.96.0.0/16
POD_CIDR=10.88.0.0/16
BRIDGE=fracgpucni0
# The bridge's own address, the pods' gateway. The API server listens there (and only there), so
# that pods reach it through the kubernetes Service as in any cluster: up.sh makes the bridge
# before the API server starts, and kube-proxy routes Service addresses to their endpoints.
BRIDGE_IP=10.88.0.1
CLUSTER_KUBE_PROXY_HEALTHZ_PORT=10256
CLUSTER_KUBE_PROXY_METRICS_PORT=10249
KUBELET_ROOT="$R/kubelet"
# kubelet's device plugin folder is a constant of kubelet's and does not follow --root-dir.
DEVICE_PLUGIN_DIR=/var/lib/kubelet/device-plugins
CONTAINERD_SOCKET="$R/containerd/containerd.sock"
CDI_DIR="$R/cdi"
NODE_DIR="$R/node"                      # fracgpu's host files (hook, limits, fake devices)
APISERVER_URL="https://$BRIDGE_IP:$CLUSTER_APISERVER_PORT"

log() { printf '[cluster %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[cluster %s] ERROR: %s\n' "$(date +%H:%M:%S)" "$*" >&2; exit 1; }

need_root() { [[ $(id -u) == 0 ]] || die "$1 runs a kubelet and containerd and must run as root"; }

need_version() {
    [[ -n $KUBE_PATCH ]] || die "KUBE_VERSION=$KUBE_VERSION: no module pins it; known: $(cd "$MODULES" && ls -d k8s-* | sed 's/k8s-//' | tr '\n' ' ')"
}

# stat_field LINE N -> field N (man 5 proc: 3 the state, 22 the start time) of a /proc/PID/stat line;
# the command name, field 2, may hold spaces and parentheses, so fields count from its last ") ".
stat_field() { awk -v n="$2" '{ sub(/^.*\) /, ""); print $(n - 2) }' <<<"$1"; }

# The start time in ticks since boot: a pid file holds "PID START", so a pid that was reused by
# another process is never signalled.
proc_start() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat_field "$stat" 22
}

# exited PID START: the process is gone, or only its parent's wait is left (a zombie whose threads
# have all ended). A zombie *leader* whose other threads still run, one blocked in the kernel say,
# reads Z too, yet still holds its files, sockets and mounts: it has not exited. A PID 1 may reap
# orphans late (1.5 s seen on a CI machine), so a zombie is ordinary at the end of a run.
exited() {
    local pid=$1 start=$2 stat threads
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 0
    [[ $(stat_field "$stat" 22) == "$start" ]] || return 0
    [[ $(stat_field "$stat" 3) == Z ]] || return 1
    threads=$(awk '$1 == "Threads:" { print $2 }' "/proc/$pid/status" 2>/dev/null)
    ((${threads:-0} <= 1))
}

# alive NAME -> prints the pid while the process recorded under NAME has not exited.
alive() {
    local f="$PIDS/$1.pid" pid="" start=""
    [[ -f $f ]] || return 1
    read -r pid start _ <"$f" || true
    [[ -n $pid && -n $start ]] || return 1
    exited "$pid" "$start" && return 1
    echo "$pid"
}

# describe PID -> each thread's state and where in the kernel it waits, for an error message.
describe() {
    local t stat out=""
    for t in /proc/"$1"/task/*; do
        stat=$(cat "$t/stat" 2>/dev/null) || continue
        out+="${t##*/}:$(stat_field "$stat" 3)/$(cat "$t/wchan" 2>/dev/null) "
    done
    echo "threads ${out:-none}"
}

# ends_within NAME SECONDS: succeeds once the process recorded under NAME has exited.
ends_within() {
    local end=$((SECONDS + $2))
    while alive "$1" >/dev/null; do
        ((SECONDS < end)) || return 1
        sleep 0.1
    done
}

# stop NAME [SECONDS]: SIGTERM, SIGKILL after SECONDS, then up to 10 s for the whole process (every
# thread) to end. Fails, naming what each thread waits on, when it has not.
stop() {
    local name=$1 secs=${2:-20} pid
    pid=$(alive "$name") || return 0
    kill -TERM "$pid" 2>/dev/null
    ends_within "$name" "$secs" && return 0
    log "$name (pid $pid) still running ${secs} s after SIGTERM: SIGKILL"
    kill -KILL "$pid" 2>/dev/null
    ends_within "$name" 10 && return 0
    log "$name (pid $pid) still there 10 s after SIGKILL: $(describe "$pid")"
    return 1
}

kubectl_() { "$KUBE_BIN/kubectl" --kubeconfig "$KUBECONFIG_OUT" "$@"; }
ctr_() { "$TOOLS_BIN/ctr" --address "$CONTAINERD_SOCKET" --namespace k8s.io "$@"; }
