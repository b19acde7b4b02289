"""The kubelet device-plugin agent (``fracgpu device-plugin``): count resources, a per-card
ledger, placement at PreStartContainer, the Node's allocatable kept honest."""
