"""PATCH as the fake API server applies it.

- application/json-patch+json: RFC 6902 (the `jsonpatch` package); a body that is not a list is
  400, an operation that fails (a `test`, a missing path) is 422, as on the real server.
- application/merge-patch+json: RFC 7386.
- application/strategic-merge-patch+json: DEPARTURE: treated as a merge patch, so lists are
  replaced rather than merged by key (containers by name, tolerations); the `$patch`,
  `$retainKeys`, `$deleteFromPrimitiveList`, `$setElementOrder` directives are refused with 400 so
  that no test passes by accident. Custom resources refuse it with 415, as the real server does.
- application/apply-patch+yaml (server-side apply) is not modelled: 415.
"""

from __future__ import annotations

from typing import Any

import jsonpatch

from testkit.apierrors import ApiError, bad_request
from testkit.kinds import Kind

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 merge patch: objects merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def has_directive(patch: Any) -> bool:
    """Does a strategic merge patch use a `$` directive (which a plain merge would mis-apply)?"""
    if isinstance(patch, dict):
        return any(k.startswith("$") or has_directive(v) for k, v in patch.items())
    if isinstance(patch, list):
        return any(has_directive(v) for v in patch)
    return False


def apply_patch(kind: Kind, content_type: str, old: dict[str, Any], patch: Any) -> Any:
    """The patched object (not yet checked: the update path does that)."""
    if content_type == JSON_PATCH:
        try:
            ops = jsonpatch.JsonPatch(patch)
        except (jsonpatch.InvalidJsonPatch, TypeError, AttributeError) as err:
            raise bad_request(f"invalid JSON patch: {err}") from None
        if not isinstance(patch, list):
            raise bad_request(
                "json: cannot unmarshal object into Go value of type jsonpatch.Patch "
                "(a JSON patch must be a list of operations)"
            )
        try:
            patched = ops.apply(old)
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as err:
            raise ApiError(422, "Invalid", f"the JSON patch could not be applied: {err}") from None
    elif content_type in (MERGE_PATCH, STRATEGIC_MERGE_PATCH):
        if content_type == STRATEGIC_MERGE_PATCH and kind.custom:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                "the body of the request was in an unknown format - accepted media types "
                "include: application/json-patch+json, application/merge-patch+json, "
                "application/apply-patch+yaml (strategic merge patch is not supported for "
                "custom resources)",
            )
        if not isinstance(patch, dict):
            raise bad_request("a merge patch must be a JSON object")
        if has_directive(patch):
            raise bad_request(
                "the fake API server treats strategic merge patches as merge patches and does "
                "not implement $-directives ($patch, $retainKeys, $setElementOrder)"
            )
        patched = merge_patch(old, patch)
    else:
        raise ApiError(
            415,
            "UnsupportedMediaType",
            f'the body of the request was in an unknown format ("{content_type}") - accepted '
            "media types include: application/json-patch+json, application/merge-patch+json, "
            "application/strategic-merge-patch+json (server-side apply is not modelled)",
        )
    return patched
