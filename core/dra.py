"""DRA mode's names: what the node agent publishes and what admission and quota ask for.

In DRA mode (design §9) each card is one device of the driver ``gpu.fracgpu.io`` with two
consumable capacities, ``cores`` (hundredths of the card, like ``fracgpu.io/core``) and
``memory`` (bytes, in 256 MiB steps, like ``fracgpu.io/memory``). The DRA kubelet plugin
publishes them in its node's ResourceSlice; admission writes ResourceClaimTemplates that request
them; quota adds up what claims of the class request. This module is their one definition.
"""

from __future__ import annotations

from collections.abc import Iterable

from core.units import BLOCK_MIB, DOMAIN

DRIVER = f"gpu.{DOMAIN}"
"""The DRA driver name, and the name of the DeviceClass that selects its devices."""
DEVICE_CLASS = DRIVER
CORES = "cores"
MEMORY = "memory"
MEMORY_STEP = f"{BLOCK_MIB}Mi"
# Device attributes the plugin publishes, under the driver's own domain in CEL:
# device.attributes["gpu.fracgpu.io"].productName
PRODUCT_ATTRIBUTE = "productName"
UUID_ATTRIBUTE = "uuid"
INDEX_ATTRIBUTE = "index"
TEMPLATE_PREFIX = "fracgpu-"
"""ResourceClaimTemplates admission makes are named ``fracgpu-<shape>``; quota knows them by it."""
MAX_SUBREQUESTS = 8
"""The API server's limit on ``firstAvailable`` alternatives in one device request."""

EXTENDED_RESOURCE_PREFIX = "deviceclass.resource.kubernetes.io/"
"""Every DeviceClass can be asked for as an extended resource of this prefix and its name
(KEP-5004): the scheduler then makes the claim."""
DEVICE_CLASS_RESOURCE = f"{EXTENDED_RESOURCE_PREFIX}{DEVICE_CLASS}"

API_GROUP = "resource.k8s.io"
API_VERSION = f"{API_GROUP}/v1"


def memory_quantity(blocks: int) -> str:
    """A memory capacity request for whole 256 MiB blocks, as the API server re-serialises it
    would be noisy (``8Gi``); MiB is exact and readable."""
    return f"{blocks * BLOCK_MIB}Mi"


def _cel_string(text: str) -> str:
    quoted = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{quoted}"'


_PRODUCT = f'device.attributes["{DRIVER}"].{PRODUCT_ATTRIBUTE}'


def product_selector(product: str) -> str:
    """CEL that selects the cards of one model."""
    return f"{_PRODUCT} == {_cel_string(product)}"


def products_selector(only: Iterable[str] | None, excluded: Iterable[str] = ()) -> str | None:
    """CEL that selects the cards of these models (None: any) and of none of ``excluded``;
    None when it would select every card. Names are compared as the slice spells them."""
    parts: list[str] = []
    if only is not None:
        parts.append(f"{_PRODUCT} in [{', '.join(_cel_string(p) for p in sorted(only))}]")
    never = sorted(excluded)
    if never:
        parts.append(f"!({_PRODUCT} in [{', '.join(_cel_string(p) for p in never)}])")
    return " && ".join(parts) or None
