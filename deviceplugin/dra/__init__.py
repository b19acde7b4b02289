"""DRA mode's node agent (``fracgpu dra-plugin``): the kubelet DRA plugin and the node's
ResourceSlice."""
