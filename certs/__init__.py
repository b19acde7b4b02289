"""The webhook's certificates: issue, store, inject, rotate, hot-reload."""
