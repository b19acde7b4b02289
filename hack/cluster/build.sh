#!/usr/bin/env bash
# Build what the project's one-node cluster runs, from Go modules through the module proxy only,
# at the versions hack/cluster/modules/*/go.{mod,sum} pin:
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kubectl  (KUBE_VERSION)
#   etcd 3.6; containerd 2.x with its runc shim and ctr                    (one build for all versions)
#   the pause and busybox images, from a few lines of C and Debian's busybox-static
# runc and the CNI plugins come from Debian (installed here when missing and run as root).
#
#   hack/cluster/build.sh            # KUBE_VERSION=1.37 by default; 1.36 also pinned
#
# Quick when nothing changed: Go's own caches decide what to rebuild.
set -euo pipefail
source "$(cd "$(dirname "$0")" && pwd)/common.sh"
need_version
[[ -n ${GO:-} ]] || die "no Go toolchain (go 1.26 or newer is needed)"
gov=$("$GO" env GOVERSION)
[[ $(printf '%s\n' go1.26 "$gov" | sort -V | head -1) == go1.26 ]] || die "$GO is $gov; go 1.26 or newer is needed"

# Debian's parts. A machine where they are installed already needs no root here.
debs=()
command -v runc >/dev/null || debs+=(runc)
[[ -x /usr/lib/cni/bridge && -x /usr/lib/cni/host-local && -x /usr/lib/cni/loopback ]] || debs+=(containernetworking-plugins)
# the image needs a busybox that loads no library
bb=$(LC_ALL=C ldd /bin/busybox 2>&1 || true)
[[ -x /bin/busybox && $bb == *"not a dynamic"* ]] || debs+=(busybox-static)
command -v cc >/dev/null || debs+=(gcc libc6-dev)
command -v ip >/dev/null && command -v ss >/dev/null || debs+=(iproute2)
command -v openssl >/dev/null || debs+=(openssl)
command -v curl >/dev/null || debs+=(curl)
if ((${#debs[@]})); then
    [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null || die "install these Debian packages first: ${debs[*]}"
    log "installing from Debian: ${debs[*]}"
    (apt-get install -y -q "${debs[@]}" >/dev/null 2>&1 ||
        { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "${debs[@]}" >/dev/null; }) ||
        die "apt-get install ${debs[*]} failed"
fi

# go_build MODULE_DIR OUT LDFLAGS TAGS BINARY...: every `tool` of that module into OUT, unless OUT
# holds the BINARYs from the same go.mod, go.sum, flags and Go already (go build relinks every
# time: a minute and more).
go_build() {
    local dir=$1 out=$2 ldflags=$3 tags=$4 t0=$SECONDS stamp want b have=1
    shift 4
    stamp="$out/.built-$(basename "$dir")"
    want=$(cat "$dir/go.mod" "$dir/go.sum" <(echo "$ldflags|$tags|$gov") | sha256sum | cut -c1-16)
    for b in "$@"; do [[ -x $out/$b ]] || have=0; done
    if ((have)) && [[ $(cat "$stamp" 2>/dev/null) == "$want" ]]; then
        log "up to date: $(basename "$dir") in $out"
        return
    fi
    mkdir -p "$out"
    (cd "$dir" && CGO_ENABLED=0 "$GO" build -mod=readonly -tags "$tags" -ldflags "$ldflags" -o "$out/" tool) ||
        die "go build in $dir failed (see the error above)"
    echo "$want" >"$stamp"
    log "built $(basename "$dir") in $((SECONDS - t0)) s"
}

T0=$SECONDS
v="v$KUBE_PATCH"
# Without these, the binaries report v0.0.0 and clients that check the version refuse them.
k8s_ld="-s -w -X k8s.io/component-base/version.gitVersion=$v -X k8s.io/component-base/version.gitMajor=${KUBE_PATCH%%.*}"
k8s_ld+=" -X k8s.io/component-base/version.gitMinor=$(cut -d. -f2 <<<"$KUBE_PATCH") -X k8s.io/component-base/version.gitTreeState=clean"
k8s_ld+=" -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"
go_build "$MODULES/k8s-$KUBE_MINOR" "$KUBE_BIN" "$k8s_ld" "" \
    kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl kube-proxy

etcd_v=$(mod_version "$MODULES/etcd/go.mod" go.etcd.io/etcd/server/v3)
# The server module's main package is named after its folder (server); its own folder, and a link
# by the name everyone uses.
go_build "$MODULES/etcd" "$TOOLS_BIN/etcd-server" "-s -w" "" server
ln -sfn etcd-server/server "$TOOLS_BIN/etcd"
ctd_v=$(mod_version "$MODULES/containerd/go.mod" github.com/containerd/containerd/v2)
go_build "$MODULES/containerd" "$TOOLS_BIN" \
    "-s -w -X github.com/containerd/containerd/v2/version.Version=$ctd_v" "no_btrfs no_devmapper no_zfs" \
    containerd containerd-shim-runc-v2 ctr

# Images: an OCI archive each, imported by up.sh (no registry is reachable).
mkdir -p "$IMAGES"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/pause" "$work/busybox/bin"
cc -static -Os -s -o "$work/pause/pause" "$HACK/images/pause.c"
python3 "$HACK/images/mkimage.py" --rootfs "$work/pause" --out "$IMAGES/pause.tar" \
    --name "$PAUSE_IMAGE" --entrypoint /pause
cp /bin/busybox "$work/busybox/bin/busybox"
for a in sh cat ls echo sleep env grep test true; do ln -s busybox "$work/busybox/bin/$a"; done
python3 "$HACK/images/mkimage.py" --rootfs "$work/busybox" --out "$IMAGES/busybox.tar" \
    --name "$BUSYBOX_IMAGE" --cmd sh
# kube-scheduler as an image too: the Helm chart's fracgpu-scheduler Deployment runs it in a pod,
# the same binary the cluster runs (the stock image's name is the user's choice in the chart).
mkdir -p "$work/kube-scheduler/usr/local/bin"
cp "$KUBE_BIN/kube-scheduler" "$work/kube-scheduler/usr/local/bin/kube-scheduler"
python3 "$HACK/images/mkimage.py" --rootfs "$work/kube-scheduler" --out "$IMAGES/kube-scheduler-$v.tar" \
    --name "$SCHEDULER_IMAGE_REPO:$v" --entrypoint /usr/local/bin/kube-scheduler
log "done in $((SECONDS - T0)) s: Kubernetes $v in $KUBE_BIN; etcd $etcd_v, containerd $ctd_v in $TOOLS_BIN"
