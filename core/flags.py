"""Command-line pieces every fracgpu command shares: cluster access, logging, deferred commands.

Each flag is defined once here, so ``--kubeconfig`` means the same thing, with the same help and
the same resolution order (``core.kube.load_configuration``), in every subcommand.

Commands are *deferred*: a subcommand's parser names the module and function that run it, and
that module is imported only when the command runs. Building the parser then costs no import of
the Kubernetes client, gRPC or cryptography, so ``fracgpu review`` and ``--help`` start fast.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path

Command = Callable[[argparse.Namespace], int]
# A parser, or a group of one (argument groups and mutually exclusive groups share this base).
_ArgumentContainer = argparse._ActionsContainer


def add_kube_flags(parser: _ArgumentContainer, *, context: bool = True) -> None:
    """``--kubeconfig`` (and ``--context``): how to reach the cluster."""
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        help="kubeconfig file (default: in-cluster service account, then $KUBECONFIG, then "
        "~/.kube/config)",
    )
    if context:
        parser.add_argument("--context", help="kubeconfig context (default: the current one)")


def add_log_flags(parser: _ArgumentContainer) -> None:
    """``--log-level`` and ``--log-format``, read by :func:`core.log.configure`."""
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    parser.add_argument(
        "--log-format",
        choices=["json", "text"],
        help="json (default when stderr is not a terminal) or text",
    )


def deferred(module: str, function: str) -> Command:
    """A command that imports ``module`` only when it runs, then calls ``module.function``."""

    def run(args: argparse.Namespace) -> int:
        command: Command = getattr(importlib.import_module(module), function)
        return command(args)

    run.__qualname__ = f"deferred({module}.{function})"
    return run
