"""The ``fracgpu`` command (also installed as ``kubectl-fracgpu`` for ``kubectl fracgpu``).

A composition root: it wires the components' subcommands together and is the only module,
besides ``fracgpu.serve`` and ``fracgpu.review``, that imports more than one component. Each
component contributes an ``add_parser`` that only defines flags; the command itself is imported
when it runs (``core.flags.deferred``), so building the parser loads neither the Kubernetes
client, gRPC nor cryptography, and ``fracgpu review`` starts fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from certs.cli import add_parser as add_certs_parser
from core import log
from core.flags import add_kube_flags, add_log_flags, deferred
from deviceplugin.classic.cli import add_parser as add_deviceplugin_parser
from deviceplugin.dra.cli import add_parser as add_dra_parser
from fracgpu.review import (
    ManifestError,
    apply_quota,
    read_manifests,
    render_json,
    render_text,
    review_object,
)
from quota.cli import add_parser as add_quota_parser
from webhook.config import (
    AdmissionConfig,
    ConfigError,
    describe,
    load_yaml,
    placement_problem,
)
from webhook.dialects import OPTIONAL_DIALECTS, Dialect
from webhook.inventory import Inventory
from webhook.mutation import Mutator


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fracgpu",
        description="Fractional GPUs for Kubernetes: admission webhook, quota, device plugin.",
    )
    add_log_flags(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_review(sub)
    _add_mode(sub)
    _add_why(sub)
    _add_top(sub)
    _add_fit(sub)
    # In the order `fracgpu --help` lists them.
    add_quota_parser(sub)
    add_certs_parser(sub)
    add_deviceplugin_parser(sub)
    add_dra_parser(sub)
    _add_node_cleanup(sub)
    return parser


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the admission webhook (mutation and quota) over HTTPS",
        description="Run the admission webhook. With --standalone it needs no cluster: it "
        "issues itself a certificate for localhost and uses the static GPU inventory.",
    )
    p.add_argument("--config", type=Path, help="YAML configuration (docs/operator-guide.md)")
    p.add_argument("--standalone", action="store_true", help="no cluster: local certs, no watches")
    p.add_argument("--host", help="listen address (default 0.0.0.0, or 127.0.0.1 standalone)")
    p.add_argument("--port", type=int, help="listen port (default 8443)")
    add_kube_flags(p)
    _add_admission_flags(p)
    p.set_defaults(run=_run_serve)


def _add_mode(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "mode",
        help="which mode to install fracgpu in on this cluster, and which one it admits in",
        description="Ask the API server: DRA mode is the default where Kubernetes is 1.36 or "
        "later and serves resource.k8s.io/v1, device-plugin mode elsewhere. Also says which "
        "mode `fracgpu serve` admits pods in (admission.allocation: auto) and why.",
    )
    add_kube_flags(p)
    p.set_defaults(run=_run_mode)


def _add_why(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "why",
        help="why a GPU pod is not running, in cards and MiB",
        description="Why a fracgpu pod waits (no card can host its share now, and the largest "
        "free share; another scheduling reason; containers starting) or that it runs, with its "
        "recent warnings. Exit status 1 when the pod does not exist, 2 when the API server "
        "cannot be asked.",
    )
    p.add_argument("pod", metavar="POD")
    p.add_argument("-n", "--namespace", help="the pod's namespace (default: default)")
    p.add_argument("-o", "--output", choices=["text", "json", "yaml"], default="text")
    add_kube_flags(p)
    p.set_defaults(run=deferred("fracgpu.why", "run"))


def _add_top(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "top",
        help="each GPU: its shares (pod, container, grant) and what it has free",
        description="Per node and card: what is used and free, in cards and MiB, and each "
        "share on it with its grant (DRA mode: from the claims; device-plugin mode: a node's "
        "shares, whose card only its node agent knows) and what its processes use now, as "
        "the node agent measures it (card memory, percent of the card's SMs busy; read "
        "through the API server's proxy to the node agents, which needs pods/proxy). Shares "
        "of -n NAMESPACE only, or all with -A (the default).",
    )
    p.add_argument("--node", help="only this node's cards")
    p.add_argument(
        "--no-live",
        dest="live",
        action="store_false",
        help="grants only: do not ask the node agents",
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", help="only this namespace's shares")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    p.add_argument("-o", "--output", choices=["text", "wide", "json", "yaml"], default="text")
    add_kube_flags(p)
    p.set_defaults(run=deferred("fracgpu.top", "run_top"))


def _add_fit(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "fit",
        help="which GPUs could take a pod of this shape now, or why none",
        description="SHAPE is what fracgpu.io/gpu says (0.01 to 1 with two decimals, or whole "
        "cards); --gpumem what fracgpu.io/gpumem says (default: the share's part of each card's "
        "memory). Prints the cards that can take it now, best fit first, or the reason none "
        "can, as a waiting pod's event says it. Exit status 0 when it fits, 1 when it fits "
        "nowhere now, 2 for a shape that is not one or an API server that cannot be asked.",
    )
    p.add_argument("gpu", metavar="SHAPE")
    p.add_argument("--gpumem", help="GPU memory per card, e.g. 8Gi (fracgpu.io/gpumem)")
    p.add_argument(
        "--count",
        type=int,
        default=1,
        help="the share on this many cards of one node (fracgpu.io/gpu-count; DRA mode)",
    )
    p.add_argument("-o", "--output", choices=["text", "json", "yaml"], default="text")
    add_kube_flags(p)
    p.set_defaults(run=deferred("fracgpu.top", "run_fit"))


def _add_node_cleanup(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "node-cleanup",
        help="after an uninstall: remove the node agents' labels, annotations and ResourceSlices",
        description="Removes what fracgpu's node agents published in the API: their labels "
        "and annotations on every Node (fracgpu.io/gpu.product, gpu.memory-mib, gpu.count, "
        "gpu.inventory, gpu.free) and the ResourceSlices of fracgpu's DRA driver. Waits first "
        "until no node agent pod is left in --namespace (one still running could publish "
        "again). The Helm chart runs it when the release is uninstalled; run it after "
        "`kubectl delete -k`.",
    )
    p.add_argument("-n", "--namespace", required=True, help="the release's namespace")
    p.add_argument(
        "--wait-s",
        type=float,
        default=120.0,
        help="how long to wait for the node agents' pods to end (default 120)",
    )
    add_kube_flags(p)
    p.set_defaults(run=deferred("fracgpu.cleanup", "run"))


def _run_mode(args: argparse.Namespace) -> int:
    from fracgpu.mode import run

    return run(args)


def _add_review(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "review",
        help="apply the webhook's admission to manifests offline",
        description="Read Pod and workload manifests (YAML or JSON, multi-document; - for "
        "stdin) and print what admission would make of them. Exit status 1 when any object "
        "is denied.",
    )
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("-o", "--output", choices=["text", "json"], default="text")
    p.add_argument("--config", type=Path, help="the same YAML configuration `serve` reads")
    p.add_argument(
        "--quota",
        type=Path,
        metavar="FILE",
        help="GPUQuota objects (YAML); pods are also checked against them, in order",
    )
    _add_admission_flags(p)
    p.set_defaults(run=_run_review)


def _add_admission_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gpu-model",
        action="append",
        default=[],
        metavar="PRODUCT=MIB",
        help="a GPU model and its memory, added to the inventory (repeatable)",
    )
    p.add_argument(
        "--dialect",
        action="append",
        default=[],
        choices=sorted(d.value for d in OPTIONAL_DIALECTS),
        help="also accept another system's resource names (repeatable)",
    )
    p.add_argument("--scheduler-name", help="scheduler set on GPU pods ('' leaves it alone)")


def admission_config(
    args: argparse.Namespace, document: dict[str, object] | None = None
) -> AdmissionConfig:
    """The admission section of --config (``document``: the file already read), with
    command-line flags on top."""
    if document is None:
        document = load_yaml(args.config)
    raw = document.get("admission") or {}
    derived = False  # placement: extender because the file serves the extender
    if isinstance(raw, dict) and "placement" not in raw and extender_enabled(document):
        raw, derived = {**raw, "placement": "extender"}, True
    try:
        config = AdmissionConfig.model_validate(raw)
    except ValidationError as exc:
        error = describe(exc, f"{args.config}: admission")
        if derived:
            error = ConfigError(f"{error} (admission.placement follows extender.enabled: true)")
        raise error from None
    models = dict(config.inventory.models)
    for item in args.gpu_model:
        product, sep, mib = item.partition("=")
        if not sep or not product or not mib.isdigit() or int(mib) < 256:
            raise ConfigError(
                f"--gpu-model {item!r}: expected PRODUCT=MIB with MIB a whole number of MiB "
                f"(at least 256), e.g. NVIDIA-H100-80GB-HBM3=81559"
            )
        models[product] = int(mib)
    updates: dict[str, object] = {
        "inventory": config.inventory.model_copy(update={"models": models}),
        "dialects": sorted({*config.dialects, *(Dialect(d) for d in args.dialect)}),
    }
    if args.scheduler_name is not None:
        updates["scheduler_name"] = args.scheduler_name
        problem = placement_problem(config.placement, config.allocation, args.scheduler_name)
        if problem is not None:
            raise ConfigError(f"--scheduler-name {args.scheduler_name!r}: {problem}")
    return config.model_copy(update=updates)


def extender_enabled(document: dict[str, object]) -> bool:
    """Whether the file serves the scheduler extender (``extender.enabled``, read as its own
    section reads it). Then GPU pods must be placed by it: admission takes
    ``placement: extender`` unless the file says otherwise (``fracgpu serve`` refuses a
    contradiction), and ``fracgpu review`` shows what serve would do. A section it cannot
    read counts as off here; serve's own loader reports it."""
    section = document.get("extender")
    if not isinstance(section, dict):
        return False
    try:
        return TypeAdapter(bool).validate_python(section.get("enabled", False))
    except ValidationError:
        return False


def _run_review(args: argparse.Namespace) -> int:
    config = admission_config(args)
    inventory = Inventory(config.inventory.models)
    mutator = Mutator(config, inventory)
    decisions = [review_object(mutator, src, obj) for src, obj in read_manifests(args.files)]
    if args.quota is not None:
        apply_quota(decisions, args.quota, inventory)
    (render_json if args.output == "json" else render_text)(decisions, sys.stdout)
    return 0 if all(d.allowed for d in decisions) else 1


def _run_serve(args: argparse.Namespace) -> int:
    from fracgpu.serve import serve

    document = load_yaml(args.config)  # read once: admission here, the rest in serve
    return serve(args, admission_config(args, document), document)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    log.configure(args.log_level, args.log_format or ("text" if sys.stderr.isatty() else "json"))
    try:
        status: int = args.run(args)
    except KeyboardInterrupt:
        return 130
    except (ConfigError, ManifestError) as exc:
        print(f"fracgpu: {exc}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
