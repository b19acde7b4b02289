"""AdmissionReview (``admission.k8s.io/v1`` and ``v1beta1``) as typed models.

Only what kube-apiserver sends and checks is modelled (design K1). Objects stay plain
dicts: the webhook patches the JSON the apiserver sent, so round-tripping it through typed Pod
models would risk dropping fields we do not know.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel
from pydantic_core import to_json

API_GROUP = "admission.k8s.io"
VERSIONS = ("v1", "v1beta1")
Operation = Literal["CREATE", "UPDATE", "DELETE", "CONNECT"]


class _Wire(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class GroupVersionKind(_Wire):
    group: str = ""
    version: str = ""
    kind: str = ""


class GroupVersionResource(_Wire):
    group: str = ""
    version: str = ""
    resource: str = ""


class UserInfo(_Wire):
    username: str = ""
    uid: str = ""
    groups: list[str] = Field(default_factory=list)
    extra: dict[str, list[str]] = Field(default_factory=dict)


class AdmissionRequest(_Wire):
    uid: str = Field(min_length=1)
    kind: GroupVersionKind
    resource: GroupVersionResource = Field(default_factory=GroupVersionResource)
    sub_resource: str = ""
    name: str = ""
    namespace: str = ""
    operation: Operation
    user_info: UserInfo = Field(default_factory=UserInfo)
    object: dict[str, Any] | None = None
    old_object: dict[str, Any] | None = None
    dry_run: bool = False
    options: dict[str, Any] | None = None

    @field_validator("dry_run", mode="before")
    @classmethod
    def _null_is_false(cls, value: Any) -> Any:
        return False if value is None else value

    @property
    def display_name(self) -> str:
        """A name for logs and messages: controller-made pods only have ``generateName``."""
        meta = (self.object or {}).get("metadata") or {}
        if not isinstance(meta, dict):
            return self.name or "?"
        return self.name or meta.get("name") or f"{meta.get('generateName') or ''}<generated>"


class Status(_Wire):
    status: str = "Failure"
    message: str = ""
    reason: str = ""
    code: int = 403


class AdmissionResponse(_Wire):
    uid: str
    allowed: bool
    status: Status | None = None
    patch: str | None = None  # base64 of an RFC 6902 JSON Patch
    patch_type: Literal["JSONPatch"] | None = None
    warnings: list[str] | None = None
    audit_annotations: dict[str, str] | None = None
    # Why, in a few fixed words, for metrics and logs; never sent to the apiserver.
    label: str = Field(default="", exclude=True)

    @classmethod
    def allow(
        cls,
        uid: str,
        patch: list[dict[str, Any]] | None = None,
        warnings: list[str] | None = None,
        *,
        label: str = "",
    ) -> AdmissionResponse:
        """Allow, with a patch only when there is something to change (an empty patch is noise)."""
        encoded = None
        if patch:
            encoded = base64.b64encode(to_json(patch)).decode()
        # Built from values we made ourselves: skip validation on the admission hot path.
        return cls.model_construct(
            uid=uid,
            allowed=True,
            status=None,
            patch=encoded,
            patch_type="JSONPatch" if encoded else None,
            warnings=warnings or None,
            audit_annotations=None,
            label=label or ("mutated" if encoded else "unchanged"),
        )

    @classmethod
    def deny(
        cls,
        uid: str,
        message: str,
        *,
        code: int = 403,
        reason: str = "Forbidden",
        warnings: list[str] | None = None,
        label: str = "",
    ) -> AdmissionResponse:
        """Deny with a standard reason (kubectl prints it in parentheses) and a human message."""
        return cls(
            uid=uid,
            allowed=False,
            status=Status(message=message, reason=reason, code=code),
            warnings=warnings or None,
            label=label or reason.lower(),
        )

    def decoded_patch(self) -> list[dict[str, Any]]:
        if self.patch is None:
            return []
        result: list[dict[str, Any]] = json.loads(base64.b64decode(self.patch))
        return result


class ReviewError(ValueError):
    """The body is not an AdmissionReview the apiserver could have sent (answered with HTTP 400)."""


def _not_a_review(exc: ValidationError) -> ReviewError:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "body"
    return ReviewError(f"not an AdmissionReview: {where}: {first['msg']}")


class AdmissionReview(_Wire):
    api_version: str
    kind: Literal["AdmissionReview"]
    request: AdmissionRequest | None = None
    response: AdmissionResponse | None = None

    @field_validator("api_version")
    @classmethod
    def _known_version(cls, value: str) -> str:
        if value not in {f"{API_GROUP}/{v}" for v in VERSIONS}:
            raise ValueError(f"unsupported apiVersion {value!r}; expected admission.k8s.io/v1")
        return value

    @classmethod
    def parse(cls, body: bytes) -> AdmissionReview:
        """Parse a request body; every failure is a :class:`ReviewError` with a readable cause."""
        try:
            review = cls.model_validate_json(body)
        except ValidationError as exc:
            raise _not_a_review(exc) from None
        return review._with_request()

    @classmethod
    def from_value(cls, value: Any) -> AdmissionReview:
        """The same as :meth:`parse` for a body already parsed as JSON (large bodies are
        parsed in pieces as they arrive, ``webhook.jsonstream``)."""
        try:
            review = cls.model_validate(value)
        except ValidationError as exc:
            raise _not_a_review(exc) from None
        return review._with_request()

    def _with_request(self) -> AdmissionReview:
        if self.request is None:
            raise ReviewError("not an AdmissionReview: request is missing")
        return self

    def reply(self, response: AdmissionResponse) -> bytes:
        """The reply in the same version as the request (the apiserver requires it)."""
        body = {
            "apiVersion": self.api_version,
            "kind": "AdmissionReview",
            "response": response.model_dump(by_alias=True, exclude_none=True),
        }
        return to_json(body)
