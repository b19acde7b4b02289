"""``fracgpu mode`` (also ``kubectl fracgpu mode``): which mode to install fracgpu in on this
cluster, and which one an installed fracgpu admits in (webhook/mode.py decides both)."""

from __future__ import annotations

import argparse
import asyncio
import sys

import aiohttp

from core.kube import KubeConfigError, KubeError, kube_client
from webhook.mode import admitting, read_cluster, to_install

OVERLAYS = {"dra": "deploy/overlays/dra", "device-plugin": "deploy/overlays/default"}


async def _report(args: argparse.Namespace) -> int:
    try:
        async with kube_client(args.kubeconfig, args.context) as api:
            cluster = await read_cluster(api)
    except (KubeConfigError, KubeError, aiohttp.ClientError, OSError) as exc:
        sys.stderr.write(f"fracgpu mode: cannot ask the API server: {exc}\n")
        return 2
    install, admit = to_install(cluster), admitting(cluster)
    sys.stdout.write(
        f"install:   {install.allocation} mode ({install.why})\n"
        f"           kubectl apply -k {OVERLAYS[install.allocation]}\n"
        f"admitting: {admit.allocation} mode with admission.allocation: auto ({admit.why})\n"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_report(args))
