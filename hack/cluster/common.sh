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
KUBELET_ROOT="$R/kubelet"
# kubelet's device plugin folder is a constant of kubelet's and does not follow --root-dir.
DEVICE_PLUGIN_DIR=/var/lib/kubelet/device-plugins
CONTAINERD_SOCKET="$R/containerd/containerd.sock"
CDI_DIR="$R/cdi"
NODE_DIR="$R/node"                      # fracgpu's host files (hook, limits, fake devices)
APISERVER_URL="https://127.0.0.1:$CLUSTER_APISERVER_PORT"

log() { printf '[cluster %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[cluster %s] ERROR: %s\n' "$(date +%H:%M:%S)" "$*" >&2; exit 1; }

need_root() { [[ $(id -u) == 0 ]] || die "$1 runs a kubelet and containerd and must run as root"; }

need_version() {
    [[ -n $KUBE_PATCH ]] || die "KUBE_VERSION=$KUBE_VERSION: no module pins it; known: $(cd "$MODULES" && ls -d k8s-* | sed 's/k8s-//' | tr '\n' ' ')"
}

# Field 22 of /proc/PID/stat, the start time in ticks since boot: a pid file holds "PID START", so a
# pid that was reused by another process is never signalled.
proc_start() { awk '{ sub(/^.*\) /, ""); print $20 }' "/proc/$1/stat" 2>/dev/null; }

# alive NAME -> prints the pid while the process recorded under NAME runs.
alive() {
    local f="$PIDS/$1.pid" pid start state
    [[ -f $f ]] || return 1
    read -r pid start _ <"$f" || return 1
    [[ -n ${pid:-} && -d /proc/$pid && "$(proc_start "$pid")" == "$start" ]] || return 1
    state=$(awk '{ sub(/^.*\) /, ""); print $1 }' "/proc/$pid/stat" 2>/dev/null)
    [[ $state != Z ]] || return 1
    echo "$pid"
}

kubectl_() { "$KUBE_BIN/kubectl" --kubeconfig "$KUBECONFIG_OUT" "$@"; }
ctr_() { "$TOOLS_BIN/ctr" --address "$CONTAINERD_SOCKET" --namespace k8s.io "$@"; }
