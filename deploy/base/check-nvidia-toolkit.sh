#!/bin/sh
# Runs before the device plugin on every GPU node (init container check-nvidia-toolkit in
# device-plugin.yaml). The NVIDIA container toolkit must take a container's cards only from the
# device list the plugin mounts, never from NVIDIA_VISIBLE_DEVICES: admission denies that
# variable in a pod spec, but cannot see it arrive through envFrom (a ConfigMap or Secret whose
# content can change after the pod is admitted). So the node must run the toolkit with
#
#   accept-nvidia-visible-devices-envvar-when-unprivileged = false
#   accept-nvidia-visible-devices-as-volume-mounts = true
#
# (top-level keys of its config.toml; docs/install.md says how). Until it does, this check fails
# and the plugin does not start, so the node offers no fracgpu resources. REQUIRE=false makes
# it a warning only, for a trial on a cluster whose nodes you cannot change yet.
#
# POSIX sh and tr only: the keys are read from the top of the file, before the first [table],
# the way TOML scopes them; the last assignment wins, as in the toolkit.
set -eu

config="${TOOLKIT_CONFIG:-/etc/nvidia-container-runtime/config.toml}"
require="${REQUIRE:-true}"

fail() {
    echo "fracgpu: $1" >&2
    echo "fracgpu: set in $config (top level, before any [section]):" >&2
    echo "  accept-nvidia-visible-devices-envvar-when-unprivileged = false" >&2
    echo "  accept-nvidia-visible-devices-as-volume-mounts = true" >&2
    echo "fracgpu: then restart containerd (docs/install.md, 'Configure the NVIDIA container toolkit')" >&2
    if [ "$require" = "false" ]; then
        echo "fracgpu: REQUIRE=false: starting anyway; pods can reach every card through NVIDIA_VISIBLE_DEVICES set by envFrom" >&2
        exit 0
    fi
    exit 1
}

[ -r "$config" ] || fail "cannot read the NVIDIA container toolkit's configuration $config"

envvar="true" # the toolkit's defaults
mounts="false"
while IFS= read -r line || [ -n "$line" ]; do
    line="${line%%#*}"
    compact=$(printf '%s' "$line" | tr -d ' \t"')
    case "$compact" in
    \[*) break ;;
    accept-nvidia-visible-devices-envvar-when-unprivileged=*) envvar="${compact#*=}" ;;
    accept-nvidia-visible-devices-as-volume-mounts=*) mounts="${compact#*=}" ;;
    esac
done <"$config"

if [ "$envvar" != "false" ]; then
    fail "the NVIDIA container toolkit hands cards to any unprivileged container that sets NVIDIA_VISIBLE_DEVICES (accept-nvidia-visible-devices-envvar-when-unprivileged = $envvar)"
fi
if [ "$mounts" != "true" ]; then
    fail "the NVIDIA container toolkit ignores the device list the fracgpu device plugin mounts (accept-nvidia-visible-devices-as-volume-mounts = $mounts)"
fi
echo "fracgpu: $config takes cards only from the device plugin's device list"
