"""The CEL rules of kvfleet's specs, compiled to Python closures over plain JSON values.

The API server evaluates a CRD's `x-kubernetes-validations`; the operator evaluates the same
rules again when it parses a spec (see `schema`). cel-python interprets a rule by walking
its parse tree with CEL-typed copies of the document: about 2 ms a rule, whatever the rule,
so 1,000 tenants' limits cost seconds on the operator's one reconcile worker. This compiles
the subset of CEL the rules are written in (field access, `has`, logic, comparison,
arithmetic, list literals, `in`, `size`, `matches` and the `all`/`exists`/`exists_one`/
`filter`/`map` macros) once per rule, from cel-python's own parse tree, into closures that
read the JSON document as it is: a rule over a list costs a Python loop over it.

A rule using anything else raises `Unsupported` here, and the caller falls back to
cel-python. Errors (a missing field, a type mismatch) raise `CelError`, absorbed by `||` and
`&&` as CEL's commutative logic does (`error || true` is true).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

Env = dict[str, Any]
Fn = Callable[[Env], Any]


class Unsupported(Exception):
    """A construct this compiler does not translate: evaluate the rule with cel-python."""


class CelError(Exception):
    """A rule that cannot be evaluated on this document (CEL's error value)."""


def _tokens(tree: Any) -> list[str]:
    return [str(c) for c in tree.children if not hasattr(c, "data")]


def _trees(tree: Any) -> list[Any]:
    return [c for c in tree.children if hasattr(c, "data")]


def _logic(left: Fn, right: Fn, absorbing: bool) -> Fn:
    """`||` (absorbing True) or `&&` (absorbing False), with CEL's error semantics."""

    def run(env: Env) -> bool:
        try:
            a = _bool(left(env))
        except CelError:
            if _bool(right(env)) is absorbing:
                return absorbing
            raise
        return absorbing if a is absorbing else _bool(right(env))

    return run


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise CelError(f"{value!r} is not a boolean")
    return value


def _number(value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CelError(f"{value!r} is not a number")
    return value


def _compare(op: str) -> Callable[[Any, Any], bool]:
    def ordered(a: Any, b: Any) -> bool:
        both_str = isinstance(a, str) and isinstance(b, str)
        x, y = (a, b) if both_str else (_number(a), _number(b))
        return {"<": x < y, "<=": x <= y, ">": x > y, ">=": x >= y}[op]

    def equal(a: Any, b: Any) -> bool:
        return (a == b and type(a) is type(b)) or (
            not isinstance(a, bool) and not isinstance(b, bool) and
            isinstance(a, int | float) and isinstance(b, int | float) and a == b
        )  # fmt: skip

    def contains(a: Any, b: Any) -> bool:
        if not isinstance(b, list | dict):
            raise CelError("'in' needs a list or a map")
        if isinstance(a, str):  # a string equals strings only: Python's `in` is CEL's here
            return a in b
        return any(equal(a, v) for v in b)

    return {"==": equal, "!=": lambda a, b: not equal(a, b), "in": contains}.get(op, ordered)


_REL = {"relation_eq": "==", "relation_ne": "!=", "relation_lt": "<", "relation_le": "<=",
        "relation_gt": ">", "relation_ge": ">=", "relation_in": "in"}  # fmt: skip


def _arith(op: str, left: Fn, right: Fn) -> Fn:
    def run(env: Env) -> Any:
        a, b = left(env), right(env)
        if op == "+" and isinstance(a, str) and isinstance(b, str):
            return a + b
        if op == "+" and isinstance(a, list) and isinstance(b, list):
            return a + b
        x, y = _number(a), _number(b)
        if op in ("%", "/") and y == 0:
            raise CelError("division by zero")
        both_int = isinstance(x, int) and isinstance(y, int)
        if op == "%":  # CEL truncates toward zero, as Go does
            if not both_int:
                raise CelError("% needs integers")
            return x - y * int(x / y)
        if op == "/":
            return int(x / y) if both_int else x / y
        return {"+": x + y, "-": x - y, "*": x * y}[op]

    return run


def _literal(token: Any) -> Any:
    kind, text = token.type, str(token)
    if kind == "INT_LIT":
        return int(text, 0)
    if kind == "FLOAT_LIT":
        return float(text)
    if kind == "BOOL_LIT":
        return text == "true"
    if kind == "NULL_LIT":
        return None
    if kind == "STRING_LIT" and text[:1] in "'\"" and "\\" not in text:
        return text[1:-1]
    raise Unsupported(f"literal {text}")


def _field(target: Fn, name: str) -> Fn:
    def run(env: Env) -> Any:
        obj = target(env)
        if not isinstance(obj, dict) or name not in obj:
            raise CelError(f"no such key: {name}")
        return obj[name]

    return run


def _index(target: Fn, key: Fn) -> Fn:
    def run(env: Env) -> Any:
        obj, k = target(env), key(env)
        if isinstance(obj, list) and isinstance(k, int) and not isinstance(k, bool):
            if 0 <= k < len(obj):
                return obj[k]
        elif isinstance(obj, dict) and k in obj:
            return obj[k]
        raise CelError(f"no such index: {k!r}")

    return run


def _has(arg: Any) -> Fn:
    member = _trees(_descend(arg))
    if not member or member[0].data != "member_dot":
        raise Unsupported("has() of anything but a field")
    target = _compile(_trees(member[0])[0])
    name = _tokens(member[0])[-1]

    def run(env: Env) -> bool:
        obj = target(env)
        if not isinstance(obj, dict):
            raise CelError("has() on a non-object")
        return name in obj

    return run


def _descend(tree: Any) -> Any:
    """The `member` under a chain of single-child precedence levels."""
    while tree.data != "member":
        kids = _trees(tree)
        if len(kids) != 1:
            raise Unsupported(tree.data)
        tree = kids[0]
    return tree


def _size(value: Any) -> int:
    if not isinstance(value, str | list | dict):
        raise CelError("size() of a scalar")
    return len(value)


def _matches(value: Any, pattern: Any) -> bool:
    if not isinstance(value, str) or not isinstance(pattern, str):
        raise CelError("matches() needs strings")
    return _regex(pattern).search(value) is not None


@functools.cache
def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def _macro(name: str, target: Fn, var: str, body: Fn) -> Fn:
    def run(env: Env) -> Any:
        items = target(env)
        if not isinstance(items, list | dict):
            raise CelError(f"{name}() of a scalar")
        scope = dict(env)

        def each(item: Any) -> Any:
            scope[var] = item
            return body(scope)

        if name == "map":
            return [each(i) for i in items]
        if name == "filter":
            return [i for i in items if _bool(each(i))]
        if name == "exists_one":
            return sum(1 for i in items if _bool(each(i))) == 1
        # all/exists: a decisive item wins over an error elsewhere (CEL's logic).
        decisive, error = name == "exists", None
        for i in items:
            try:
                if _bool(each(i)) is decisive:
                    return decisive
            except CelError as exc:
                error = exc
        if error is not None:
            raise error
        return not decisive

    return run


def _call(tree: Any) -> Fn:
    """`target.name(args)`: a method or a macro."""
    target_tree, args_trees = _trees(tree)[0], _trees(tree)[1:]
    name = _tokens(tree)[-1]
    target = _compile(target_tree)
    args = _trees(args_trees[0]) if args_trees else []
    if name in ("all", "exists", "exists_one", "filter", "map") and len(args) == 2:
        var = _tokens(_trees(_descend(args[0]))[0].children[0])
        if not var:
            raise Unsupported("macro variable")
        return _macro(name, target, var[0], _compile(args[1]))
    if name == "size" and not args:
        return lambda env: _size(target(env))
    if name == "matches" and len(args) == 1:
        pattern = _compile(args[0])
        return lambda env: _matches(target(env), pattern(env))
    raise Unsupported(f"method {name}")


def _primary(tree: Any) -> Fn:
    child = tree.children[0]
    kind = getattr(child, "data", None)
    if kind == "ident":
        var = _tokens(child)[0]

        def lookup(env: Env) -> Any:
            if var not in env:
                raise CelError(f"undeclared reference {var}")
            return env[var]

        return lookup
    if kind == "literal":
        value = _literal(child.children[0])
        return lambda env: value
    if kind == "list_lit":
        items = [_compile(t) for t in _trees(_trees(child)[0])] if _trees(child) else []
        return lambda env: [item(env) for item in items]
    if kind == "paren_expr":
        return _compile(_trees(child)[0])
    if kind == "ident_arg" and _tokens(child)[0] in ("has", "size"):
        args = _trees(_trees(child)[0])
        if len(args) != 1:
            raise Unsupported("arity")
        if _tokens(child)[0] == "has":
            return _has(args[0])
        arg = _compile(args[0])
        return lambda env: _size(arg(env))
    raise Unsupported(str(kind))


def _binary(kind: str, left: Fn, right: Fn) -> Fn:
    if kind in _REL:
        cmp = _compare(_REL[kind])
        return lambda env: cmp(left(env), right(env))
    ops = {"addition_add": "+", "addition_sub": "-", "multiplication_mul": "*",
           "multiplication_mod": "%", "multiplication_div": "/"}  # fmt: skip
    if kind in ops:
        return _arith(ops[kind], left, right)
    raise Unsupported(kind)


def _compile(tree: Any) -> Fn:
    kind, kids = tree.data, _trees(tree)
    if kind == "expr" and len(kids) == 3:
        cond, yes, no = (_compile(k) for k in kids)
        return lambda env: yes(env) if _bool(cond(env)) else no(env)
    if kind in ("conditionalor", "conditionaland") and len(kids) == 2:
        return _logic(_compile(kids[0]), _compile(kids[1]), kind == "conditionalor")
    if kind in ("relation", "addition", "multiplication") and len(kids) == 2:
        # [<op>[left], right]: the operator node holds the left operand
        op, left = kids[0].data, _trees(kids[0])[0]
        return _binary(op, _compile(left), _compile(kids[1]))
    if kind == "unary" and len(kids) == 2:
        inner = _compile(kids[1])
        if kids[0].data == "unary_not":
            return lambda env: not _bool(inner(env))
        return lambda env: -_number(inner(env))
    if kind == "member_dot":
        return _field(_compile(kids[0]), _tokens(tree)[-1])
    if kind == "member_dot_arg":
        return _call(tree)
    if kind == "member_index":
        return _index(_compile(kids[0]), _compile(kids[1]))
    if kind == "primary":
        return _primary(tree)
    if len(kids) == 1 and not _tokens(tree):
        return _compile(kids[0])
    raise Unsupported(kind)


@functools.cache
def compile_rule(rule: str) -> Fn:
    """`rule` as a closure of `{"self": document}` (raises Unsupported)."""
    import celpy

    env = celpy.Environment()
    return _compile(env.compile(rule))


def evaluate(rule: str, document: Any) -> Any:
    """The value of `rule` with `self` bound to `document` (raises CelError, Unsupported)."""
    return compile_rule(rule)({"self": document})
