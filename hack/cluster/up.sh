#!/usr/bin/env bash
# Start the project's one-node cluster on loopback, as root: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, containerd 2.x (CDI on) and a kubelet whose node is
# named 127.0.0.1. Everything it runs was built by build.sh; everything it writes is under
# FRACGPU_CLUSTER_STATE; every host setting it changes is saved for down.sh to put back.
#
#   hack/cluster/up.sh        (KUBE_VERSION=1.36|1.37)
#   export KUBECONFIG=/var/lib/fracgpu-cluster/kubeconfig
#
# Exits non-zero with an "ERROR:" line (and the failing component's last log lines) when something
# does not come up; then run down.sh.
set -euo pipefail
source "$(cd "$(dirname "$0")" && pwd)/common.sh"
need_root up.sh
need_version
T0=$(date +%s%N)

if [[ -d $PIDS ]] && compgen -G "$PIDS/*.pid" >/dev/null; then
    running=$(cat "$R/version" 2>/dev/null || echo unknown)
    if [[ $running == "$KUBE_PATCH" ]] && alive kubelet >/dev/null && alive kube-apiserver >/dev/null &&
        kubectl_ get --raw /readyz >/dev/null 2>&1; then
        log "already running (Kubernetes v$running); kubeconfig: $KUBECONFIG_OUT"
        exit 0
    fi
    die "a cluster (Kubernetes v$running) is already started under $R; run hack/cluster/down.sh first"
fi
for b in kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl kube-proxy; do
    [[ -x $KUBE_BIN/$b ]] || die "$KUBE_BIN/$b is missing: run 'make cluster KUBE_VERSION=$KUBE_MINOR'"
done
for b in etcd containerd containerd-shim-runc-v2 ctr; do
    [[ -x $TOOLS_BIN/$b ]] || die "$TOOLS_BIN/$b is missing: run 'make cluster'"
done
[[ -f $IMAGES/pause.tar && -f $IMAGES/busybox.tar ]] || die "images missing in $IMAGES: run 'make cluster'"
for t in runc openssl curl ip ss; do command -v $t >/dev/null || die "$t is missing: run 'make cluster'"; done
[[ -x /usr/lib/cni/bridge ]] || die "the CNI plugins are missing in /usr/lib/cni: run 'make cluster'"
((${#CONTAINERD_SOCKET} + 8 < 108)) || die "FRACGPU_CLUSTER_STATE=$R is too long for unix socket paths"
if [[ -S $DEVICE_PLUGIN_DIR/kubelet.sock ]] && ss -Hxl 2>/dev/null | grep -qF "$DEVICE_PLUGIN_DIR/kubelet.sock"; then
    die "another kubelet listens on $DEVICE_PLUGIN_DIR/kubelet.sock: one kubelet per machine can own it"
fi
for p in "$CLUSTER_APISERVER_PORT" "$CLUSTER_ETCD_PORT" "$CLUSTER_ETCD_PEER_PORT" "$CLUSTER_KCM_PORT" \
    "$CLUSTER_SCHEDULER_PORT" "$CLUSTER_KUBELET_PORT" "$CLUSTER_KUBELET_HEALTHZ_PORT" \
    "$CLUSTER_KUBE_PROXY_HEALTHZ_PORT" "$CLUSTER_KUBE_PROXY_METRICS_PORT"; do
    ss -Hltn "sport = :$p" 2>/dev/null | grep -q . && die "port $p is in use: $(ss -Hltnp "sport = :$p" | head -1)"
done
if [[ -d $R ]]; then
    findmnt -rn -o TARGET | grep -q "^$R/" && die "mounts are left under $R: run hack/cluster/down.sh"
    rm -rf --one-file-system "$R"
fi
mkdir -p "$PIDS" "$LOGS" "$PKI" "$R/etcd" "$CDI_DIR" "$NODE_DIR"
chmod 700 "$R" "$PKI"
echo "$KUBE_PATCH" >"$R/version"
ln -s "$KUBE_BIN/kubectl" "$R/kubectl"

fail() {
    echo "----- last lines of $LOGS/$1.log -----" >&2
    tail -n 25 "$LOGS/$1.log" >&2 2>/dev/null || true
    echo "-----" >&2
    shift
    die "$* (the cluster is partly started: run hack/cluster/down.sh)"
}

# launch NAME CMD...: a daemon in a session of its own, logging to LOGS/NAME.log, recorded by pid and
# start time.
launch() {
    local name=$1 pid start=""
    shift
    setsid "$@" </dev/null >"$LOGS/$name.log" 2>&1 &
    pid=$!
    for _ in $(seq 20); do
        start=$(proc_start "$pid") && [[ -n $start ]] && break
        sleep 0.05
    done
    [[ -n $start ]] || fail "$name" "$name exited at once"
    echo "$pid $start $1" >"$PIDS/$name.pid"
}

# wait_for NAME SECONDS CMD...: until CMD succeeds; fails early when NAME's process is gone.
wait_for() {
    local name=$1 end=$(($(date +%s) + $2))
    shift 2
    until "$@" >/dev/null 2>&1; do
        alive "$name" >/dev/null || fail "$name" "$name exited while starting"
        (($(date +%s) < end)) || fail "$name" "$name not ready in time (waited for: $*)"
        sleep 0.2
    done
}

# --- certificates: one CA; a client certificate per component; kubelet's serving certificate ---
(
    cd "$PKI"
    key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1.key" 2>/dev/null; }
    ca() {
        key "$1"
        openssl req -x509 -new -key "$1.key" -subj "/CN=$2" -days 3650 -out "$1.crt" \
            -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
    }
    # cert NAME SUBJECT USAGE [SAN] [CA]
    cert() {
        local signer=${5:-ca}
        key "$1"
        openssl req -new -key "$1.key" -subj "$2" -out "$1.csr" 2>/dev/null
        {
            echo "basicConstraints=CA:FALSE"
            echo "keyUsage=critical,digitalSignature,keyEncipherment"
            echo "extendedKeyUsage=$3"
            [[ -n ${4:-} ]] && echo "subjectAltName=$4"
        } >"$1.ext"
        openssl x509 -req -in "$1.csr" -CA "$signer.crt" -CAkey "$signer.key" -days 365 \
            -set_serial "0x$(openssl rand -hex 12)" -extfile "$1.ext" -out "$1.crt" 2>/dev/null
        rm -f "$1.csr" "$1.ext"
    }
    ca ca fracgpu-cluster-ca
    ca front-proxy-ca fracgpu-cluster-front-proxy-ca
    cert apiserver /CN=kube-apiserver serverAuth \
        "IP:127.0.0.1,IP:$BRIDGE_IP,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
    cert admin /O=system:masters/CN=fracgpu-cluster-admin clientAuth
    cert kcm /CN=system:kube-controller-manager clientAuth
    cert scheduler /CN=system:kube-scheduler clientAuth
    cert kube-proxy /CN=system:kube-proxy clientAuth
    cert apiserver-kubelet-client /O=system:masters/CN=kube-apiserver-kubelet-client clientAuth
    cert kubelet "/O=system:nodes/CN=system:node:$NODE_NAME" clientAuth
    cert kubelet-serving "/O=system:nodes/CN=system:node:$NODE_NAME" serverAuth "IP:127.0.0.1,DNS:localhost"
    cert front-proxy-client /CN=front-proxy-client clientAuth "" front-proxy-ca
    openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out sa.key 2>/dev/null
    openssl pkey -in sa.key -pubout -out sa.pub 2>/dev/null
    chmod 600 ./*.key
)

# kubeconfig FILE USER NAME: the admin's carries its data (it is copied around), the others name files.
kubeconfig() {
    if [[ $2 == embed ]]; then
        cat >"$1" <<EOK
apiVersion: v1
kind: Config
clusters:
- name: fracgpu
  cluster: {server: "$APISERVER_URL", certificate-authority-data: $(base64 -w0 "$PKI/ca.crt")}
users:
- name: $3
  user: {client-certificate-data: $(base64 -w0 "$PKI/$3.crt"), client-key-data: $(base64 -w0 "$PKI/$3.key")}
contexts:
- name: fracgpu
  context: {cluster: fracgpu, user: $3}
current-context: fracgpu
EOK
    else
        cat >"$1" <<EOK
apiVersion: v1
kind: Config
clusters:
- name: fracgpu
  cluster: {server: "$APISERVER_URL", certificate-authority: "$PKI/ca.crt"}
users:
- name: $3
  user: {client-certificate: "$PKI/$3.crt", client-key: "$PKI/$3.key"}
contexts:
- name: fracgpu
  context: {cluster: fracgpu, user: $3}
current-context: fracgpu
EOK
    fi
    chmod 600 "$1"
}
for c in kcm scheduler kubelet kube-proxy; do kubeconfig "$PKI/$c.kubeconfig" files "$c"; done
kubeconfig "$KUBECONFIG_OUT" embed admin

# --- host settings: saved first (kubelet, kube-proxy and the bridge plugin change these) ---
for k in vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops \
    kernel/keys/root_maxkeys kernel/keys/root_maxbytes net/ipv4/ip_forward \
    net/ipv4/conf/all/route_localnet net/bridge/bridge-nf-call-iptables; do
    [[ -r /proc/sys/$k ]] && echo "$k $(cat "/proc/sys/$k")"
done >"$R/sysctl.orig"
# The pods' bridge, with the address the API server listens on: made here, before the API server
# starts (the bridge plugin takes it as it finds it). down.sh deletes it.
ip link show "$BRIDGE" >/dev/null 2>&1 && die "bridge $BRIDGE exists already: run hack/cluster/down.sh"
ip link add "$BRIDGE" type bridge
ip addr add "$BRIDGE_IP/${POD_CIDR#*/}" dev "$BRIDGE"
ip link set "$BRIDGE" up

# --- etcd, kube-apiserver ---
launch etcd "$TOOLS_BIN/etcd" --name fracgpu --data-dir "$R/etcd" \
    --listen-client-urls "http://127.0.0.1:$CLUSTER_ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$CLUSTER_ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$CLUSTER_ETCD_PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$CLUSTER_ETCD_PEER_PORT" \
    --initial-cluster "fracgpu=http://127.0.0.1:$CLUSTER_ETCD_PEER_PORT" --initial-cluster-state new \
    --unsafe-no-fsync --log-level warn
wait_for etcd 30 curl -fsS "http://127.0.0.1:$CLUSTER_ETCD_PORT/health"

launch kube-apiserver "$KUBE_BIN/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$CLUSTER_ETCD_PORT" \
    --bind-address "$BRIDGE_IP" --advertise-address "$BRIDGE_IP" --secure-port "$CLUSTER_APISERVER_PORT" \
    --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" --client-ca-file "$PKI/ca.crt" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
    --service-cluster-ip-range "$SERVICE_CIDR" --authorization-mode Node,RBAC \
    --enable-admission-plugins NamespaceLifecycle,LimitRanger,ServiceAccount,DefaultTolerationSeconds,NodeRestriction,MutatingAdmissionWebhook,ValidatingAdmissionWebhook,ValidatingAdmissionPolicy,ResourceQuota \
    --kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt" --kubelet-client-key "$PKI/apiserver-kubelet-client.key" \
    --kubelet-certificate-authority "$PKI/ca.crt" --kubelet-preferred-address-types InternalIP,Hostname \
    --requestheader-client-ca-file "$PKI/front-proxy-ca.crt" --requestheader-allowed-names front-proxy-client \
    --requestheader-username-headers X-Remote-User --requestheader-group-headers X-Remote-Group \
    --requestheader-extra-headers-prefix X-Remote-Extra- \
    --proxy-client-cert-file "$PKI/front-proxy-client.crt" --proxy-client-key-file "$PKI/front-proxy-client.key" \
    --allow-privileged=true --profiling=false --v 1
wait_for kube-apiserver 120 curl -fsS --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" "$APISERVER_URL/readyz"

# --- kube-controller-manager, kube-scheduler ---
launch kube-controller-manager "$KUBE_BIN/kube-controller-manager" --kubeconfig "$PKI/kcm.kubeconfig" \
    --authentication-kubeconfig "$PKI/kcm.kubeconfig" --authorization-kubeconfig "$PKI/kcm.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$CLUSTER_KCM_PORT" \
    --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" --use-service-account-credentials \
    --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
    --service-cluster-ip-range "$SERVICE_CIDR" --leader-elect=false --profiling=false --v 1
launch kube-scheduler "$KUBE_BIN/kube-scheduler" --kubeconfig "$PKI/scheduler.kubeconfig" \
    --authentication-kubeconfig "$PKI/scheduler.kubeconfig" --authorization-kubeconfig "$PKI/scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$CLUSTER_SCHEDULER_PORT" --leader-elect=false --profiling=false --v 1

# --- containerd ---
[[ -d /var/lib/kubelet ]] || touch "$R/made-var-lib-kubelet"
mkdir -p "$DEVICE_PLUGIN_DIR" "$R/containerd" "$R/cni/net.d" "$R/cni/ipam" "$R/pod-logs" "$KUBELET_ROOT"
cat >"$R/containerd/config.toml" <<EOC
version = 3
root = "$R/containerd/root"
state = "$R/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.erofs",
                    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing",
                    "io.containerd.nri.v1.nri"]
[grpc]
  address = "$CONTAINERD_SOCKET"
[ttrpc]
  address = "$CONTAINERD_SOCKET.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "$R/containerd/opt"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "$PAUSE_IMAGE"
[plugins."io.containerd.cri.v1.runtime"]
  enable_cdi = true
  cdi_spec_dirs = ["$CDI_DIR"]
  # raising oom_score_adj is refused where this runs as root in a sandbox
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "$R/cni/net.d"
EOC
# Pods reach each other, the host's bridge address (the API server) and Service addresses (through
# the bridge, where kube-proxy's rules turn them into endpoints), nothing else: no default route.
cat >"$R/cni/net.d/10-fracgpu.conflist" <<EOC
{"cniVersion": "1.0.0", "name": "fracgpu", "plugins": [
  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$BRIDGE_IP"}]],
            "routes": [{"dst": "$SERVICE_CIDR"}], "dataDir": "$R/cni/ipam"}},
  {"type": "loopback"}]}
EOC
# containerd finds its shim on PATH; runc is Debian's
launch containerd env PATH="$TOOLS_BIN:$PATH" "$TOOLS_BIN/containerd" --config "$R/containerd/config.toml"
wait_for containerd 30 ctr_ version
# fracgpu's own image where `make image` built it, and this version's kube-scheduler image.
for tar in "$IMAGES/pause.tar" "$IMAGES/busybox.tar" "$IMAGES/kube-scheduler-v$KUBE_PATCH.tar" "$IMAGE_ARCHIVE"; do
    [[ -f $tar ]] || continue
    ctr_ images import "$tar" >>"$LOGS/images.log" 2>&1 || fail containerd "importing $tar failed"
done
for alias in "${PAUSE_ALIASES[@]}"; do ctr_ images tag --force "$PAUSE_IMAGE" "$alias" >>"$LOGS/images.log" 2>&1; done

# --- kubelet ---
cat >"$R/kubelet.yaml" <<EOC
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: $CLUSTER_KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $CLUSTER_KUBELET_HEALTHZ_PORT
tlsCertFile: $PKI/kubelet-serving.crt
tlsPrivateKeyFile: $PKI/kubelet-serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix://$CONTAINERD_SOCKET
imageServiceEndpoint: unix://$CONTAINERD_SOCKET
cgroupDriver: cgroupfs
# kubelet refuses cgroup v1 hosts unless told otherwise
failCgroupV1: false
failSwapOn: false
podLogsDir: $R/pod-logs
# no registry could bring a collected image back
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", nodefs.inodesFree: "1%", imagefs.available: "1%"}
serializeImagePulls: false
EOC
wait_for kube-controller-manager 60 kubectl_ -n default get serviceaccount default
launch kubelet "$KUBE_BIN/kubelet" --config "$R/kubelet.yaml" --kubeconfig "$PKI/kubelet.kubeconfig" \
    --root-dir "$KUBELET_ROOT" --hostname-override "$NODE_NAME" --v 1
wait_for kubelet 90 kubectl_ wait --for=condition=Ready "node/$NODE_NAME" --timeout=2s
wait_for kubelet 30 test -S "$DEVICE_PLUGIN_DIR/kubelet.sock"
wait_for kubelet 30 test -S "$KUBELET_ROOT/pod-resources/kubelet.sock"
wait_for kube-scheduler 30 curl -fsSk "https://127.0.0.1:$CLUSTER_SCHEDULER_PORT/healthz"

# --- kube-proxy: Service addresses to endpoints (the API server reaching a webhook's Service, a
# pod reaching the API server through the kubernetes Service), iptables mode. masqueradeAll:
# pods on one bridge reaching each other through a Service answer through the host, which can
# then undo the translation (no br_netfilter needed). Conntrack limits are left as they are.
cat >"$R/kube-proxy.yaml" <<EOC
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: "$PKI/kube-proxy.kubeconfig"}
mode: iptables
hostnameOverride: "$NODE_NAME"
clusterCIDR: "$POD_CIDR"
bindAddress: 127.0.0.1
healthzBindAddress: "127.0.0.1:$CLUSTER_KUBE_PROXY_HEALTHZ_PORT"
metricsBindAddress: "127.0.0.1:$CLUSTER_KUBE_PROXY_METRICS_PORT"
nodePortAddresses: ["$BRIDGE_IP/32"]
iptables: {masqueradeAll: true}
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOC
launch kube-proxy "$KUBE_BIN/kube-proxy" --config "$R/kube-proxy.yaml" --v 1
wait_for kube-proxy 30 curl -fsS "http://127.0.0.1:$CLUSTER_KUBE_PROXY_HEALTHZ_PORT/healthz"

ms=$((($(date +%s%N) - T0) / 1000000))
# What the e2e suite needs to serve this node (docs/e2e.md); e2e.sh reads it too. The node
# variables are left to the caller: FRACGPU_E2E_NODE or FRACGPU_E2E_DRA_NODE, never both.
cat >"$R/e2e.env" <<EOE
export PATH="$KUBE_BIN:\$PATH"
export FRACGPU_E2E_KUBECONFIG="$KUBECONFIG_OUT"
export FRACGPU_E2E_KUBELET_DIR="$KUBELET_ROOT"
export FRACGPU_E2E_DEVICE_PLUGIN_DIR="$DEVICE_PLUGIN_DIR"
export FRACGPU_E2E_NODE_DIR="$NODE_DIR"
export FRACGPU_E2E_CDI_DIR="$CDI_DIR"
export FRACGPU_E2E_IMAGE="\${FRACGPU_E2E_IMAGE:-$PAUSE_IMAGE}"
export FRACGPU_E2E_SHELL_IMAGE="\${FRACGPU_E2E_SHELL_IMAGE:-$BUSYBOX_IMAGE}"
export FRACGPU_E2E_RELEASE_IMAGE="\${FRACGPU_E2E_RELEASE_IMAGE:-$FRACGPU_IMAGE}"
export FRACGPU_E2E_SCHEDULER_IMAGE="\${FRACGPU_E2E_SCHEDULER_IMAGE:-$SCHEDULER_IMAGE_REPO:v$KUBE_PATCH}"
# then: FRACGPU_E2E_NODE=$NODE_NAME (device-plugin mode), FRACGPU_E2E_DRA_NODE=$NODE_NAME (DRA)
# or FRACGPU_E2E_RELEASE_NODE=$NODE_NAME (the Helm release, test_e2e_release.py)
EOE

log "Kubernetes v$KUBE_PATCH up in $((ms / 1000)).$((ms % 1000 / 100)) s; node $NODE_NAME Ready"
cat <<EOM
  kubeconfig:      $KUBECONFIG_OUT   (export KUBECONFIG=$KUBECONFIG_OUT)
  kubectl:         $R/kubectl
  node:            $NODE_NAME, kubelet root $KUBELET_ROOT
  device plugins:  $DEVICE_PLUGIN_DIR (kubelet's fixed path)
  CDI specs:       $CDI_DIR
  node files:      $NODE_DIR
  images:          $PAUSE_IMAGE (also ${PAUSE_ALIASES[*]}), $BUSYBOX_IMAGE,
                   $SCHEDULER_IMAGE_REPO:v$KUBE_PATCH$([[ -f $IMAGE_ARCHIVE ]] && echo ", $FRACGPU_IMAGE")
  logs:            $LOGS/
  e2e settings:    source $R/e2e.env   (then FRACGPU_E2E_NODE or FRACGPU_E2E_DRA_NODE=$NODE_NAME)
  stop:            hack/cluster/down.sh
EOM
