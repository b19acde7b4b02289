"""``fracgpu quota``: the command's flags. The command itself is :mod:`quota.report`."""

from __future__ import annotations

import argparse

from core.flags import add_kube_flags, deferred


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "quota",
        help="show GPU quotas: cards and MiB used/limit, and the pods that use them",
        description="The GPUQuotas of a namespace (or all) with used/limit and their pods. "
        '"used" is what the quota charges now: pods counted by the controller plus pending '
        "reservations of admitted pods not yet counted.",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", help="namespace (default: default)")
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="quotas of every namespace"
    )
    source = parser.add_mutually_exclusive_group()
    add_kube_flags(source, context=False)
    source.add_argument("--file", help="read GPUQuotas from this YAML file instead of a cluster")
    parser.add_argument("--context", help="kubeconfig context (default: the current one)")
    parser.add_argument("--no-pods", action="store_true", help="do not list the pods")
    parser.add_argument("-o", "--output", choices=["text", "json", "yaml"], default="text")
    parser.set_defaults(run=deferred("quota.report", "run"))
