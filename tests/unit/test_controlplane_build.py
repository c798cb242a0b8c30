"""The control plane's Go wrapper modules stay what the generator writes from upstream, and the
build cache is keyed, reused and built once under concurrent callers."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kvfleet_localcluster import controlplane_build, controlplane_gomod, controlplane_lws
from kvfleet_localcluster.controlplane_gomod import (
    ETCD_MODULE,
    KUBERNETES_VERSION,
    LWS_MODULE_DIR,
    LWS_TOOL,
    LWS_VERSION,
    MODULE_DIR,
    parse_upstream,
    render_kube_gomod,
    replace_directives,
)
from tests.conftest import require_binary

UPSTREAM_SNIPPET = """module k8s.io/kubernetes

go 1.26.0

godebug default=go1.26

require (
\tgo.etcd.io/etcd/server/v3 v3.7.0 // indirect
\tk8s.io/api v0.0.0
\tk8s.io/client-go v0.0.0
)

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/client-go => ./staging/src/k8s.io/client-go
\tk8s.io/sample-controller => ./staging/src/k8s.io/sample-controller
)
"""


def test_the_generator_replaces_every_required_staging_module_with_its_release() -> None:
    upstream = parse_upstream(UPSTREAM_SNIPPET)
    assert upstream.staging == ("k8s.io/api", "k8s.io/client-go")  # sample-controller: unrequired
    assert upstream.godebug == ("godebug default=go1.26",)
    gomod = render_kube_gomod(upstream)
    assert replace_directives(gomod) == {"k8s.io/api": "v0.37.2", "k8s.io/client-go": "v0.37.2"}
    assert f"\t{ETCD_MODULE} v3.7.0\n" in gomod
    assert controlplane_gomod.staging_version("v1.37.2") == "v0.37.2"


@pytest.fixture(scope="module")
def upstream() -> controlplane_gomod.Upstream:
    require_binary("go")
    return parse_upstream(controlplane_gomod.upstream_gomod())


def test_committed_gomod_is_what_the_generator_writes_from_upstream(
    upstream: controlplane_gomod.Upstream,
) -> None:
    committed = (MODULE_DIR / "go.mod").read_text()
    generated = render_kube_gomod(upstream)
    assert len(upstream.staging) >= 30  # k8s.io/kubernetes 1.37 has 31 required staging modules
    assert replace_directives(committed) == replace_directives(generated)
    for module in upstream.staging:
        assert replace_directives(committed)[module] == "v0." + KUBERNETES_VERSION[3:]
    for line in (upstream.go_line, *upstream.godebug):
        assert f"\n{line}\n" in committed
    requires = parse_upstream(committed).requires
    assert requires["k8s.io/kubernetes"] == KUBERNETES_VERSION
    assert requires[ETCD_MODULE] == upstream.requires[ETCD_MODULE]


def test_lws_module_pins_the_release_and_its_main_package() -> None:
    lws = (LWS_MODULE_DIR / "go.mod").read_text()
    assert f"tool {LWS_TOOL}\n" in lws
    assert parse_upstream(lws).requires["sigs.k8s.io/lws"] == LWS_VERSION
    assert (LWS_MODULE_DIR / "go.sum").is_file() and (MODULE_DIR / "go.sum").is_file()


def test_a_built_key_is_reused_without_building(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_binary("go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _, version = controlplane_build.go_binary()
    key = controlplane_build.cache_key(version)
    (tmp_path / "kvfleet" / "controlplane" / key).mkdir(parents=True)

    def no_build(go: str, out: Path) -> None:
        raise AssertionError("built although the key was cached")

    monkeypatch.setattr(controlplane_build, "_build", no_build)
    started = time.monotonic()
    binaries = controlplane_build.ensure_built(progress=False)
    assert binaries.directory == tmp_path / "kvfleet" / "controlplane" / key
    assert time.monotonic() - started < 1.0


def test_concurrent_callers_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_binary("go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    builds: list[Path] = []

    def slow_build(go: str, out: Path) -> None:
        builds.append(out)
        time.sleep(0.5)
        (out / "bin").mkdir(parents=True)

    monkeypatch.setattr(controlplane_build, "_build", slow_build)
    results: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(controlplane_build.ensure_built(progress=False).directory)
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert len(set(results)) == 1 and (results[0] / "bin").is_dir()


def test_the_cache_key_follows_the_go_version_and_build_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = controlplane_build.cache_key("go1.26.8")
    assert controlplane_build.cache_key("go1.26.9") != before
    monkeypatch.setattr(controlplane_build, "TAGS", "selinux")
    assert controlplane_build.cache_key("go1.26.8") != before


def test_missing_go_names_the_version_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(controlplane_build.GoMissing, match=r"Go 1\.26"):
        controlplane_build.go_binary()


def test_lws_webhooks_are_the_release_patched_as_its_kustomization_calling_a_url() -> None:
    require_binary("go")
    release = Path(controlplane_gomod.download("sigs.k8s.io/lws", LWS_VERSION)["Dir"])
    docs = controlplane_lws.webhook_configurations(release, "https://127.0.0.1:9443", b"CA")
    hooks = {h["name"]: h for doc in docs for h in doc["webhooks"]}
    assert {d["metadata"]["name"] for d in docs} == {
        "lws-mutating-webhook-configuration",
        "lws-validating-webhook-configuration",
    }
    # Without the kustomization's objectSelector every pod in the cluster would call it.
    selector = {"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}
    assert hooks["mpod.kb.io"]["objectSelector"]["matchExpressions"] == [selector]
    assert hooks["vpod.kb.io"]["objectSelector"]["matchExpressions"] == [selector]
    assert hooks["mpod.kb.io"]["clientConfig"] == {
        "url": "https://127.0.0.1:9443/mutate--v1-pod",
        "caBundle": "Q0E=",
    }
