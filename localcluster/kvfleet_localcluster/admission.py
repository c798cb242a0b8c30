"""Admission: what the API server checks and defaults on every write before storing it.

* custom resources: their CRD's structural schema (defaults, pruning, types, CEL rules), with
  `fieldValidation` Strict (unknown fields are a 400) or Warn (a Warning header each);
* built-in kinds: the same unknown-field check at every depth, against the structs of the
  Kubernetes version the cluster reports (`builtin_fields`), as the strict decoder does, and
  zero values of `omitempty` fields left out, as the encoder leaves them out;
* pods: the ServiceAccount admission plugin (a new pod runs as an account that exists; every
  namespace gets its `default` account, as the ServiceAccount controller makes it);
* RBAC objects: escalation prevention — no one grants, by a role or a binding, more than they
  hold, unless they may `escalate` / `bind`.

The write being served is known through context variables the API server sets per request.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfleet_localcluster import access, builtin_fields
from kvfleet_localcluster.apitypes import ApiError, Kind
from kvfleet_localcluster.auth import RBAC_GROUP, Attributes, User, authorize, escalations
from kvfleet_localcluster.defaults import default_builtin
from kvfleet_localcluster.store import Store
from kvfleet_localcluster.validation import apply_defaults, causes, validate


@dataclass
class WriteContext:
    """What the admission of the write being served needs from its request."""

    validation: str = "Warn"
    unknown: list[str] = field(default_factory=list)
    user: User | None = None
    """Who writes (None: the cluster's own controllers)."""


WRITE: contextvars.ContextVar[WriteContext] = contextvars.ContextVar("write")
USER: contextvars.ContextVar[User | None] = contextvars.ContextVar("user")


def _strict_decoding_error(kind: Kind, unknown: list[str]) -> ApiError:
    """What kube-apiserver answers a Strict write with fields its decoder does not know."""
    fields = ", ".join(f'unknown field "{u}"' for u in unknown)
    return ApiError(
        400,
        "BadRequest",
        f'{kind.kind} in version "{kind.version}" cannot be handled as a {kind.kind}: '
        f"strict decoding error: {fields}",
    )


@dataclass
class Admission:
    store: Store
    schemas: dict[tuple[str, str, str], dict[str, Any]]
    """(group, version, plural) → the CRD's openAPIV3Schema."""
    kind_of: Callable[[str, str, str], Kind]
    validate_custom_resources: Callable[[], bool]

    def custom_resource(self, kind: Kind, obj: dict[str, Any], subresource: str | None) -> None:
        schema = self.schemas.get((kind.group, kind.version, kind.plural))
        if schema is None or not self.validate_custom_resources():
            return
        errors: list[str] = []
        write = WRITE.get(WriteContext())
        unknown: list[str] = []
        # Main writes check the spec (status is carried over), status writes the status.
        for part in ("status",) if subresource == "status" else ("spec",):
            sub = (schema.get("properties") or {}).get(part)
            if sub is not None and part in obj:
                apply_defaults(sub, obj[part])
                errors += validate(sub, obj[part], part, unknown)
        name = (obj.get("metadata") or {}).get("name", "")
        if subresource != "status" and schema.get("x-kubernetes-validations"):
            # Rules on the root see the object's name (and generateName), as in Kubernetes.
            meta = {k: v for k, v in (obj.get("metadata") or {}).items()
                    if k in ("name", "generateName")}  # fmt: skip
            root = {"metadata": meta, **({"spec": obj["spec"]} if "spec" in obj else {})}
            rules = {"x-kubernetes-validations": schema["x-kubernetes-validations"]}
            errors += [e.lstrip(".") for e in validate(rules, root, "")]
        if unknown and write.validation == "Strict":
            raise _strict_decoding_error(kind, unknown)
        write.unknown += unknown
        if errors:
            raise ApiError(
                422,
                "Invalid",
                f'{kind.kind}.{kind.group} "{name}" is invalid: ' + ", ".join(errors),
                {"name": name, "group": kind.group, "kind": kind.kind, "causes": causes(errors)},
            )

    def builtin_kind(self, kind: Kind, obj: dict[str, Any], subresource: str | None) -> None:
        """Unknown fields of a built-in kind written by a client: dropped, and a 400 under
        Strict, a Warning under Warn, nothing under Ignore (the cluster's own controllers
        write through the store directly)."""
        write = WRITE.get(None)
        if write is None or subresource not in (None, "status"):
            return
        if (kind.group, kind.version, kind.plural) in self.schemas:
            return  # a custom resource: its CRD's schema decides
        unknown = builtin_fields.drop_unknown_fields(kind.group, kind.version, kind.kind, obj)
        if unknown and write.validation == "Strict":
            raise _strict_decoding_error(kind, unknown)
        write.unknown += unknown

    def defaults(self, kind: Kind, obj: dict[str, Any], subresource: str | None) -> None:
        """A built-in kind's API defaults, filled in on every write (`defaults.py`)."""
        if subresource in (None, "status") and (kind.group, kind.version, kind.plural) not in (
            self.schemas
        ):
            default_builtin(kind.group, kind.plural, obj)

    def encode_builtin(self, kind: Kind, obj: dict[str, Any], subresource: str | None) -> None:
        """What the server stores and returns of a built-in kind: without the zero values of
        `omitempty` fields, whoever wrote them (its encoder drops them on every write)."""
        if subresource not in (None, "status"):
            return
        if (kind.group, kind.version, kind.plural) not in self.schemas:
            builtin_fields.drop_omitted(kind.group, kind.version, kind.kind, obj)

    def ensure_default_service_account(self, namespace: str) -> None:
        """The ServiceAccount controller's job: every namespace has a `default` account."""
        if not self.store.exists("", "serviceaccounts", namespace, "default"):
            kind = self.kind_of("", "v1", "serviceaccounts")
            self.store.create(kind, namespace, {"metadata": {"name": "default"}})

    def pod(self, kind: Kind, obj: dict[str, Any], subresource: str | None) -> None:
        """The ServiceAccount admission plugin: a new pod runs as an account that exists."""
        meta = obj.get("metadata") or {}
        if kind.key != ("", "pods") or subresource or "uid" in meta:
            return
        ns = meta.get("namespace", "default")
        account = (obj.get("spec") or {}).get("serviceAccountName") or "default"
        if account == "default":
            self.ensure_default_service_account(ns)
        elif not self.store.exists("", "serviceaccounts", ns, account):
            raise ApiError(
                403,
                "Forbidden",
                f'pods "{meta.get("name") or meta.get("generateName", "")}" is forbidden: '
                f'error looking up service account {ns}/{account}: serviceaccount "{account}" '
                "not found",
            )

    def rbac(self, kind: Kind, obj: dict[str, Any], subresource: str | None) -> None:
        """No one grants, by a role or a binding, more than they hold (unless they may
        `escalate` / `bind`), as RBAC's escalation prevention refuses."""
        write = WRITE.get(WriteContext())
        user = write.user
        if user is None or kind.group != RBAC_GROUP or subresource:
            return
        meta = obj.get("metadata") or {}
        ns = meta.get("namespace", "") if kind.namespaced else ""
        policy = access.policy(self.store)
        if kind.plural in ("roles", "clusterroles"):
            granted, verb, target = obj.get("rules") or [], "escalate", kind.plural
            role_name = meta.get("name", "")
        elif kind.plural in ("rolebindings", "clusterrolebindings"):
            ref = obj.get("roleRef") or {}
            role_name = ref.get("name", "")
            if ref.get("kind") == "ClusterRole":
                role = self.store.peek(RBAC_GROUP, "clusterroles")
                found = [r for r in role if r["metadata"]["name"] == role_name]
                target = "clusterroles"
            else:
                found = [r for r in self.store.peek(RBAC_GROUP, "roles", ns)]
                found = [r for r in found if r["metadata"]["name"] == role_name]
                target = "roles"
            granted, verb = [rule for r in found for rule in r.get("rules") or []], "bind"
            if not found:
                granted = [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"]}]
        else:
            return
        allowed, _ = authorize(
            user, Attributes(verb, "", True, RBAC_GROUP, "", target, "", ns, role_name), policy
        )
        missing = [] if allowed else escalations(user, policy, granted, ns)
        if missing:
            raise ApiError(
                403,
                "Forbidden",
                f'{kind.plural}.{RBAC_GROUP} "{meta.get("name", "")}" is forbidden: user '
                f'"{user.name}" is attempting to grant RBAC permissions not currently held: '
                + "; ".join(missing[:10]),
            )
