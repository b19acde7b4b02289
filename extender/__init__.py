"""fracgpu's kube-scheduler extender: device-plugin mode's card chosen at scheduling time.

See docs/design/extender-memo.md. ``wire`` (kube-scheduler's extender v1 JSON), ``view`` (each
node's cards and what is booked on them), ``verbs`` (filter and prioritize, pure), ``ledger``
(the per-node booking ledger, ``GPUNodeLedger``, written by compare-and-swap), ``binder``
(write-then-bind) and ``reclaim`` (bookings freed on authoritative evidence only).
"""
