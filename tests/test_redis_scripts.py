"""The Redis store's Lua scripts touch only the keys they are given (KEYS).

A Redis Cluster routes a script by its KEYS and refuses keys of another slot, but a key
built inside a script that happens to hash to the same slot (or any key on one node) goes
unnoticed: so each script is read here, and every key position of every ``redis.call``
must hold a ``KEYS[...]`` entry, a local bound to one, or a parameter of a local function
that every call passes one in.
"""

from __future__ import annotations

import re
import tomllib

import pytest
import redis

from proxy.store.redis_scripts import DIRECTORY, SCRIPTS

# Commands whose key is not their first argument: where it is (None: they take none).
_KEY_AT = {"TIME": None, "PUBLISH": None, "XGROUP": 2, "XINFO": 2}
_KEYS_ENTRY = re.compile(r"^KEYS\[[^\]]+\]$")
_CALL = re.compile(r"redis\.p?call\(")
_FUNCTION = re.compile(r"local function (\w+)\(([^)]*)\)")


def _arguments(source: str, start: int) -> list[str]:
    """The top-level comma-separated arguments of the call whose '(' ends at ``start``."""
    depth, current, out = 0, "", []
    for char in source[start:]:
        if char in "({[" or (char == ")" and depth == 0):
            if char == ")":
                break
            depth += 1
        elif char in ")}]":
            depth -= 1
        if char == "," and depth == 0:
            out.append(current.strip())
            current = ""
        else:
            current += char
    return [*out, current.strip()]


def _key_arguments(source: str) -> list[str]:
    """The expression in every key position of every redis.call."""
    found = []
    for match in _CALL.finditer(source):
        args = _arguments(source, match.end())
        command = args[0].strip("'\"").upper()
        if command == "XREADGROUP":
            found.append(args[args.index("'STREAMS'") + 1])
            continue
        at = _KEY_AT.get(command, 1)
        if at is not None:
            found.append(args[at])
    return found


def _bound_to_keys(source: str, name: str) -> bool:
    """Whether the local ``name`` only ever holds a KEYS entry."""
    if re.search(rf"for _, {name} in ipairs\(KEYS\)", source):
        return True
    bindings = re.findall(rf"local {name} = ([^\n]+)", source)
    if bindings and all(_KEYS_ENTRY.match(b.strip()) for b in bindings):
        return True
    for function, params in _FUNCTION.findall(source):
        names = [p.strip() for p in params.split(",")]
        if name in names:
            calls = [m.end() for m in re.finditer(rf"(?<!function ){function}\(", source)]
            position = names.index(name)
            return all(_KEYS_ENTRY.match(_arguments(source, end)[position]) for end in calls)
    return False


def undeclared_keys(source: str) -> list[str]:
    """The key expressions of ``source`` that are not (bound to) a KEYS entry."""
    return [
        expr
        for expr in _key_arguments(source)
        if not (_KEYS_ENTRY.match(expr) or (expr.isidentifier() and _bound_to_keys(source, expr)))
    ]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_script_touches_only_its_keys(name: str) -> None:
    script = SCRIPTS[name]
    assert _key_arguments(script.source), name
    assert undeclared_keys(script.source) == [], name
    used = {int(i) for i in re.findall(r"KEYS\[(\d+)\]", script.source)}
    if script.keys is not None:
        assert used <= set(range(1, script.keys + 1)), name


def test_a_key_built_inside_a_script_is_found() -> None:
    """The check above can fail: the queue's scripts before they took every key."""
    built = """
local Q = 'tp:{ops}:'
local function enqueue(route, id)
  local stream = Q .. 'q:' .. route
  return redis.call('XADD', stream, '*', 'id', id)
end
redis.call('HSET', Q .. 'job:' .. ARGV[1], 'en', enqueue(ARGV[2], ARGV[1]))
redis.call('ZADD', KEYS[1], 0, ARGV[1])
for _, key in ipairs(KEYS) do redis.call('DEL', key) end
"""
    assert undeclared_keys(built) == ["stream", "Q .. 'job:' .. ARGV[1]"]
    passed = "local function f(k) return redis.call('GET', k) end\nf(KEYS[1])\nf(ARGV[1])"
    assert undeclared_keys(passed) == ["k"]


def test_the_scripts_are_loaded_with_their_includes_under_redis_own_sha(redis_url: str) -> None:
    """Every file is a script, its includes' text in place of their lines, and EVALSHA
    names it by the SHA-1 that Redis gives its source."""
    client = redis.Redis.from_url(redis_url)
    paths = sorted(DIRECTORY.glob("*.lua"))
    assert sorted(SCRIPTS) == sorted(path.stem.rpartition("-")[0] for path in paths)
    for path in paths:
        script = SCRIPTS[path.stem.rpartition("-")[0]]
        assert "@include" not in script.source
        for piece in re.findall(r'^--- @include "([a-z_]+)"$', path.read_text(), re.MULTILINE):
            included = (DIRECTORY / "includes" / f"{piece}.lua").read_text().rstrip("\n")
            assert included.splitlines()[-1] in script.source, (path.name, piece)
        assert client.script_load(script.source) == script.sha, path.name
    client.close()


def test_the_scripts_are_package_data() -> None:
    """The wheel (and so the image) carries every script: pyproject's package-data."""
    pyproject = tomllib.loads((DIRECTORY.parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["proxy.store.redis_scripts"]
    files = {p.relative_to(DIRECTORY) for p in DIRECTORY.rglob("*.lua")}
    assert files and all(any(f.match(p) for p in patterns) for f in files)
