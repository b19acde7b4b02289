"""resource.k8s.io/v1 in the fake API server: validation, what the server rewrites, and a
scheduler-like allocator, as a real Kubernetes 1.36 cluster did them.

Validation (422 Invalid, per field, as ``objectrules`` words it) covers what a DRA driver or a
webhook could get wrong:
- ResourceSlice: driver (DNS subdomain, at most 63), pool (name, generation >= 0,
  resourceSliceCount > 0), exactly one of nodeName / nodeSelector / allNodes /
  perDeviceNodeSelection, at most 128 devices (64 when any has taints), device names (DNS
  labels, unique), attributes (qualified names, exactly one typed value, strings at most 64),
  at most 32 attributes and capacities per device, capacities (a quantity; a requestPolicy only
  with allowMultipleAllocations; default required with validRange; min <= default <= max <=
  value; min + step <= value; default - min and max - min whole multiples of step), taints
  (at most 16, qualified keys, effect None / NoSchedule / NoExecute). driver, pool name and
  nodeName are immutable.
- ResourceClaim and ResourceClaimTemplate specs: at most 32 requests, DNS-label names, unique,
  exactly one of ``exactly`` / ``firstAvailable`` (at most 8 subrequests), a deviceClassName,
  allocationMode ExactCount / All, count >= 1, capacity requests that are quantities. A claim's
  spec is immutable.
- DeviceClass: selectors with a CEL expression.

What the server rewrites: quantities are stored in canonical form (``81920Mi`` becomes ``80Gi``,
``1000`` becomes ``1k``), and a taint without ``timeAdded`` gets the current time.

The allocator (``allocate_claim``) places a claim as kube-scheduler 1.36 did on the observed
cluster: nodes in name order, devices in slice order, first fit; only a pool's newest
generation counts; tainted devices are skipped; a device that allows multiple allocations is
charged, per capacity, the request rounded up to ``min + n * step`` (the policy default when the
request names none) and fits while the charges of every allocated claim stay within its value;
any other device is allocated whole. Each result of a shareable device gets a ``shareID`` and
``consumedCapacity`` for every capacity. A claim that fits nowhere stays unallocated (the
scheduler's "cannot allocate all claims"). Device-class selectors: only
``device.driver == "<name>"`` is understood; anything else is refused, so no test passes on a
selector the fake silently ignored.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Mapping
from decimal import ROUND_CEILING, Decimal
from typing import Any

from core.quantity import QuantityError, parse_quantity
from testkit.apierrors import invalid
from testkit.apistore import Obj, Store, clone
from testkit.kinds import (
    DEVICE_CLASS,
    RESOURCE_CLAIM,
    RESOURCE_CLAIM_TEMPLATE,
    RESOURCE_SLICE,
    Kind,
)

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DRIVER_SELECTOR = re.compile(r'^\s*device\.driver\s*==\s*"([^"]+)"\s*$')
MAX_DEVICES = 128
MAX_DEVICES_WITH_TAINTS = 64
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_TAINTS = 16
MAX_REQUESTS = 32
MAX_SUBREQUESTS = 8
TAINT_EFFECTS = ("None", "NoSchedule", "NoExecute")
_BINARY = (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))
_DECIMAL = (("E", 10**18), ("P", 10**15), ("T", 10**12), ("G", 10**9), ("M", 10**6), ("k", 10**3))

Causes = list[tuple[str, str]]


# ---- quantities --------------------------------------------------------------------------------


def canonical_quantity(raw: Any) -> str:
    """How the API server re-serialises a quantity (integers; fractions in milli-units)."""
    quantity = parse_quantity(raw)
    return render_quantity(quantity.value, binary=quantity.format == "binary")


def render_quantity(value: Decimal, *, binary: bool) -> str:
    if value != value.to_integral_value():
        milli = value * 1000
        return f"{int(milli)}m" if milli == milli.to_integral_value() else str(value)
    number = int(value)
    for suffix, size in _BINARY if binary else _DECIMAL:
        if number and number % size == 0:
            return f"{number // size}{suffix}"
    return str(number)


def _quantity(raw: Any, path: str, causes: Causes) -> Decimal | None:
    if raw is None:
        causes.append((path, "Required value"))
        return None
    try:
        return parse_quantity(raw).value
    except QuantityError:
        causes.append(
            (
                path,
                f'Invalid value: "{raw}": quantities must match the regular '
                "expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'",
            )
        )
        return None


def _qualified_name(key: Any) -> bool:
    if not isinstance(key, str) or not key:
        return False
    domain, slash, name = key.rpartition("/")
    if slash and (len(domain) > 63 or not _DNS_SUBDOMAIN.match(domain)):
        return False
    return len(name) <= 32 and bool(_C_IDENTIFIER.match(name))


# ---- validation --------------------------------------------------------------------------------


def validate(kind: Kind, obj: Obj) -> None:
    causes: Causes = []
    spec = obj.get("spec")
    if kind is RESOURCE_SLICE:
        _slice(spec if isinstance(spec, dict) else {}, causes)
    elif kind is RESOURCE_CLAIM:
        _claim_spec(spec if isinstance(spec, dict) else {}, "spec", causes)
    elif kind is RESOURCE_CLAIM_TEMPLATE:
        inner = (spec or {}).get("spec") if isinstance(spec, dict) else None
        _claim_spec(inner if isinstance(inner, dict) else {}, "spec.spec", causes)
    elif kind is DEVICE_CLASS:
        _device_class(spec if isinstance(spec, dict) else {}, causes)
    if causes:
        raise invalid(kind, str(obj.get("metadata", {}).get("name", "")), causes)


def _slice(spec: Mapping[str, Any], causes: Causes) -> None:
    driver = spec.get("driver")
    if not driver:
        causes.append(("spec.driver", "Required value"))
    elif not isinstance(driver, str) or len(driver) > 63 or not _DNS_SUBDOMAIN.match(driver):
        causes.append(
            (
                "spec.driver",
                f'Invalid value: "{driver}": must be a DNS subdomain of at most 63 characters',
            )
        )
    pool = spec.get("pool")
    if not isinstance(pool, dict):
        causes.append(("spec.pool", "Required value"))
    else:
        name = pool.get("name")
        if not name or not isinstance(name, str) or len(name) > 253:
            causes.append(("spec.pool.name", "Required value"))
        elif not all(_DNS_SUBDOMAIN.match(part) for part in name.split("/")):
            causes.append(
                ("spec.pool.name", f'Invalid value: "{name}": each part must be a DNS subdomain')
            )
        generation = pool.get("generation", 0)
        if not isinstance(generation, int) or generation < 0:
            causes.append(
                (
                    "spec.pool.generation",
                    f"Invalid value: {generation}: must be greater than or equal to 0",
                )
            )
        count = pool.get("resourceSliceCount")
        if not isinstance(count, int) or count <= 0:
            causes.append(
                (
                    "spec.pool.resourceSliceCount",
                    f"Invalid value: {count}: must be greater than zero",
                )
            )
    selectors = [
        f
        for f in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
        if spec.get(f) not in (None, "", False)
    ]
    if len(selectors) != 1:
        causes.append(
            (
                "spec",
                "Invalid value: exactly one of `nodeName`, `nodeSelector`, "
                "`allNodes`, `perDeviceNodeSelection` is required",
            )
        )
    devices = spec.get("devices") or []
    if not isinstance(devices, list):
        causes.append(("spec.devices", "Invalid value: must be a list"))
        return
    tainted = any(isinstance(d, dict) and d.get("taints") for d in devices)
    limit = MAX_DEVICES_WITH_TAINTS if tainted else MAX_DEVICES
    if len(devices) > limit:
        causes.append(
            ("spec.devices", f"Too many: {len(devices)}: must have at most {limit} items")
        )
    seen: set[str] = set()
    for i, device in enumerate(devices):
        _device(device, f"spec.devices[{i}]", seen, causes)


def _device(device: Any, path: str, seen: set[str], causes: Causes) -> None:
    if not isinstance(device, dict):
        causes.append((path, "Invalid value: must be an object"))
        return
    name = device.get("name")
    if not isinstance(name, str) or not name:
        causes.append((f"{path}.name", "Required value"))
    elif len(name) > 63 or not _DNS_LABEL.match(name):
        causes.append(
            (
                f"{path}.name",
                f'Invalid value: "{name}": a lowercase RFC 1123 label '
                "must consist of lower case alphanumeric characters or "
                "'-', and must start and end with an alphanumeric "
                "character",
            )
        )
    elif name in seen:
        causes.append((f"{path}.name", f'Duplicate value: "{name}"'))
    else:
        seen.add(name)
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        causes.append(
            (
                path,
                f"Too many: {len(attributes) + len(capacity)}: attributes and "
                f"capacities must not exceed {MAX_ATTRIBUTES_AND_CAPACITIES}",
            )
        )
    for key, value in attributes.items():
        apath = f"{path}.attributes[{key}]"
        if not _qualified_name(key):
            causes.append(
                (
                    apath,
                    f'Invalid value: "{key}": a C identifier of at most 32 '
                    "characters, optionally prefixed by a DNS subdomain and '/'",
                )
            )
        typed = [
            t
            for t in ("int", "bool", "string", "version")
            if isinstance(value, dict) and t in value
        ]
        if len(typed) != 1:
            causes.append((apath, "Invalid value: exactly one value must be specified"))
            continue
        item = value[typed[0]]
        if typed[0] == "int" and (not isinstance(item, int) or isinstance(item, bool)):
            causes.append((f"{apath}.int", "Invalid value: must be an integer"))
        if typed[0] == "bool" and not isinstance(item, bool):
            causes.append((f"{apath}.bool", "Invalid value: must be a boolean"))
        if typed[0] in ("string", "version") and (not isinstance(item, str) or len(item) > 64):
            causes.append((f"{apath}.{typed[0]}", "Too long: may not be more than 64 bytes"))
    multi = device.get("allowMultipleAllocations") is True
    for key, entry in capacity.items():
        _capacity(key, entry, f"{path}.capacity[{key}]", multi, causes)
    taints = device.get("taints") or []
    if len(taints) > MAX_TAINTS:
        causes.append(
            (f"{path}.taints", f"Too many: {len(taints)}: must have at most {MAX_TAINTS} items")
        )
    for j, taint in enumerate(taints):
        tpath = f"{path}.taints[{j}]"
        if not isinstance(taint, dict):
            causes.append((tpath, "Invalid value: must be an object"))
            continue
        key = taint.get("key")
        if not isinstance(key, str) or not _label_key(key):
            causes.append((f"{tpath}.key", f'Invalid value: "{key}": must be a qualified name'))
        value = taint.get("value", "")
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            causes.append(
                (f"{tpath}.value", f'Invalid value: "{value}": must be a valid label value')
            )
        if taint.get("effect") not in TAINT_EFFECTS:
            causes.append(
                (
                    f"{tpath}.effect",
                    f'Unsupported value: "{taint.get("effect")}": '
                    'supported values: "NoExecute", "NoSchedule", '
                    '"None"',
                )
            )


def _label_key(key: str) -> bool:
    prefix, slash, name = key.rpartition("/")
    if slash and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return False
    return 0 < len(name) <= 63 and bool(
        re.match(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$", name)
    )


def _capacity(key: str, entry: Any, path: str, multi: bool, causes: Causes) -> None:
    if not _qualified_name(key):
        causes.append((path, f'Invalid value: "{key}": must be a qualified name'))
    if not isinstance(entry, dict):
        causes.append((path, "Invalid value: must be an object"))
        return
    value = _quantity(entry.get("value"), f"{path}.value", causes)
    policy = entry.get("requestPolicy")
    if policy is None:
        return
    if not multi:
        causes.append(
            (
                f"{path}.requestPolicy",
                "Forbidden: allowMultipleAllocations must be true to set a request policy",
            )
        )
        return
    ppath = f"{path}.requestPolicy"
    if not isinstance(policy, dict) or value is None:
        return
    values = policy.get("validValues")
    rng = policy.get("validRange")
    if values is not None and rng is not None:
        causes.append((ppath, "Invalid value: validValues and validRange are mutually exclusive"))
        return
    default = None
    if "default" in policy:
        default = _quantity(policy["default"], f"{ppath}.default", causes)
    elif values is not None or rng is not None:
        causes.append((f"{ppath}.default", "Required value"))
        return
    if values is not None:
        numbers = [_quantity(v, f"{ppath}.validValues[{i}]", causes) for i, v in enumerate(values)]
        clean = [n for n in numbers if n is not None]
        if len(values) > 10:
            causes.append((f"{ppath}.validValues", "Too many: must have at most 10 items"))
        if clean != sorted(set(clean)):
            causes.append(
                (f"{ppath}.validValues", "Invalid value: must be sorted ascending and unique")
            )
        if any(n > value for n in clean):
            causes.append(
                (f"{ppath}.validValues", "Invalid value: must not exceed the capacity value")
            )
        if default is not None and default not in clean:
            causes.append((f"{ppath}.default", "Invalid value: must be one of validValues"))
        return
    if rng is None:
        if default is not None and not 0 <= default <= value:
            causes.append((f"{ppath}.default", "Invalid value: must be within the capacity value"))
        return
    rpath = f"{ppath}.validRange"
    low = _quantity(rng.get("min"), f"{rpath}.min", causes)
    if low is None:
        return
    if not 0 <= low <= value:
        causes.append(
            (
                f"{rpath}.min",
                f"Invalid value: {canonical_quantity(rng['min'])}: must "
                "be between 0 and the capacity value",
            )
        )
    high = None
    if rng.get("max") is not None:
        high = _quantity(rng["max"], f"{rpath}.max", causes)
        if high is not None and not low <= high <= value:
            causes.append(
                (
                    f"{rpath}.max",
                    f"Invalid value: {canonical_quantity(rng['max'])}: "
                    "must be between min and the capacity value",
                )
            )
    if default is not None:
        if default < low:
            causes.append((f"{ppath}.default", "Invalid value: must not be less than min"))
        if high is not None and default > high:
            causes.append((f"{ppath}.default", "Invalid value: must not be more than max"))
    if rng.get("step") is not None:
        step = _quantity(rng["step"], f"{rpath}.step", causes)
        if step is None or step <= 0:
            return
        # 1.36 does its step arithmetic on integer values, rounded up.
        istep = int(step.to_integral_value(rounding=ROUND_CEILING))
        if low + istep > value:
            causes.append(
                (f"{rpath}.step", "Invalid value: min + step must not exceed the capacity value")
            )
        if default is not None and (int(default) - int(low)) % istep:
            causes.append(
                (f"{ppath}.default", "Invalid value: default - min must be a multiple of step")
            )
        if high is not None and (int(high) - int(low)) % istep:
            causes.append((f"{rpath}.max", "Invalid value: max - min must be a multiple of step"))


def _claim_spec(spec: Mapping[str, Any], path: str, causes: Causes) -> None:
    devices = spec.get("devices") or {}
    requests = devices.get("requests") or []
    if len(requests) > MAX_REQUESTS:
        causes.append(
            (
                f"{path}.devices.requests",
                f"Too many: {len(requests)}: must have at most {MAX_REQUESTS} items",
            )
        )
    names: set[str] = set()
    for i, request in enumerate(requests):
        rpath = f"{path}.devices.requests[{i}]"
        if not isinstance(request, dict):
            causes.append((rpath, "Invalid value: must be an object"))
            continue
        name = request.get("name")
        if not isinstance(name, str) or not _DNS_LABEL.match(name) or len(name) > 63:
            causes.append((f"{rpath}.name", f'Invalid value: "{name}": must be a DNS label'))
        elif name in names:
            causes.append((f"{rpath}.name", f'Duplicate value: "{name}"'))
        else:
            names.add(name)
        exact, first = request.get("exactly"), request.get("firstAvailable")
        if (exact is None) == (first is None):
            causes.append(
                (rpath, "Invalid value: exactly one of `exactly` or `firstAvailable` is required")
            )
            continue
        if exact is not None:
            _exact(exact, f"{rpath}.exactly", causes)
            continue
        if not isinstance(first, list) or not first or len(first) > MAX_SUBREQUESTS:
            causes.append(
                (f"{rpath}.firstAvailable", f"Invalid value: 1 to {MAX_SUBREQUESTS} subrequests")
            )
            continue
        subnames: set[str] = set()
        for j, sub in enumerate(first):
            spath = f"{rpath}.firstAvailable[{j}]"
            sub_name = sub.get("name") if isinstance(sub, dict) else None
            if not isinstance(sub_name, str) or not _DNS_LABEL.match(sub_name):
                causes.append(
                    (f"{spath}.name", f'Invalid value: "{sub_name}": must be a DNS label')
                )
            elif sub_name in subnames:
                causes.append((f"{spath}.name", f'Duplicate value: "{sub_name}"'))
            else:
                subnames.add(sub_name)
            _exact(sub if isinstance(sub, dict) else {}, spath, causes)


def _exact(request: Mapping[str, Any], path: str, causes: Causes) -> None:
    if not request.get("deviceClassName"):
        causes.append((f"{path}.deviceClassName", "Required value"))
    mode = request.get("allocationMode", "ExactCount")
    if mode not in ("ExactCount", "All"):
        causes.append(
            (
                f"{path}.allocationMode",
                f'Unsupported value: "{mode}": supported values: "All", "ExactCount"',
            )
        )
    count = request.get("count")
    if count is not None and (mode != "ExactCount" or not isinstance(count, int) or count < 1):
        causes.append(
            (
                f"{path}.count",
                f"Invalid value: {count}: must be greater than zero with allocationMode ExactCount",
            )
        )
    for key, raw in ((request.get("capacity") or {}).get("requests") or {}).items():
        if not _qualified_name(key):
            causes.append(
                (f"{path}.capacity.requests[{key}]", "Invalid value: must be a qualified name")
            )
        _quantity(raw, f"{path}.capacity.requests[{key}]", causes)


def _device_class(spec: Mapping[str, Any], causes: Causes) -> None:
    for i, selector in enumerate(spec.get("selectors") or []):
        expression = ((selector or {}).get("cel") or {}).get("expression")
        if not isinstance(expression, str) or not expression.strip():
            causes.append((f"spec.selectors[{i}].cel.expression", "Required value"))
        elif len(expression) > 10 * 1024:
            causes.append(
                (
                    f"spec.selectors[{i}].cel.expression",
                    "Too long: may not be more than 10240 bytes",
                )
            )


def check_immutable(kind: Kind, old: Obj, new: Obj) -> None:
    name = old["metadata"]["name"]
    if kind is RESOURCE_SLICE:
        before, after = old.get("spec") or {}, new.get("spec") or {}
        for path, get in (
            ("spec.driver", lambda s: s.get("driver")),
            ("spec.pool.name", lambda s: (s.get("pool") or {}).get("name")),
            ("spec.nodeName", lambda s: s.get("nodeName")),
        ):
            if get(before) != get(after):
                raise invalid(kind, name, [(path, "Invalid value: field is immutable")])
    if kind is RESOURCE_CLAIM and (old.get("spec") != new.get("spec")):
        raise invalid(kind, name, [("spec", "Invalid value: field is immutable")])


# ---- what the server rewrites ------------------------------------------------------------------


def canonicalize(kind: Kind, obj: Obj, now: str) -> None:
    """Quantities in canonical form; ``timeAdded`` on taints that lack it."""
    if kind is RESOURCE_SLICE:
        for device in (obj.get("spec") or {}).get("devices") or []:
            for entry in (device.get("capacity") or {}).values():
                _canonical_fields(entry, ("value",))
                policy = entry.get("requestPolicy") or {}
                _canonical_fields(policy, ("default",))
                _canonical_fields(policy.get("validRange") or {}, ("min", "max", "step"))
                if policy.get("validValues"):
                    policy["validValues"] = [canonical_quantity(v) for v in policy["validValues"]]
            for taint in device.get("taints") or []:
                taint.setdefault("timeAdded", now)
    elif kind in (RESOURCE_CLAIM, RESOURCE_CLAIM_TEMPLATE):
        spec = obj.get("spec") or {}
        if kind is RESOURCE_CLAIM_TEMPLATE:
            spec = spec.get("spec") or {}
        for request in (spec.get("devices") or {}).get("requests") or []:
            for exact in [request.get("exactly"), *(request.get("firstAvailable") or [])]:
                if not exact:
                    continue
                exact.setdefault("allocationMode", "ExactCount")
                if exact["allocationMode"] == "ExactCount":
                    exact.setdefault("count", 1)
                requests = (exact.get("capacity") or {}).get("requests")
                if requests:
                    for key, raw in requests.items():
                        requests[key] = canonical_quantity(raw)


def _canonical_fields(entry: dict[str, Any], fields: Iterable[str]) -> None:
    for field in fields:
        if entry.get(field) is not None:
            entry[field] = canonical_quantity(entry[field])


# ---- the allocator ------------------------------------------------------------------------------


class Unschedulable(Exception):
    """The claim fits no node (the scheduler's generic "cannot allocate all claims")."""


def _class_driver(store: Store, class_name: str) -> str:
    device_class = store.get(DEVICE_CLASS, ("", class_name))
    if device_class is None:
        raise Unschedulable(f'device class "{class_name}" not found')
    drivers = []
    for selector in (device_class.get("spec") or {}).get("selectors") or []:
        expression = selector["cel"]["expression"]
        match = _DRIVER_SELECTOR.match(expression)
        if match is None:
            raise ValueError(
                f'the fake allocator understands only `device.driver == "..."` selectors, '
                f"not {expression!r}"
            )
        drivers.append(match[1])
    if len(set(drivers)) != 1:
        raise ValueError(f"device class {class_name} must select exactly one driver")
    return drivers[0]


def _newest_slices(store: Store) -> list[Obj]:
    slices = [obj for _, obj in sorted(store.snapshot(RESOURCE_SLICE, store.rv).items())]
    newest: dict[tuple[str, str], int] = {}
    for obj in slices:
        spec = obj["spec"]
        key = (spec["driver"], spec["pool"]["name"])
        newest[key] = max(newest.get(key, -1), int(spec["pool"].get("generation", 0)))
    return [
        obj
        for obj in slices
        if int(obj["spec"]["pool"].get("generation", 0))
        == newest[(obj["spec"]["driver"], obj["spec"]["pool"]["name"])]
    ]


def _consumed(store: Store, skip_uid: str) -> dict[tuple[str, str, str], dict[str, Decimal]]:
    """What allocated claims hold of each device; ``None`` entries mark exclusive use."""
    held: dict[tuple[str, str, str], dict[str, Decimal]] = {}
    for obj in store.snapshot(RESOURCE_CLAIM, store.rv).values():
        if obj["metadata"]["uid"] == skip_uid:
            continue
        allocation = (obj.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            key = (result["driver"], result["pool"], result["device"])
            entry = held.setdefault(key, {})
            consumed = result.get("consumedCapacity")
            if consumed is None:
                entry["__exclusive__"] = Decimal(1)
                continue
            for name, raw in consumed.items():
                entry[name] = entry.get(name, Decimal(0)) + parse_quantity(raw).value
    return held


def _charge(capacity: Mapping[str, Any], requested: Mapping[str, Any]) -> dict[str, Decimal] | None:
    """Per capacity, what one allocation costs (None: the request fits no such device)."""
    charges: dict[str, Decimal] = {}
    for name, entry in capacity.items():
        value = parse_quantity(entry["value"]).value
        policy = entry.get("requestPolicy") or {}
        raw = requested.get(name)
        if raw is None:
            amount = parse_quantity(policy["default"]).value if "default" in policy else value
        else:
            amount = parse_quantity(raw).value
            rng = policy.get("validRange")
            values = policy.get("validValues")
            if rng:
                low = parse_quantity(rng["min"]).value
                step = parse_quantity(rng["step"]).value if rng.get("step") else None
                high = parse_quantity(rng["max"]).value if rng.get("max") else value
                amount = max(amount, low)
                if step:
                    steps = ((amount - low) / step).to_integral_value(rounding=ROUND_CEILING)
                    amount = low + steps * step
                if amount > high:
                    return None
            elif values:
                fitting = [parse_quantity(v).value for v in values]
                bigger = [v for v in fitting if v >= amount]
                if not bigger:
                    return None
                amount = min(bigger)
        if amount > value:
            return None
        charges[name] = amount
    for name in requested:
        if name not in capacity:
            return None  # the device has no such capacity
    return charges


def _format_like(raw: Any, amount: Decimal) -> str:
    return render_quantity(amount, binary=parse_quantity(raw).format == "binary")


def allocate_claim(
    store: Store, namespace: str, name: str, *, pod: Mapping[str, Any] | None = None
) -> Obj:
    """Allocate (and reserve for ``pod``) a claim, first fit; raises Unschedulable."""
    claim = store.get(RESOURCE_CLAIM, (namespace, name))
    if claim is None:
        raise Unschedulable(f"resourceclaim {namespace}/{name} not found")
    if (claim.get("status") or {}).get("allocation"):
        return claim
    held = _consumed(store, claim["metadata"]["uid"])
    slices = _newest_slices(store)
    nodes = sorted({s["spec"]["nodeName"] for s in slices if s["spec"].get("nodeName")})
    requests = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []
    for node in nodes:
        results = _place(
            store, requests, [s for s in slices if s["spec"].get("nodeName") == node], held
        )
        if results is None:
            continue
        status = clone(claim.get("status") or {})
        status["allocation"] = {
            "devices": {"results": results},
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            },
        }
        if pod is not None:
            status["reservedFor"] = [
                {"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
            ]
        claim["status"] = status
        finalizers = claim["metadata"].setdefault("finalizers", [])
        if "resource.kubernetes.io/delete-protection" not in finalizers:
            finalizers.append("resource.kubernetes.io/delete-protection")
        return store.update(RESOURCE_CLAIM, claim)
    raise Unschedulable(
        f"0/{len(nodes)} nodes are available: {len(nodes)} cannot allocate all claims"
    )


def _place(
    store: Store,
    requests: list[Mapping[str, Any]],
    slices: list[Obj],
    held: dict[tuple[str, str, str], dict[str, Decimal]],
) -> list[Obj] | None:
    """This node's results for every request, or None when one does not fit."""
    local = {k: dict(v) for k, v in held.items()}
    results: list[Obj] = []
    for request in requests:
        options = (
            [(request["name"], request["exactly"])]
            if request.get("exactly")
            else [(f"{request['name']}/{s['name']}", s) for s in request["firstAvailable"]]
        )
        for result_name, exact in options:
            placed = _place_one(store, result_name, exact, slices, local)
            if placed is not None:
                results.extend(placed)
                break
        else:
            return None
    return results


def _place_one(
    store: Store,
    result_name: str,
    exact: Mapping[str, Any],
    slices: list[Obj],
    held: dict[tuple[str, str, str], dict[str, Decimal]],
) -> list[Obj] | None:
    driver = _class_driver(store, exact["deviceClassName"])
    if exact.get("allocationMode", "ExactCount") != "ExactCount":
        raise ValueError("the fake allocator models allocationMode ExactCount only")
    if exact.get("selectors") or exact.get("tolerations") or exact.get("adminAccess"):
        raise ValueError(
            "the fake allocator models no request selectors, tolerations or adminAccess"
        )
    wanted = int(exact.get("count", 1))
    requested = (exact.get("capacity") or {}).get("requests") or {}
    chosen: list[Obj] = []
    staged: dict[tuple[str, str, str], dict[str, Decimal]] = {}
    for obj in slices:
        spec = obj["spec"]
        if spec["driver"] != driver:
            continue
        for device in spec.get("devices") or []:
            if len(chosen) == wanted:
                break
            if any(
                t.get("effect") in ("NoSchedule", "NoExecute") for t in device.get("taints") or []
            ):
                continue
            key = (driver, spec["pool"]["name"], device["name"])
            current = held.get(key, {})
            if "__exclusive__" in current:
                continue
            capacity = device.get("capacity") or {}
            if not device.get("allowMultipleAllocations"):
                if current or requested:
                    continue
                staged[key] = {"__exclusive__": Decimal(1)}
                chosen.append(
                    {
                        "request": result_name,
                        "driver": driver,
                        "pool": spec["pool"]["name"],
                        "device": device["name"],
                    }
                )
                continue
            charges = _charge(capacity, requested)
            if charges is None:
                continue
            if any(
                current.get(n, Decimal(0)) + c > parse_quantity(capacity[n]["value"]).value
                for n, c in charges.items()
            ):
                continue
            staged[key] = charges
            chosen.append(
                {
                    "request": result_name,
                    "driver": driver,
                    "pool": spec["pool"]["name"],
                    "device": device["name"],
                    "shareID": str(uuid.uuid4()),
                    "consumedCapacity": {
                        n: _format_like(capacity[n]["value"], c) for n, c in charges.items()
                    },
                }
            )
    if len(chosen) < wanted:
        return None
    for key, charges in staged.items():
        entry = held.setdefault(key, {})
        for n, c in charges.items():
            entry[n] = entry.get(n, Decimal(0)) + c
    return chosen
