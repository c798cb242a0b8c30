"""The API server's endpoints about identity and access, over `auth.py`'s pure functions.

* `SelfSubjectAccessReview` (`kubectl auth can-i VERB RESOURCE`), `SelfSubjectRulesReview`
  (`kubectl auth can-i --list`), `SelfSubjectReview` (`kubectl auth whoami`) and
  `SubjectAccessReview` (may a given user …, for those allowed to ask);
* `TokenRequest` (`POST .../serviceaccounts/NAME/token`, `kubectl create token NAME`): a
  token for a ServiceAccount that exists.
"""

from __future__ import annotations

import datetime
from typing import Any

from kvfleet_localcluster.apitypes import ApiError
from kvfleet_localcluster.auth import (
    SELF_REVIEWS,
    Attributes,
    Authenticator,
    Policy,
    User,
    authorize,
    review_attributes,
    rules_for,
)
from kvfleet_localcluster.store import Store

Json = dict[str, Any]
REVIEWS = SELF_REVIEWS | {("authorization.k8s.io", "subjectaccessreviews")}
"""The reviews served here: everyone's own, and SubjectAccessReview (by RBAC, for admins)."""
TOKEN_SECONDS = 3600


def policy(store: Store) -> Policy:
    g = "rbac.authorization.k8s.io"
    return Policy(
        roles=store.peek(g, "roles"),
        cluster_roles=store.peek(g, "clusterroles"),
        role_bindings=store.peek(g, "rolebindings"),
        cluster_role_bindings=store.peek(g, "clusterrolebindings"),
    )


def review(user: User, attrs: Attributes, body: Any, store: Store) -> Json:
    """Answer a review request (`attrs` is the POST that carried it)."""
    if not isinstance(body, dict):
        raise ApiError(400, "BadRequest", "the request body must be a JSON object")
    spec = body.get("spec") or {}
    out: Json = {
        "apiVersion": body.get("apiVersion") or f"{attrs.group}/{attrs.version}",
        "kind": body.get("kind") or "",
        "metadata": {"creationTimestamp": None},
        "spec": spec,
    }
    if attrs.resource == "selfsubjectreviews":
        out["status"] = {"userInfo": user.info()}
        return out
    if attrs.resource == "selfsubjectrulesreviews":
        out["status"] = _rules_status(user, spec.get("namespace") or "", store)
        return out
    subject = user
    if attrs.resource == "subjectaccessreviews":
        subject = User(spec.get("user") or "", tuple(spec.get("groups") or ()), spec.get("uid", ""))
    asked = review_attributes(spec)
    allowed, reason = authorize(subject, asked, policy(store))
    out["status"] = {"allowed": allowed, **({"reason": reason} if reason else {})}
    return out


def _rules_status(user: User, namespace: str, store: Store) -> Json:
    rules = rules_for(user, policy(store), namespace)
    resource_rules = [
        {
            "verbs": r.get("verbs") or [],
            "apiGroups": r.get("apiGroups") or [],
            "resources": r.get("resources") or [],
            **({"resourceNames": r["resourceNames"]} if r.get("resourceNames") else {}),
        }
        for r in rules
        if r.get("resources")
    ]
    non_resource = [
        {"verbs": r.get("verbs") or [], "nonResourceURLs": r["nonResourceURLs"]}
        for r in rules
        if r.get("nonResourceURLs")
    ]
    bootstrap = [
        {
            "verbs": ["create"],
            "apiGroups": ["authorization.k8s.io"],
            "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
        },
        {
            "verbs": ["create"],
            "apiGroups": ["authentication.k8s.io"],
            "resources": ["selfsubjectreviews"],
        },
    ]
    if "system:masters" in user.groups:
        bootstrap.append({"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"]})
        non_resource.append({"verbs": ["*"], "nonResourceURLs": ["*"]})
    non_resource.append(
        {"verbs": ["get"], "nonResourceURLs": ["/api", "/api/*", "/apis", "/apis/*", "/version"]}
    )
    return {
        "resourceRules": bootstrap + resource_rules,
        "nonResourceRules": non_resource,
        "incomplete": False,
    }


def token_request(authn: Authenticator, store: Store, namespace: str, name: str, body: Any) -> Json:
    if not store.exists("", "serviceaccounts", namespace, name):
        raise ApiError(404, "NotFound", f'serviceaccounts "{name}" not found')
    spec = (body or {}).get("spec") or {} if isinstance(body, dict) else {}
    seconds = int(spec.get("expirationSeconds") or TOKEN_SECONDS)
    token = authn.issue_service_account_token(namespace, name)
    expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds)
    return {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "metadata": {"name": name, "namespace": namespace, "creationTimestamp": None},
        "spec": {"audiences": spec.get("audiences") or [], "expirationSeconds": seconds},
        "status": {
            "token": token,
            "expirationTimestamp": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
    }
