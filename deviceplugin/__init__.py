"""The node agents: the kubelet device plugin (``deviceplugin``: inventory, allocation, health,
the node guard) and the DRA kubelet plugin (``deviceplugin.dra``), which shares its NVML
inventory, health monitor and host files.

A component over ``core`` (see docs/architecture.md): it imports no other component.
"""
