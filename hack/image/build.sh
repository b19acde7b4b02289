#!/usr/bin/env bash
# Build fracgpu's one image from the repository's own Dockerfile, on a machine that reaches only
# the package registries (Debian's archive and PyPI): no registry, no Docker engine.
#
#   hack/image/build.sh            # or: make image
#
# 1. The base: Debian 12 (bookworm) with python3 and python3-venv, made by mmdebstrap from the
#    machine's own apt sources (the same Debian the official python:3.11-slim-bookworm is made of,
#    with Debian's Python 3.11 in place of a compiled one), imported into buildah's store.
# 2. The Dockerfile, built by buildah on that base (PYTHON_IMAGE), exactly as `docker build`
#    builds it on the official one: the hook compiled by the distribution's gcc, the Python
#    dependencies from PyPI under constraints.txt.
# 3. The result written as an OCI archive, $IMAGE_ARCHIVE, which the project's cluster imports
#    into its containerd (hack/cluster/up.sh); `skopeo copy oci-archive:...` pushes it elsewhere.
#
# Everything lives under FRACGPU_CLUSTER_CACHE (<repo>/.build/image): the base's root filesystem
# (rebuilt when its package list changes), buildah's store (its layer cache makes a rebuild with
# unchanged sources take seconds). Root is needed (mmdebstrap's root mode, buildah's store).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
source "$HERE/../cluster/common.sh"
[[ $(id -u) == 0 ]] || die "make image builds a root file system and runs buildah as root"

# What the base holds: Python and its venv module; CA certificates for pip.
SUITE=bookworm
PACKAGES=python3,python3-venv,ca-certificates
W="$C/image"
BUILDAH=(buildah --root "$W/storage" --runroot "$W/run" --storage-driver overlay)

debs=()
command -v mmdebstrap >/dev/null || debs+=(mmdebstrap)
command -v buildah >/dev/null || debs+=(buildah)
if ((${#debs[@]})); then
    command -v apt-get >/dev/null || die "install these Debian packages first: ${debs[*]}"
    log "installing from Debian: ${debs[*]}"
    (apt-get install -y -q "${debs[@]}" >/dev/null 2>&1 ||
        { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "${debs[@]}" >/dev/null; }) ||
        die "apt-get install ${debs[*]} failed"
fi
mkdir -p "$W" "$IMAGES"
T0=$SECONDS

# --- 1. the base -------------------------------------------------------------------------------
# The machine's own apt sources (a deb822 .sources file or a .list), so the base comes from the
# same mirrors, and the same signing keys check it.
sources=""
for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
    [[ -s $f ]] && { sources=$f; break; }
done
[[ -n $sources ]] || die "no apt sources found (/etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list)"
stamp=$(printf '%s\n' "$SUITE" "$PACKAGES" "$(cat "$sources")" | sha256sum | cut -c1-16)
base_tar="$W/base-$SUITE-$stamp.tar"
if [[ ! -s $base_tar ]]; then
    log "making the base root file system (Debian $SUITE: $PACKAGES)"
    rm -f "$W"/base-*.tar
    # SOURCE_DATE_EPOCH: file dates fixed, so the same packages give the same layer.
    SOURCE_DATE_EPOCH=0 mmdebstrap --mode=root --variant=minbase --include="$PACKAGES" \
        --aptopt='Acquire::Retries "3"' \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
        "$SUITE" "$base_tar.part" "$sources" >"$W/mmdebstrap.log" 2>&1 ||
        { tail -20 "$W/mmdebstrap.log" >&2; die "mmdebstrap failed (log: $W/mmdebstrap.log)"; }
    mv "$base_tar.part" "$base_tar"
fi
if [[ $("${BUILDAH[@]}" inspect --type image --format '{{index .ImageAnnotations "fracgpu.io/base"}}' "$BASE_IMAGE" 2>/dev/null) != "$stamp" ]]; then
    log "importing the base as $BASE_IMAGE"
    ctr=$("${BUILDAH[@]}" from scratch)
    "${BUILDAH[@]}" add "$ctr" "$base_tar" / >/dev/null
    "${BUILDAH[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --cmd python3 --annotation "fracgpu.io/base=$stamp" "$ctr"
    "${BUILDAH[@]}" commit -q --rm "$ctr" "$BASE_IMAGE" >/dev/null
fi

# --- 2. the Dockerfile -------------------------------------------------------------------------
# A TLS-intercepting proxy between this machine and PyPI is trusted by this machine's CA bundle,
# not by the base's: pip in the build gets that bundle as a secret (it is not kept in the image).
ca=${PIP_CERT:-${REQUESTS_CA_BUNDLE:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}}
secret=()
[[ -s $ca ]] && secret=(--secret "id=pip-ca,src=$ca")
log "building $FRACGPU_IMAGE from the Dockerfile on $BASE_IMAGE"
"${BUILDAH[@]}" build --isolation chroot --network host --layers "${secret[@]}" \
    --build-arg "PYTHON_IMAGE=$BASE_IMAGE" -t "$FRACGPU_IMAGE" -f "$ROOT/Dockerfile" "$ROOT" \
    >"$W/build.log" 2>&1 || { tail -30 "$W/build.log" >&2; die "buildah build failed (log: $W/build.log)"; }

# --- 3. the archive ----------------------------------------------------------------------------
rm -f "$IMAGE_ARCHIVE.part"
"${BUILDAH[@]}" push -q "$FRACGPU_IMAGE" "oci-archive:$IMAGE_ARCHIVE.part:$FRACGPU_IMAGE" >/dev/null
mv "$IMAGE_ARCHIVE.part" "$IMAGE_ARCHIVE"
# Layers leave only the final stage's: the build stages (compiler, pip) are dropped from the store.
"${BUILDAH[@]}" rm --all >/dev/null 2>&1 || true
size=$("${BUILDAH[@]}" images --format '{{.Size}}' "$FRACGPU_IMAGE" | head -1)
log "done in $((SECONDS - T0)) s: $FRACGPU_IMAGE ($size unpacked) in $IMAGE_ARCHIVE ($(du -h "$IMAGE_ARCHIVE" | cut -f1) archived)"
