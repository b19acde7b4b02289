"""The mutating admission webhook: the request language and its dialects, what admission
changes in a pod, DRA mode's claim templates and waiting-pod explanations, which mode to admit
in, and the HTTPS server that answers kube-apiserver.

A component over ``core`` (see docs/architecture.md): it imports no other component. The quota
webhook (``quota``) and the certificates (``certs``) run in the same ``fracgpu serve`` process,
wired together by ``fracgpu/serve.py``.
"""
