"""The kubelet device plugin: inventory, allocation, health, and the node contract."""
