"""Argo CD's health checks are Lua run on the live object; this runs ours the same way (lupa:
Lua 5.4 in-process), with `obj` as Argo CD passes it: the object as nested Lua tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.objects import ROOT

HEALTH_LUA = ROOT / "docs" / "argocd" / "inferenceservice-health.lua"


def _to_lua(lua: Any, value: Any) -> Any:
    if isinstance(value, dict):
        return lua.table_from({k: _to_lua(lua, v) for k, v in value.items()})
    if isinstance(value, list):
        return lua.table_from([_to_lua(lua, v) for v in value])
    return value


def health(obj: dict[str, Any], script: Path = HEALTH_LUA) -> tuple[str, str]:
    from lupa import LuaRuntime

    lua = LuaRuntime(unpack_returned_tuples=True)
    check = lua.eval(f"function(obj) {script.read_text()} end")
    hs = check(_to_lua(lua, obj))
    return str(hs["status"]), str(hs["message"])
