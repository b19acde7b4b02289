"""The node layer both agents stand on: cards, health, the hook's files, checkpoints, the guard.

Nothing here knows which agent runs it; ``deviceplugin.classic`` and ``deviceplugin.dra`` import
this package and never each other (an import-linter contract in pyproject.toml).
"""
