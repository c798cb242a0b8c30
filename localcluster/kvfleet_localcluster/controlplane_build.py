"""Build the real Kubernetes control plane from its Go modules, once per cache key.

`ensure_built()` compiles kube-apiserver, kube-controller-manager, kube-scheduler, etcd and the
LeaderWorkerSet controller from the wrapper modules in localcluster/controlplane/ (pinned by
their go.mod and go.sum), and copies the CRDs and webhook manifests those releases publish
in their module files. The result lives in `$XDG_CACHE_HOME/kvfleet/controlplane/<key>/`, the
key hashing everything the binaries depend on: a second call finds it and returns at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvfleet_localcluster.controlplane_gomod import (
    ETCD_MODULE,
    KUBE_TOOLS,
    KUBERNETES_VERSION,
    LWS_MODULE_DIR,
    LWS_TOOL,
    LWS_VERSION,
    MODULE_DIR,
    PROMETHEUS_OPERATOR_VERSION,
    download,
)

GO_MINIMUM = (1, 26)
TAGS = "selinux,notest,grpcnotrace"
BUILD_DATE = "1970-01-01T00:00:00Z"
"""Fixed, so that the same sources give the same binaries (and /version does not vary)."""
COLD_BUILD_CORE_MINUTES = 52
"""A cold build's cost in core-minutes, measured: 26 minutes on 2 cores shared with other work,
empty Go caches (22 CPU-minutes; up to 2.6 GB resident while linking);
the progress line divides it by the cores this machine has."""

BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "lws-controller")
LWS_FILES = (
    "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml",
    "config/crd/bases/disaggregatedset.x-k8s.io_disaggregatedsets.yaml",
    "config/webhook/manifests.yaml",
    "config/webhook/mutating-patch.yaml",
    "config/webhook/validating-patch.yaml",
    "config/rbac/role.yaml",
)
MONITORING_FILES = (
    "example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml",
    "example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml",
)


class GoMissing(RuntimeError):
    pass


@dataclass(frozen=True)
class Binaries:
    directory: Path

    def path(self, name: str) -> Path:
        return self.directory / "bin" / name

    @property
    def lws_dir(self) -> Path:
        """The LeaderWorkerSet release's files, by their path in its module (LWS_FILES)."""
        return self.directory / "lws"

    @property
    def monitoring_crds(self) -> list[Path]:
        return [self.directory / "monitoring" / Path(f).name for f in MONITORING_FILES]


def ldflags() -> str:
    """Stamp the release into both version packages, so that /version reports it."""
    major, minor = KUBERNETES_VERSION.lstrip("v").split(".")[:2]
    flags = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={KUBERNETES_VERSION}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
            f"-X {pkg}.buildDate={BUILD_DATE}",
        ]
    return " ".join(flags)


def go_binary() -> tuple[str, str]:
    """(the `go` on PATH, its version), or GoMissing saying which Go is needed."""
    go = shutil.which("go")
    if go is None:
        raise GoMissing(
            "the local cluster builds the Kubernetes control plane from source: it needs Go "
            f"{'.'.join(map(str, GO_MINIMUM))} or newer on PATH (https://go.dev/dl/)"
        )
    version = _go(go, "env", "GOVERSION").strip()  # e.g. go1.26.8
    parts = tuple(int(p) for p in version.removeprefix("go").split(".")[:2])
    if parts < GO_MINIMUM:
        raise GoMissing(f"{go} is {version}; the control plane needs Go 1.26 or newer")
    return go, version


def _go(go: str, *args: str, cwd: Path = MODULE_DIR) -> str:
    env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=readonly"}
    done = subprocess.run([go, *args], cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`go {' '.join(args)}` failed in {cwd}:\n{done.stderr[-4000:]}")
    return done.stdout


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvfleet" / "controlplane"


def cache_key(go_version: str) -> str:
    if not (MODULE_DIR / "go.sum").is_file():
        raise RuntimeError(f"{MODULE_DIR} is missing: the control plane builds from a source tree")
    digest = hashlib.sha256()
    for part in (go_version, TAGS, ldflags(), LWS_VERSION, PROMETHEUS_OPERATOR_VERSION):
        digest.update(part.encode() + b"\0")
    for module in (MODULE_DIR, LWS_MODULE_DIR):
        for name in ("go.mod", "go.sum"):
            digest.update((module / name).read_bytes() + b"\0")
    digest.update("\0".join((*LWS_FILES, *MONITORING_FILES)).encode())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One builder per key: a second caller waits, then finds the result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_built(progress: bool = True) -> Binaries:
    """The built control plane; builds it first if this cache key has none."""
    go, version = go_binary()
    key = cache_key(version)
    target = cache_root() / key
    if target.is_dir():
        return Binaries(target)
    with _locked(cache_root() / f"{key}.lock"):
        if target.is_dir():  # another process built it while we waited
            return Binaries(target)
        started = time.monotonic()
        if progress:
            minutes = COLD_BUILD_CORE_MINUTES / (os.cpu_count() or 1)
            print(
                f"Building the Kubernetes {KUBERNETES_VERSION} control plane from its Go modules "
                f"(once per Go version and go.sum): up to ~{minutes:.0f} min on "
                f"{os.cpu_count()} cores with empty Go caches, less with warm ones. "
                f"Cached in {target}",
                file=sys.stderr,
                flush=True,
            )
        staging = target.with_name(f"{key}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        _build(go, staging)
        staging.rename(target)  # atomic: a directory under the key is always complete
        if progress:
            print(f"Control plane built in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return Binaries(target)


def _build(go: str, out: Path) -> None:
    bin_dir = out / "bin"
    bin_dir.mkdir(parents=True)
    common = ("build", "-trimpath", "-buildvcs=false", "-tags", TAGS)
    # One `go build` for all four: the links run in parallel and share the compiled packages.
    _go(go, *common, "-ldflags", ldflags(), "-o", f"{bin_dir}/", *KUBE_TOOLS, ETCD_MODULE)
    (bin_dir / Path(ETCD_MODULE).parent.name).rename(bin_dir / "etcd")  # .../server/v3 -> server
    lws = bin_dir / "lws-controller"
    _go(go, *common, "-ldflags", "-s -w", "-o", str(lws), LWS_TOOL, cwd=LWS_MODULE_DIR)
    _copy_module_files(go, "sigs.k8s.io/lws", LWS_VERSION, LWS_FILES, out / "lws", keep_tree=True)
    _copy_module_files(
        go,
        "github.com/prometheus-operator/prometheus-operator",
        PROMETHEUS_OPERATOR_VERSION,
        MONITORING_FILES,
        out / "monitoring",
        keep_tree=False,
    )


def _copy_module_files(
    go: str, module: str, version: str, files: tuple[str, ...], dest: Path, keep_tree: bool
) -> None:
    source = Path(download(module, version, go)["Dir"])
    for name in files:
        target = dest / (name if keep_tree else Path(name).name)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / name, target)
