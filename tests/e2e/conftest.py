"""Session fixture that runs a real control plane for the e2e tests, and log tails on failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Generator, Mapping
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpupart_testsupport.cluster import (
    BUILD_SCRIPT,
    REPO,
    ControlPlane,
    bin_dir_from_env,
    missing_binaries,
)
from gpupart_testsupport.dra import install_gpupart_device_classes, start_dra_node
from gpupart_testsupport.kubelet import KubeletNode
from gpupart_testsupport.stack import Stack

# The control planes of this session by fixture name, once started, so the report hook can
# reach their logs.
_ACTIVE: dict[str, ControlPlane] = {}


def _unavailable(message: str) -> None:
    """Skip, or fail where the binaries must be there (CI sets GPUPART_E2E_REQUIRED=1)."""
    if os.environ.get("GPUPART_E2E_REQUIRED") == "1":
        pytest.fail(f"{message} (GPUPART_E2E_REQUIRED=1 turns this skip into a failure)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def k8s_bin_dir() -> Path:
    """The directory with etcd, kube-apiserver, kube-scheduler, kwok, kubectl and helm."""
    bin_dir = bin_dir_from_env()
    missing = missing_binaries(bin_dir)
    if missing and os.environ.get("GPUPART_E2E_BUILD") == "1":
        # Opt-in: build here (minutes when cold) instead of asking the caller to.
        subprocess.run([str(BUILD_SCRIPT)], check=True)
        missing = missing_binaries(bin_dir)
    if missing:
        _unavailable(
            f"missing {', '.join(missing)} in {bin_dir}; build them with "
            f"`scripts/build-k8s-bins.sh` (or `make k8s-bins`), then run pytest with "
            f'GPUPART_K8S_BIN="$(scripts/build-k8s-bins.sh --print-dir)"'
        )
    return bin_dir


@pytest.fixture(scope="session")
def k8s_scheduler_config() -> Mapping[str, Any] | None:
    """KubeSchedulerConfiguration fields for kube-scheduler; None means the defaults.

    Override this fixture (in a conftest next to the tests) to add the gpupart extender.
    clientConnection.kubeconfig and leaderElection are filled in by the control plane.
    """
    return None


@pytest.fixture(scope="session")
def k8s_control_plane(
    k8s_bin_dir: Path, k8s_scheduler_config: Mapping[str, Any] | None
) -> Generator[ControlPlane, None, None]:
    """etcd -> kube-apiserver -> kubeconfig -> kube-scheduler -> kwok, for the whole session."""
    workdir = Path(tempfile.mkdtemp(prefix="gpupart-e2e-"))
    cp = ControlPlane(bin_dir=k8s_bin_dir, workdir=workdir)
    yield from _run_control_plane("k8s_control_plane", cp, k8s_scheduler_config)


def _run_control_plane(
    fixture: str, cp: ControlPlane, scheduler_config: Mapping[str, Any] | None
) -> Generator[ControlPlane, None, None]:
    keep = os.environ.get("GPUPART_E2E_KEEP_DIR") == "1"
    _ACTIVE[fixture] = cp
    try:
        try:
            cp.start(scheduler_config=scheduler_config)
        except Exception as e:
            # start() has stopped what it started; the logs are still there to show.
            raise RuntimeError(f"control plane did not start: {e}\n{cp.log_tails()}") from e
        yield cp
    finally:
        cp.stop()
        del _ACTIVE[fixture]
        if keep:
            print(f"\ncontrol plane files kept in {cp.workdir}")
        else:
            shutil.rmtree(cp.workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def dra_control_plane(k8s_bin_dir: Path) -> Generator[ControlPlane, None, None]:
    """A control plane with kube-controller-manager for the DRA tests on real kubelets: its
    resourceclaim controller makes the claims of ResourceClaimTemplates and releases them.
    Started the first time a module asks; shared by those modules (each has its own node)."""
    workdir = Path(tempfile.mkdtemp(prefix="gpupart-e2e-dra-"))
    cp = ControlPlane(bin_dir=k8s_bin_dir, workdir=workdir, controller_manager=True)
    yield from _run_control_plane("dra_control_plane", cp, None)


@pytest.fixture(scope="module")
def dra_kwok_plane(
    k8s_bin_dir: Path, request: pytest.FixtureRequest
) -> Generator[ControlPlane, None, None]:
    """A module's own control plane with kube-controller-manager and the chart's DeviceClasses,
    for the DRA modules on kwok nodes: what one module allocates never meets another's pools."""
    workdir = Path(tempfile.mkdtemp(prefix=f"gpupart-e2e-{request.module.__name__}-"))
    cp = ControlPlane(bin_dir=k8s_bin_dir, workdir=workdir, controller_manager=True)
    for plane in _run_control_plane("dra_kwok_plane", cp, None):
        install_gpupart_device_classes(plane)
        yield plane


@pytest.fixture(scope="module")
def dra_node(dra_control_plane: ControlPlane) -> Generator[KubeletNode, None, None]:
    """One real-kubelet node for a test module, Ready, for the module's DRA plugin to register
    with (`KubeletNode.plugins_registry`, `.plugins`; CDI specs in `.cdi_dir`)."""
    name = f"dra-{uuid.uuid4().hex[:6]}"
    node = start_dra_node(dra_control_plane, name)
    try:
        yield node
    finally:
        node.stop()
        core = client.CoreV1Api(dra_control_plane.api_client())
        core.delete_node(name)


@pytest.fixture
def dra_namespace(dra_control_plane: ControlPlane) -> Generator[str, None, None]:
    """A fresh namespace of the DRA control plane, ready for pods; its pods deleted afterwards."""
    name = f"dra-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(dra_control_plane.api_client())
    core.create_namespace({"metadata": {"name": name}})
    dra_control_plane.wait_namespace_ready(name)
    yield name
    core.delete_collection_namespaced_pod(name, grace_period_seconds=0)


@pytest.fixture(scope="session")
def k8s_api(k8s_control_plane: ControlPlane) -> Generator[Any, None, None]:
    """A kubernetes.client.ApiClient for the session's control plane."""
    client = k8s_control_plane.api_client()
    yield client
    client.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Any:
    """Attach the tail of every control-plane process log to a failing e2e test's report."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for fixture, cp in _ACTIVE.items():
            if fixture in getattr(item, "fixturenames", ()):
                report.sections.append((f"{fixture} log tails", cp.log_tails()))


@pytest.fixture(scope="module")
def stack(
    k8s_control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Generator[Stack, None, None]:
    """gpupart operator, extender and gpupart-scheduler for one test module; nodes are the
    module's to start (`Stack.start_real_node`)."""
    cp = k8s_control_plane
    cp.kubectl("apply", "-f", str(REPO / "charts" / "gpupart" / "crds"))
    api = cp.api_client()
    stack = Stack(cp, api, tmp_path_factory.mktemp("stack"))
    try:
        stack.start_operator()
        stack.start_scheduler(stack.start_extender())
        yield stack
    except BaseException:
        print(stack.tails())
        raise
    finally:
        stack.stop()
        api.close()


@pytest.fixture
def namespace(k8s_control_plane: ControlPlane) -> Generator[str, None, None]:
    """A fresh namespace; its pods are deleted afterwards (no namespace controller runs here)."""
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(k8s_control_plane.api_client())
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_collection_namespaced_pod(name, grace_period_seconds=0)
