"""fracgpu's admission side: request language, canonical form, mutation, server, CLI.

The other packages (quota, deviceplugin, certs) import this one; it imports none of them at
module level, except the node contract (paths the webhook protects) from ``deviceplugin``.
"""
