"""How fracgpu's components talk to Kubernetes: a client factory, raw JSON calls, typed errors
and where each kind lives (``Resource``); the informer is ``core.informer``.

Objects stay plain dicts with the field names as on the wire (`metadata.resourceVersion`), read
as raw JSON (`_preload_content=False`): faster than kubernetes-asyncio's model classes, and the
same shape the admission webhook receives.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import aiohttp
import aiohttp.helpers
import yarl
from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client import ApiClient, Configuration

from core.units import DOMAIN

log = logging.getLogger(__name__)

Obj = dict[str, Any]
"""A JSON object as the API server sends it (a list, a Status, an object of any kind)."""


class RawMeta(TypedDict, total=False):
    """The ``metadata`` fields fracgpu reads. Objects stay plain dicts (unknown fields are kept,
    never dropped); these types only let the checker catch a misspelt key."""

    name: str
    generateName: str
    namespace: str
    uid: str
    resourceVersion: str
    generation: int
    labels: dict[str, str]
    annotations: dict[str, str]
    ownerReferences: list[dict[str, Any]]
    deletionTimestamp: str
    creationTimestamp: str


class RawBody(TypedDict, total=False):
    """One Kubernetes object as fracgpu reads it: a Pod, a Node, a GPUQuota, a Secret…"""

    apiVersion: str
    kind: str
    metadata: RawMeta
    spec: dict[str, Any]
    status: dict[str, Any]
    data: dict[str, str]


Key = tuple[str, str]  # (namespace or "", name)
Api = ApiClient
"""The client every component uses, made by :func:`kube_client` (kubernetes-asyncio ships no types,
so this alias names the intent where ``Any`` would not)."""


class KubeConfigError(RuntimeError):
    """No way to reach a cluster was configured."""


class KubeError(Exception):
    """The API server answered with a failure `Status` (or something that is not JSON)."""

    def __init__(self, status: int, reason: str, message: str, body: Obj | None = None) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body or {}


class KubeNotFound(KubeError):
    """404: the object (or its kind: a CRD that is not installed) does not exist."""


class KubeConflict(KubeError):
    """409: the object changed since it was read, or already exists; re-read and retry."""


class KubeUnavailable(Exception):
    """The API server gave no usable answer: a failure other than 404 and 409, no answer in
    time, or no connection. The message says which; the caller may retry."""


class KubeGone(KubeError):
    """410: the resourceVersion or continue token was compacted away; only a fresh list helps."""


class KubeInvalid(KubeError):
    """422: the API server's validation refused the object; the message says which field."""


_BY_CODE: dict[int, type[KubeError]] = {
    404: KubeNotFound,
    409: KubeConflict,
    410: KubeGone,
    422: KubeInvalid,
}


def status_error(status: int, body: Mapping[str, Any] | None, raw: bytes = b"") -> KubeError:
    """The typed error for an HTTP failure or a watch ERROR event (one parser for both).

    A ``Status`` body's own ``code`` wins over the HTTP status: a watch stream reports failures
    inside an HTTP 200.
    """
    if isinstance(body, Mapping) and body.get("kind", "Status") == "Status" and body:
        code = int(body.get("code") or status)
        reason, message = str(body.get("reason") or ""), str(body.get("message") or "")
        return _BY_CODE.get(code, KubeError)(code, reason, message, dict(body))
    return _BY_CODE.get(status, KubeError)(status, "Unknown", raw[:200].decode("utf-8", "replace"))


# --- client factory ---------------------------------------------------------------------------


async def load_configuration(
    kubeconfig: Path | str | None = None, context: str | None = None
) -> Any:
    """A kubernetes-asyncio Configuration, from the first source that exists:
    the given kubeconfig path; in-cluster (service account); $KUBECONFIG; ~/.kube/config."""
    configuration = Configuration()
    path = _kubeconfig_path(kubeconfig)
    if path is None:
        load_incluster: Any = kube_config.load_incluster_config  # untyped upstream
        load_incluster(client_configuration=configuration)
        return configuration
    await kube_config.load_kube_config(
        config_file=str(path),
        context=context,
        client_configuration=configuration,
        persist_config=False,
    )
    return configuration


def _kubeconfig_path(kubeconfig: Path | str | None) -> Path | None:
    """The kubeconfig to read, or None for in-cluster configuration."""
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        return None
    candidates: list[Path] = []
    if kubeconfig is not None:
        candidates.append(Path(kubeconfig))
    else:
        env = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
        candidates += [Path(env)] if env else []
        candidates.append(Path("~/.kube/config").expanduser())
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    if kubeconfig is not None:
        raise KubeConfigError(
            f"kubeconfig {str(kubeconfig)!r} does not exist; pass an existing path"
        )
    env_text = os.environ.get("KUBECONFIG")
    env_note = f"KUBECONFIG={env_text!r} names no file" if env_text else "KUBECONFIG unset"
    raise KubeConfigError(
        "no Kubernetes configuration: not running in a pod (KUBERNETES_SERVICE_HOST unset), "
        f"no kubeconfig given, {env_note} and ~/.kube/config absent; pass a kubeconfig "
        "path or run in-cluster"
    )


def api_client(configuration: Configuration) -> Any:
    """An ApiClient whose requests do not each look up the environment.

    kubernetes-asyncio opens its aiohttp session with ``trust_env=True``, which makes every
    request read the proxy variables and ``~/.netrc`` in a worker thread: two thread hand-offs
    per API call, on the path of every quota decision. The proxy is resolved here once instead
    (``HTTPS_PROXY``/``NO_PROXY``, as client-go honours them; a proxy in the kubeconfig wins),
    and netrc, which Kubernetes clients do not use, not at all.
    """
    client = ApiClient(configuration=configuration)
    rest = client.rest_client
    if not rest.proxy and configuration.host:
        with suppress(LookupError, ValueError):
            proxy, auth = aiohttp.helpers.get_env_proxy_for_url(yarl.URL(configuration.host))
            rest.proxy = str(proxy)
            if auth is not None:
                rest.proxy_headers = {"Proxy-Authorization": auth.encode()}
    env_session = rest.pool_manager
    rest.pool_manager = aiohttp.ClientSession(
        connector=env_session.connector,
        trust_env=False,
        read_bufsize=2**21,  # as kubernetes-asyncio: watch events of large objects
    )
    env_session.detach()  # the connector now belongs to the new session
    return client


@asynccontextmanager
async def kube_client(
    kubeconfig: Path | str | None = None, context: str | None = None
) -> AsyncIterator[Any]:
    """`async with kube_client(path) as api:` an ApiClient, closed (connections too) on exit."""
    configuration = await load_configuration(kubeconfig, context)
    client = api_client(configuration)
    try:
        yield client
    finally:
        await client.close()


# --- raw calls --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resource:
    """Where a kind lives on the API server."""

    group: str  # "" for the core group
    version: str
    plural: str
    namespaced: bool

    def path(self, namespace: str | None = None, name: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace is not None:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        return base if name is None else f"{base}/{name}"


PODS = Resource("", "v1", "pods", namespaced=True)
NODES = Resource("", "v1", "nodes", namespaced=False)
NAMESPACES = Resource("", "v1", "namespaces", namespaced=False)
SECRETS = Resource("", "v1", "secrets", namespaced=True)
EVENTS = Resource("", "v1", "events", namespaced=True)
LEASES = Resource("coordination.k8s.io", "v1", "leases", namespaced=True)
MUTATING_WEBHOOK_CONFIGURATIONS = Resource(
    "admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations", namespaced=False
)
VALIDATING_WEBHOOK_CONFIGURATIONS = Resource(
    "admissionregistration.k8s.io", "v1", "validatingwebhookconfigurations", namespaced=False
)
GPUQUOTAS = Resource(DOMAIN, "v1", "gpuquotas", namespaced=True)
DEPLOYMENTS = Resource("apps", "v1", "deployments", namespaced=True)
REPLICASETS = Resource("apps", "v1", "replicasets", namespaced=True)
STATEFULSETS = Resource("apps", "v1", "statefulsets", namespaced=True)
DAEMONSETS = Resource("apps", "v1", "daemonsets", namespaced=True)
JOBS = Resource("batch", "v1", "jobs", namespaced=True)
CRONJOBS = Resource("batch", "v1", "cronjobs", namespaced=True)
# Dynamic resource allocation (DRA mode), served by default from Kubernetes 1.34 on.
RESOURCE_SLICES = Resource("resource.k8s.io", "v1", "resourceslices", namespaced=False)
RESOURCE_CLAIMS = Resource("resource.k8s.io", "v1", "resourceclaims", namespaced=True)
RESOURCE_CLAIM_TEMPLATES = Resource(
    "resource.k8s.io", "v1", "resourceclaimtemplates", namespaced=True
)
DEVICE_CLASSES = Resource("resource.k8s.io", "v1", "deviceclasses", namespaced=False)


async def open_request(
    api: Api,
    method: str,
    path: str,
    *,
    query: Sequence[tuple[str, str]] = (),
    body: Any = None,
    content_type: str = "application/json",
    timeout_s: tuple[float, float] | float | None = 30.0,
) -> aiohttp.ClientResponse:
    """Send a request through the ApiClient (its auth, TLS and connection pool) and return the
    raw response unread. Raises KubeError for a non-2xx answer."""
    response: aiohttp.ClientResponse = await api.call_api(
        path,
        method,
        query_params=list(query),
        header_params={"Accept": "application/json", "Content-Type": content_type},
        body=body,
        auth_settings=["BearerToken"],
        _preload_content=False,
        _request_timeout=_client_timeout(timeout_s),
    )
    if not 200 <= response.status < 300:
        raw = await response.read()
        response.release()
        raise _error(response.status, raw)
    return response


async def call_json(
    api: Api,
    method: str,
    path: str,
    *,
    query: Sequence[tuple[str, str]] = (),
    body: Any = None,
    content_type: str = "application/json",
    timeout_s: float = 30.0,
) -> Obj:
    """One request, its JSON answer as a dict. Raises KubeError for a failure."""
    response = await open_request(
        api, method, path, query=query, body=body, content_type=content_type, timeout_s=timeout_s
    )
    try:
        raw = await response.read()
    finally:
        response.release()
    try:
        data = json.loads(raw)
    except ValueError:
        raise KubeError(response.status, "BadResponse", f"not JSON: {raw[:200]!r}") from None
    if not isinstance(data, dict):
        raise KubeError(response.status, "BadResponse", f"not a JSON object: {raw[:200]!r}")
    return data


async def call_answered(
    api: Api, method: str, path: str, *, body: Any = None, timeout_s: float = 30.0
) -> Obj:
    """``call_json`` for callers that act on a missing or changed object and retry the rest:
    KubeNotFound and KubeConflict pass through, every other failure is KubeUnavailable."""
    try:
        return await call_json(api, method, path, body=body, timeout_s=timeout_s)
    except (KubeConflict, KubeNotFound):
        raise
    except KubeError as err:
        raise KubeUnavailable(
            f"the API server answered {err.status} {err.reason}: {err.message}"
        ) from None
    except TimeoutError:
        raise KubeUnavailable(f"the API server did not answer within {timeout_s:g}s") from None
    except (aiohttp.ClientError, OSError) as err:
        raise KubeUnavailable(f"the API server could not be reached ({err})") from None


def _client_timeout(timeout_s: float | tuple[float, float] | None) -> aiohttp.ClientTimeout | None:
    """A total timeout, or (connect, read) for streams that may run long but must not go quiet."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, tuple):
        connect, read = timeout_s
        return aiohttp.ClientTimeout(connect=connect, sock_connect=connect, sock_read=read)
    return aiohttp.ClientTimeout(total=timeout_s)


def _error(status: int, raw: bytes) -> KubeError:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("kind") == "Status":
        return status_error(status, body)
    return status_error(status, None, raw)


def object_key(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
