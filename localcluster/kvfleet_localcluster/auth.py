"""Who is asking, and may they: the API server's authentication and RBAC authorization.

Authentication is by bearer token, as on a real cluster: the admin token `cluster up` writes
into the kubeconfig (user `kvfleet-admin`, group `system:masters`), and service-account tokens
the API server issues through the TokenRequest API (`POST .../serviceaccounts/NAME/token`,
what the kubelet asks for each pod's projected volume and `kubectl create token` uses). A
service-account token stops working when its ServiceAccount is deleted. No token, or an
unknown one, is 401 except on the health endpoints.

Authorization is RBAC over the Roles, ClusterRoles, RoleBindings and ClusterRoleBindings in
the store (no aggregation), plus the bootstrap policy every cluster has: `system:masters` may
do anything; every authenticated user may read discovery and OpenAPI and create
self-subject access/rules reviews (`system:discovery`, `system:basic-user`). Pure functions
over the objects they are given.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Json = dict[str, Any]
RBAC_GROUP = "rbac.authorization.k8s.io"
MASTERS = "system:masters"
AUTHENTICATED = "system:authenticated"
PUBLIC_PATHS = ("/healthz", "/livez", "/readyz", "/version")
DISCOVERY_PREFIXES = ("/api", "/apis", "/openapi", "/version", "/healthz", "/livez", "/readyz")
SELF_REVIEWS = {
    ("authorization.k8s.io", "selfsubjectaccessreviews"),
    ("authorization.k8s.io", "selfsubjectrulesreviews"),
    ("authentication.k8s.io", "selfsubjectreviews"),
}


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = ()
    uid: str = ""

    def info(self) -> Json:
        """The `UserInfo` of SelfSubjectReview and audit records."""
        return {"username": self.name, "uid": self.uid, "groups": list(self.groups)}


@dataclass(frozen=True)
class Attributes:
    """What a request asks to do, in RBAC's terms (Kubernetes' RequestInfo)."""

    verb: str
    path: str
    resource_request: bool = False
    group: str = ""
    version: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""

    @property
    def qualified(self) -> str:
        """`pods/log`, `deployments.apps`: how messages name the resource."""
        res = f"{self.resource}.{self.group}" if self.group else self.resource
        return f"{res}/{self.subresource}" if self.subresource else res


_METHOD_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch", "HEAD": "get"}


STREAMING_SUBRESOURCES = frozenset({"portforward", "exec", "attach"})


def request_attributes(method: str, path: str, query: Mapping[str, str]) -> Attributes:
    """Parse an API path as the API server does: `/api/v1/namespaces/NS/pods/NAME/log` →
    get pods/log NAME in NS; anything that is not an object path is a non-resource URL."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 2:
        group, version, rest = "", parts[1], parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return Attributes(verb=method.lower(), path=path)
    if not rest:  # /api/v1, /apis/apps/v1: discovery
        return Attributes(verb=method.lower(), path=path)
    namespace = ""
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    elif rest[0] == "namespaces" and len(rest) == 2:
        namespace = rest[1]  # a namespace is in itself, as the real RequestInfo has it
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else ""
    sub = "/".join(rest[2:])
    if method == "GET":
        watching = query.get("watch") in ("true", "1")
        verb = "watch" if watching else ("get" if name else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = _METHOD_VERBS.get(method, method.lower())
    if resource == "pods" and sub in STREAMING_SUBRESOURCES:
        # A SPDY POST or a WebSocket GET: the API server authorizes both as `create`.
        verb = "create"
    return Attributes(verb, path, True, group, version, resource, sub, namespace, name)


# ---- authentication ---------------------------------------------------------------------------
@dataclass
class Authenticator:
    """Bearer tokens → users. Service-account tokens are checked against the store each time,
    so deleting a ServiceAccount revokes its tokens."""

    service_account_exists: Callable[[str, str], bool]
    static: dict[str, User] = field(default_factory=dict)
    _issued: dict[str, tuple[str, str]] = field(default_factory=dict)

    def add_user(self, user: User) -> str:
        token = secrets.token_urlsafe(32)
        self.static[token] = user
        return token

    def issue_service_account_token(self, namespace: str, name: str) -> str:
        token = f"kvfsa.{secrets.token_urlsafe(32)}"
        self._issued[token] = (namespace, name)
        return token

    def authenticate(self, authorization: str | None) -> User | None:
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        if token in self.static:
            return self.static[token]
        issued = self._issued.get(token)
        if issued is None or not self.service_account_exists(*issued):
            return None
        return service_account_user(*issued)


def service_account_user(namespace: str, name: str) -> User:
    return User(
        f"system:serviceaccount:{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED),
    )


# ---- authorization ------------------------------------------------------------------------
@dataclass(frozen=True)
class Policy:
    """The RBAC objects of the cluster, as lists of objects."""

    roles: list[Json]
    cluster_roles: list[Json]
    role_bindings: list[Json]
    cluster_role_bindings: list[Json]


def _subject_matches(subject: Json, user: User, binding_ns: str) -> bool:
    kind, name = subject.get("kind"), subject.get("name")
    if kind == "User":
        return bool(name == user.name)
    if kind == "Group":
        return name in user.groups
    if kind == "ServiceAccount":
        ns = subject.get("namespace") or binding_ns
        return user.name == f"system:serviceaccount:{ns}:{name}"
    return False


def _matches(patterns: Iterable[str], value: str) -> bool:
    patterns = list(patterns or ())
    return "*" in patterns or value in patterns


def rule_allows(rule: Json, attrs: Attributes) -> bool:
    if not _matches(rule.get("verbs") or (), attrs.verb):
        return False
    if not attrs.resource_request:
        return any(
            url == attrs.path
            or url == "*"
            or (url.endswith("*") and attrs.path.startswith(url[:-1]))
            for url in rule.get("nonResourceURLs") or ()
        )
    if not _matches(rule.get("apiGroups") or (), attrs.group):
        return False
    resources = rule.get("resources") or ()
    wanted = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    if not (
        "*" in resources
        or wanted in resources
        or (attrs.subresource and f"*/{attrs.subresource}" in resources)
    ):
        return False
    names = rule.get("resourceNames") or ()
    return not names or attrs.name in names


def bootstrap_allows(user: User, attrs: Attributes) -> bool:
    if MASTERS in user.groups:
        return True
    if not attrs.resource_request:
        return attrs.verb in ("get", "head") and attrs.path.startswith(DISCOVERY_PREFIXES)
    return attrs.verb == "create" and (attrs.group, attrs.resource) in SELF_REVIEWS


def _role_rules(policy: Policy, ref: Json, binding_ns: str) -> list[Json]:
    name = ref.get("name")
    if ref.get("kind") == "ClusterRole":
        pool = policy.cluster_roles
        found = [r for r in pool if r["metadata"]["name"] == name]
    else:
        found = [
            r
            for r in policy.roles
            if r["metadata"]["name"] == name and r["metadata"].get("namespace") == binding_ns
        ]
    return [rule for role in found for rule in role.get("rules") or []]


def rules_for(user: User, policy: Policy, namespace: str) -> list[Json]:
    """Every rule that applies to `user` in `namespace` ("" = cluster-scoped only)."""
    rules: list[Json] = []
    for b in policy.cluster_role_bindings:
        if any(_subject_matches(s, user, "") for s in b.get("subjects") or []):
            rules += _role_rules(policy, b.get("roleRef") or {}, "")
    if namespace:
        for b in policy.role_bindings:
            ns = b["metadata"].get("namespace", "")
            if ns == namespace and any(
                _subject_matches(s, user, ns) for s in b.get("subjects") or []
            ):
                rules += _role_rules(policy, b.get("roleRef") or {}, ns)
    return rules


def authorize(user: User, attrs: Attributes, policy: Policy) -> tuple[bool, str]:
    """(allowed, reason) — the reason names the binding kind that allowed it, or says why not."""
    if bootstrap_allows(user, attrs):
        return True, "bootstrap policy"
    for rule in rules_for(user, policy, attrs.namespace):
        if rule_allows(rule, attrs):
            return True, "RBAC: allowed by a role bound to the user"
    return False, ""


def forbidden_message(user: User, attrs: Attributes) -> str:
    """The API server's wording, which kubectl prints as is."""
    if not attrs.resource_request:
        return f'forbidden: User "{user.name}" cannot {attrs.verb} path "{attrs.path}"'
    what = f'{attrs.qualified} "{attrs.name}"' if attrs.name else attrs.qualified
    res = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    where = f'in the namespace "{attrs.namespace}"' if attrs.namespace else "at the cluster scope"
    return (
        f'{what} is forbidden: User "{user.name}" cannot {attrs.verb} resource "{res}" '
        f'in API group "{attrs.group}" {where}'
    )


def review_attributes(spec: Json) -> Attributes:
    """A SubjectAccessReview's `resourceAttributes` / `nonResourceAttributes`."""
    res = spec.get("resourceAttributes")
    if res:
        return Attributes(
            verb=res.get("verb", ""),
            path="",
            resource_request=True,
            group=res.get("group", ""),
            version=res.get("version", ""),
            resource=res.get("resource", ""),
            subresource=res.get("subresource", ""),
            namespace=res.get("namespace", ""),
            name=res.get("name", ""),
        )
    non = spec.get("nonResourceAttributes") or {}
    return Attributes(verb=non.get("verb", ""), path=non.get("path", ""))


def _expand(rule: Json, namespace: str) -> list[Attributes]:
    """Every (verb, group, resource, name) a rule grants, literally ("*" stays "*")."""
    out: list[Attributes] = []
    for verb in rule.get("verbs") or ():
        for url in rule.get("nonResourceURLs") or ():
            out.append(Attributes(verb=verb, path=url))
        for group in rule.get("apiGroups") or ():
            for res in rule.get("resources") or ():
                resource, _, sub = res.partition("/")
                for name in rule.get("resourceNames") or [""]:
                    out.append(
                        Attributes(verb, "", True, group, "", resource, sub, namespace, name)
                    )
    return out


def escalations(user: User, policy: Policy, rules: list[Json], namespace: str) -> list[str]:
    """What `rules` grant that `user` does not hold in `namespace` ("" = cluster-wide): the
    API server refuses to let anyone create a role, or bind one, beyond their own rights
    (RBAC's privilege-escalation prevention), unless they may `escalate` / `bind`."""
    if MASTERS in user.groups:
        return []
    held = rules_for(user, policy, namespace)
    missing = []
    for wanted in (a for rule in rules for a in _expand(rule, namespace)):
        if not any(rule_allows(h, wanted) for h in held):
            what = wanted.path or wanted.qualified
            missing.append(f"{wanted.verb} {what}" + (f" {wanted.name}" if wanted.name else ""))
    return missing


# ---- impersonation ------------------------------------------------------------------------
def impersonation_checks(user_name: str, groups: tuple[str, ...]) -> list[Attributes]:
    """What the requester must be allowed before acting as `user_name` (kubectl `--as`,
    `--as-group`): `impersonate` on the user (a ServiceAccount by its namespace and name) and
    on each group, as kube-apiserver's impersonation filter asks."""
    prefix = "system:serviceaccount:"
    if user_name.startswith(prefix) and user_name.count(":") == 3:
        ns, name = user_name[len(prefix) :].split(":")
        checks = [Attributes("impersonate", "", True, "", "v1", "serviceaccounts", "", ns, name)]
    else:
        checks = [Attributes("impersonate", "", True, "", "v1", "users", "", "", user_name)]
    return checks + [
        Attributes("impersonate", "", True, "", "v1", "groups", "", "", g) for g in groups
    ]


def impersonated(user_name: str, groups: tuple[str, ...]) -> User:
    """The user a request acts as once impersonation is allowed: a ServiceAccount gets its
    groups; everyone is `system:authenticated`."""
    prefix = "system:serviceaccount:"
    if user_name.startswith(prefix) and user_name.count(":") == 3:
        ns, name = user_name[len(prefix) :].split(":")
        base = service_account_user(ns, name)
        return User(base.name, tuple(dict.fromkeys(base.groups + groups)))
    return User(user_name, tuple(dict.fromkeys((*groups, AUTHENTICATED))))
