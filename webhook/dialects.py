"""The vocabularies a container may ask for a GPU in, and which of them are in force.

fracgpu's own (``fracgpu.io/gpu`` and friends), the canonical form it writes, and the extended
resource of its DeviceClass are always understood; HAMi's and TKEStack's resource names can be
switched on (``admission.dialects``), so that workloads written for those systems move over
unchanged (design §1). Each vocabulary is read into one request by ``webhook.parsing``.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from functools import lru_cache

from core import dra
from core.units import CANONICAL, GPU, GPU_COUNT, GPUMEM, GPUMEM_PERCENTAGE

HAMI_GPU = "nvidia.com/gpu"
HAMI_CORES = "nvidia.com/gpucores"
HAMI_MEM = "nvidia.com/gpumem"
HAMI_MEM_PERCENTAGE = "nvidia.com/gpumem-percentage"
HAMI_PRIORITY = "nvidia.com/priority"  # 0 high, 1 low (HAMi's default)
TKE_CORE = "tencent.com/vcuda-core"
TKE_MEMORY = "tencent.com/vcuda-memory"


class Dialect(StrEnum):
    FRACGPU = "fracgpu"
    CANONICAL = "canonical"
    HAMI = "hami"
    TKESTACK = "tkestack"
    DEVICE_CLASS = "device-class"


DIALECT_RESOURCES: dict[Dialect, tuple[str, ...]] = {
    Dialect.FRACGPU: (GPU, GPUMEM, GPUMEM_PERCENTAGE, GPU_COUNT),
    Dialect.CANONICAL: CANONICAL,
    Dialect.HAMI: (HAMI_GPU, HAMI_CORES, HAMI_MEM, HAMI_MEM_PERCENTAGE, HAMI_PRIORITY),
    Dialect.TKESTACK: (TKE_CORE, TKE_MEMORY),
    # The extended resource Kubernetes gives fracgpu's DeviceClass (on by default in 1.36, GA in
    # 1.37): a pod asking for it would get whole cards from a claim the scheduler makes after
    # admission, which neither webhook sees; it is taken as whole cards in fracgpu's form.
    Dialect.DEVICE_CLASS: (dra.DEVICE_CLASS_RESOURCE,),
}
# Always understood: ours, the canonical form and the DeviceClass's extended resource (a way to a
# card that must never go uncounted). The others can be switched on.
ALWAYS_ON = frozenset({Dialect.FRACGPU, Dialect.CANONICAL, Dialect.DEVICE_CLASS})
OPTIONAL_DIALECTS = frozenset(Dialect) - ALWAYS_ON

DIALECT_OF = {name: d for d, names in DIALECT_RESOURCES.items() for name in names}
"""The vocabulary each resource name belongs to."""


def input_resources(dialects: Iterable[Dialect]) -> frozenset[str]:
    """Every resource name the webhook rewrites, given the enabled dialects."""
    return _input_resources(enabled(dialects))


@lru_cache(maxsize=16)
def _input_resources(dialects: tuple[Dialect, ...]) -> frozenset[str]:
    names: set[str] = set()
    for dialect in dialects:
        names.update(DIALECT_RESOURCES[dialect])
    return frozenset(names)


def enabled(dialects: Iterable[Dialect]) -> tuple[Dialect, ...]:
    """The dialects in force: ours and the canonical form always, plus the enabled ones."""
    return _enabled(frozenset(dialects))


@lru_cache(maxsize=16)
def _enabled(dialects: frozenset[Dialect]) -> tuple[Dialect, ...]:
    chosen = {*ALWAYS_ON, *dialects}
    return tuple(d for d in Dialect if d in chosen)
