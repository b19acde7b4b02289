"""The node agents, two siblings over one shared layer (see docs/architecture.md):

- ``deviceplugin.shared``: cards from NVML, their health, the hook's host files and limits files,
  versioned checkpoints, the node guard, the one event-loop thread for API calls;
- ``deviceplugin.classic``: the kubelet device plugin (``fracgpu device-plugin``);
- ``deviceplugin.dra``: the kubelet DRA plugin and the node's ResourceSlice
  (``fracgpu dra-plugin``).

A component over ``core``: it imports no other component, and neither agent imports the other.
"""
