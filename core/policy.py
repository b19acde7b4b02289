"""A share's compute policy beyond its guarantee: how far it may burst, and its priority.

A share's ``fracgpu.io/gpu`` is its *guarantee*: the compute the hook lets it use however busy
the card is, and what quota counts. The policy says what it may do with compute nobody on the
card is using now:

``ceiling``   the most it may use while the node lends it idle compute (percent of the card,
              from the guarantee to 100). Equal to the guarantee: a hard cap, which is what a
              share is unless it asks for more (``requests`` below ``limits``).
``priority``  who borrows first: ``high`` shares before ``low`` ones (HAMi's
              ``nvidia.com/priority``: 0 high, 1 low). It never takes a guarantee away.

Memory is never lent: an allocation cannot be taken back when its owner returns.

Admission writes the policy where the node agent reads it, only for a share that is not a hard
cap of low priority (so every other pod and template is as it always was):

- device-plugin mode: the pod annotation ``fracgpu.io/compute-policy``, JSON by container name;
- DRA mode: the claim's opaque configuration for the driver (``kind: SharePolicy``), which the
  node agent reads with the claim when it prepares it.

Neither is a privilege: both say what the pod's owner may ask for anyway, and lending only ever
hands out compute that no active share is guaranteed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from core.units import CORE_PER_CARD, DOMAIN

POLICY_ANNOTATION = f"{DOMAIN}/compute-policy"
"""Written by admission on device-plugin pods whose shares may burst or have high priority."""
PRIORITY_ANNOTATION = f"{DOMAIN}/gpu-priority"
"""What a user writes on a pod: ``high`` or ``low`` (the default), for every GPU container."""
OPAQUE_API_VERSION = "gpu.fracgpu.io/v1"
OPAQUE_KIND = "SharePolicy"


class Priority(StrEnum):
    HIGH = "high"
    LOW = "low"


class PolicyError(ValueError):
    """A policy that does not follow this module's rules; the message says which."""


@dataclass(frozen=True, slots=True)
class SharePolicy:
    """``ceiling`` in percent of a card (0: the guarantee, a hard cap), and the priority."""

    ceiling: int = 0
    priority: Priority = Priority.LOW

    def __post_init__(self) -> None:
        if not 0 <= self.ceiling <= CORE_PER_CARD:
            raise PolicyError(f"ceiling must be 0 (a hard cap) to 100, got {self.ceiling}")

    @property
    def default(self) -> bool:
        """A hard cap of low priority: what every share is unless it asks otherwise."""
        return self.ceiling == 0 and self.priority is Priority.LOW

    def ceiling_for(self, guarantee: int) -> int:
        """The most the share may use, given its guarantee (never below it)."""
        return max(guarantee, self.ceiling)

    def may_burst(self, guarantee: int) -> bool:
        return self.ceiling_for(guarantee) > guarantee

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"priority": self.priority.value}
        if self.ceiling:
            out["ceiling"] = self.ceiling
        return out

    @classmethod
    def from_json(cls, raw: object) -> SharePolicy:
        if not isinstance(raw, Mapping):
            raise PolicyError(f"a share policy is an object, got {type(raw).__name__}")
        unknown = set(raw) - {"ceiling", "priority", "apiVersion", "kind"}
        if unknown:
            raise PolicyError(f"unknown fields {sorted(unknown)}")
        ceiling = raw.get("ceiling", 0)
        if isinstance(ceiling, bool) or not isinstance(ceiling, int):
            raise PolicyError(f"ceiling must be a whole percent, got {ceiling!r}")
        try:
            priority = Priority(raw.get("priority", Priority.LOW.value))
        except ValueError:
            raise PolicyError(
                f"priority must be high or low, got {raw.get('priority')!r}"
            ) from None
        return cls(ceiling, priority)

    def to_opaque(self) -> dict[str, Any]:
        """The claim configuration's ``opaque.parameters`` (DRA mode)."""
        return {"apiVersion": OPAQUE_API_VERSION, "kind": OPAQUE_KIND, **self.to_json()}

    @classmethod
    def from_opaque(cls, parameters: object) -> SharePolicy:
        if not isinstance(parameters, Mapping) or (
            parameters.get("apiVersion"),
            parameters.get("kind"),
        ) != (OPAQUE_API_VERSION, OPAQUE_KIND):
            raise PolicyError(f"not a {OPAQUE_API_VERSION} {OPAQUE_KIND}")
        return cls.from_json(parameters)


HARD_CAP = SharePolicy()


def encode_annotation(policies: Mapping[str, SharePolicy]) -> str | None:
    """The pod annotation for its containers' policies; None when every one is the default."""
    shown = {name: p.to_json() for name, p in sorted(policies.items()) if not p.default}
    return json.dumps(shown, separators=(",", ":"), sort_keys=True) if shown else None


def decode_annotation(text: object) -> dict[str, SharePolicy]:
    """Container name -> policy, from the annotation; PolicyError when it is not one."""
    if not isinstance(text, str):
        raise PolicyError("the annotation is not text")
    try:
        raw = json.loads(text)
    except ValueError:
        raise PolicyError("the annotation is not JSON") from None
    if not isinstance(raw, dict):
        raise PolicyError("the annotation is not a JSON object")
    return {str(name): SharePolicy.from_json(value) for name, value in raw.items()}
