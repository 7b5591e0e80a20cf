from __future__ import annotations

import pytest

from proxy.config import RouteConfig
from proxy.errors import InvalidPath, RouteNotFound
from proxy.routes import Router, check_path, upstream_url


def make(name: str, prefix: str, upstream: str = "http://u:1", strip: bool = False) -> RouteConfig:
    return RouteConfig(name=name, path_prefix=prefix, upstream=upstream, strip_prefix=strip)


def test_longest_prefix_wins_on_segment_boundaries() -> None:
    router = Router([make("root", "/"), make("tools", "/tools"), make("deep", "/tools/deep")])
    assert router.match("/tools/deep/x").name == "deep"
    assert router.match("/tools/deep").name == "deep"
    assert router.match("/tools/deeper").name == "tools"
    assert router.match("/toolsx").name == "root"
    with pytest.raises(RouteNotFound):
        Router([make("tools", "/tools")]).match("/toolsx")


def test_the_segment_index_matches_as_the_longest_prefix_does() -> None:
    """Every path of many against many prefixes: the index finds the route that the
    longest prefix a path is under names (or none), as a scan of every route would."""
    prefixes = ["/a", "/a/b", "/a/b/c", "/ab", "/b", "/b/a", "/c/d", "/a/bc"]
    paths = ["/", "/a", "/a/", "/a/b", "/a/bc", "/a/b/c/d", "/ab/x", "/abc", "/b/a/b", "/c"]
    paths += ["/c/d", "/c/de", "/d", "/a/b/cd", "/_proxyx"]
    for with_root in (False, True):
        routes = [make(f"r{i}", prefix) for i, prefix in enumerate(prefixes)]
        routes += [make("root", "/")] if with_root else []
        router = Router(routes)
        for path in paths:
            under = [
                r
                for r in routes
                if r.path_prefix == "/"
                or path == r.path_prefix
                or path.startswith(r.path_prefix + "/")
            ]
            expected = max(under, key=lambda r: len(r.path_prefix), default=None)
            if expected is None:
                with pytest.raises(RouteNotFound):
                    router.match(path)
            else:
                assert router.match(path).name == expected.name, path


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/a/../b", b"/a/../b"),
        ("/a/./b", b"/a/./b"),
        ("//evil.example/x", b"//evil.example/x"),
        ("/a//b", b"/a//b"),
        ("/a/b", b"/a%2fb"),
        ("/a\\b", b"/a%5Cb"),
        ("a", b"a"),
        ("/a\x00", b"/a%00"),
        ("/..", b"/%2e%2e"),
    ],
)
def test_unsafe_paths(path: str, raw: bytes) -> None:
    with pytest.raises(InvalidPath):
        check_path(path, raw)


def test_safe_paths() -> None:
    check_path("/a/b.c/..d/e..", b"/a/b.c/..d/e..")
    check_path("/a b", b"/a%20b")


def test_upstream_url() -> None:
    route = make("r", "/svc", "http://u:1/api")
    assert upstream_url(route, b"/svc/x%20y", b"q=1") == "http://u:1/api/svc/x%20y?q=1"
    stripped = make("r", "/svc", "http://u:1/api", strip=True)
    assert upstream_url(stripped, b"/svc/x", b"") == "http://u:1/api/x"
    assert upstream_url(stripped, b"/svc", b"") == "http://u:1/api/"
    with pytest.raises(InvalidPath):
        upstream_url(stripped, b"/%73vc/x", b"")
