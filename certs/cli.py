"""``fracgpu certs``: the command's flags. The commands themselves are :mod:`certs.commands`."""

from __future__ import annotations

import argparse
from pathlib import Path

from core.flags import add_kube_flags, deferred

COMMAND_HELP = """``fracgpu certs``: look at, issue, rotate and inject the webhook's certificates.

Works on the same store the server uses: a directory (standalone, the default), the Secret
(``--mode secret``, in-cluster or through ``--kubeconfig``) or the mounted files (``--mode
files``, read-only: cert-manager renews those). Settings come from ``--config`` (a YAML or JSON
file holding CertsConfig fields, at the top level or under ``certs:``) and flags override them.
"""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    certs = subparsers.add_parser(
        "certs",
        help="the webhook's certificates: show, issue, rotate, inject",
        description=COMMAND_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = certs.add_subparsers(dest="certs_command", required=True, metavar="COMMAND")

    show = commands.add_parser(
        "show",
        help="subjects, SANs, validity, fingerprints, and whether caBundle is current",
        description="Prints the certificates and what is due. Exit status 2 when something "
        "needs attention (expired, renewal overdue, caBundle stale), 1 on errors.",
    )
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.set_defaults(run=deferred("certs.commands", "_run_show"))

    issue = commands.add_parser(
        "issue", help="create the CA and serving certificate if absent (renew what is due)"
    )
    issue.set_defaults(run=deferred("certs.commands", "_run_issue"))

    rotate = commands.add_parser(
        "rotate",
        help="renew the serving certificate now (--ca: start a CA rotation)",
        description="Renews the serving certificate now. With --ca, issues a new CA and adds it "
        "to the caBundle next to the old one; running webhooks move the serving certificate "
        "to it after certs.ca_propagation. --immediate (with --ca) skips that overlap and "
        "trusts only the new CA at once: for a leaked CA key only, as API servers that have "
        "not yet seen the new caBundle fail their calls for a few seconds.",
    )
    rotate.add_argument("--ca", action="store_true", help="rotate the CA (with overlap)")
    rotate.add_argument(
        "--immediate", action="store_true", help="with --ca: no overlap (leaked CA key)"
    )
    rotate.set_defaults(run=deferred("certs.commands", "_run_rotate"))

    inject = commands.add_parser(
        "inject", help="write the CA bundle into the webhook configurations' caBundle now"
    )
    inject.set_defaults(run=deferred("certs.commands", "_run_inject"))

    for command in (show, issue, rotate, inject):
        _add_common(command)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="YAML/JSON with certs settings")
    parser.add_argument("--mode", choices=["directory", "secret", "files"])
    parser.add_argument("--directory", type=Path, help="directory mode: the store")
    parser.add_argument("--namespace", help="namespace of the Service and the Secret")
    parser.add_argument("--service", help="the webhook's Service name")
    parser.add_argument("--secret-name", help="secret mode: the Secret")
    add_kube_flags(parser)
    parser.add_argument(
        "--standalone",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="certificates for localhost/127.0.0.1 (what `fracgpu serve --standalone` uses); "
        "default: yes in directory mode",
    )
