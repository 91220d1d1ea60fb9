"""README.md's playground section, walked as a newcomer would: its own commands, its promised outputs.

The playground is the one `make cluster` starts (tests/support/playground.py). Every `$ kubectl`
and `$ helm` line of the section's console blocks runs as written (real kubectl and helm, from
the repository root, with the playground's kubeconfig); the lines the README shows under a
command are what it must print: a `kubectl get` table column by column (only AGE, RESTARTS and
IP may differ, and a table is waited for until it matches), anything else line by line, in order.
So the test breaks when the README and the playground part. Beside the walk: every example the
repository ships is applied somewhere in it, dynamic MIG works with only GPU Feature Discovery's
labels, the chart's own workloads run on the simulated nodes, and a Pending pod of each kind
says why.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import subprocess
import sys
import uuid
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client

from gpupart.core.api.wire import ASSIGNMENT_ANNOTATION
from gpupart_testsupport.cluster import REPO, ControlPlane
from gpupart_testsupport.playground import NODES, Playground
from gpupart_testsupport.polling import wait_for

pytestmark = pytest.mark.e2e

README = REPO / "README.md"
SECTION = "## A local playground: `make cluster`"
VOLATILE = {"AGE", "RESTARTS", "IP"}
"""Columns whose values depend on when the command runs (a pod's IP: the fake runtime gives each
pod a free loopback address)."""
WAIT_S = 180.0
"""Bound on how long a promised `kubectl get` output may take to appear (partitions applied
through simulated MIG resets, pods started by real kubelets on a loaded 2-core machine)."""


# --- the README, read -------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One `$ ` command of the section and the lines the README shows it printing."""

    command: str
    output: tuple[str, ...]
    line: int
    """Where the command is in README.md (1-based), for the failure message."""

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.command, comments=True)

    @property
    def verb(self) -> str:
        """The tool and its subcommand (`kubectl get`), past flags such as `-n NAMESPACE`."""
        argv, words = self.argv, []
        i = 1
        while i < len(argv) and not words:
            if argv[i] in ("-n", "--namespace"):
                i += 2
                continue
            if not argv[i].startswith("-"):
                words.append(argv[i])
            i += 1
        return " ".join([argv[0], *words])


def section_text() -> tuple[str, int]:
    """The playground section of README.md and the line number it starts at."""
    text = README.read_text()
    assert SECTION in text, f"README.md lost its section {SECTION!r}"
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end != -1 else len(text)], text[:start].count("\n") + 1


def readme_steps() -> list[Step]:
    """Every command of the section's ```console blocks, in order, with its shown output."""
    section, first_line = section_text()
    steps: list[Step] = []
    in_console = False
    command: list[str] = []
    output: list[str] = []
    at = 0

    def flush() -> None:
        if command:
            steps.append(Step(" ".join(command), tuple(output), at))
        command.clear()
        output.clear()

    continued = False
    for number, line in enumerate(section.splitlines(), start=first_line):
        if line.startswith("```"):
            if in_console:
                flush()
            in_console = line.strip() == "```console" and not in_console
            continue
        if not in_console:
            continue
        if continued:
            command.append(line.strip().removesuffix("\\").strip())
            continued = line.rstrip().endswith("\\")
        elif line.startswith("$ "):
            flush()
            at = number
            command.append(line[2:].strip().removesuffix("\\").strip())
            continued = line.rstrip().endswith("\\")
        else:
            output.append(line)
    flush()
    assert steps, "README.md's playground section has no ```console commands"
    return steps


def columns(header: str) -> list[tuple[str, int]]:
    """A kubectl table's column names and where each starts (names may hold one space)."""
    return [(m.group(0), m.start()) for m in re.finditer(r"\S+(?: \S+)*", header)]


def table(lines: list[str] | tuple[str, ...]) -> tuple[list[str], list[dict[str, str]]]:
    """A kubectl table read by its header's column positions (empty cells stay empty)."""
    cols = columns(lines[0])
    rows = []
    for line in lines[1:]:
        if not line.strip():
            continue
        cells = {}
        for i, (name, start) in enumerate(cols):
            end = cols[i + 1][1] if i + 1 < len(cols) else None
            cells[name] = line[start:end].strip()
        rows.append(cells)
    return [name for name, _ in cols], rows


def blocks(lines: list[str] | tuple[str, ...]) -> list[list[str]]:
    """Lines split at blank lines: `kubectl get a,b` prints one table per kind."""
    out: list[list[str]] = [[]]
    for line in lines:
        if line.strip():
            out[-1].append(line)
        elif out[-1]:
            out.append([])
    return [b for b in out if b]


def tables_mismatch(shown: tuple[str, ...], printed: list[str]) -> str | None:
    """Why the printed tables are not the README's (None when they are)."""
    want, got = blocks(shown), blocks(printed)
    if len(want) != len(got):
        return f"{len(got)} tables printed, README shows {len(want)}: {printed}"
    for w, g in zip(want, got, strict=True):
        why = table_mismatch(w, g)
        if why:
            return why
    return None


def table_mismatch(shown: list[str], printed: list[str]) -> str | None:
    """Why the printed table is not the README's (None when it is)."""
    want_cols, want_rows = table(shown)
    got_cols, got_rows = table(printed)
    if want_cols != got_cols:
        return f"columns {got_cols}, README shows {want_cols}"
    keep = [c for c in want_cols if c not in VOLATILE]
    want = sorted(tuple(r[c] for c in keep) for r in want_rows)
    got = sorted(tuple(r[c] for c in keep) for r in got_rows)
    if want != got:
        return f"rows {got}, README shows {want} (columns {keep})"
    return None


def lines_mismatch(shown: tuple[str, ...], printed: list[str]) -> str | None:
    """Why the README's lines are not all printed, in order (None when they are)."""
    rest = iter(line.rstrip() for line in printed)
    for line in shown:
        if line.strip() and not any(got == line.rstrip() for got in rest):
            return f"README shows {line!r}; not printed (in that order)"
    return None


# --- the playground ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def playground(
    k8s_bin_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Generator[Playground, None, None]:
    """What `make cluster` starts, for this module alone."""
    pg = Playground(k8s_bin_dir, tmp_path_factory.mktemp("playground"), say=lambda _: None)
    pg.start()
    try:
        yield pg
    except BaseException:
        assert pg.stack is not None
        print(pg.stack.tails())
        raise
    finally:
        pg.stop()


def run(cp: ControlPlane, step: Step) -> subprocess.CompletedProcess[str]:
    """The command as a shell in the repository root would run it with the README's exports."""
    argv = step.argv
    tool = cp.bin_dir / argv[0]
    return subprocess.run(
        [str(tool), *argv[1:]],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=cp.env(),
        timeout=180,
    )


def check(cp: ControlPlane, step: Step) -> None:
    """Run the step; what the README shows it printing, it prints (a table: waited for)."""
    where = f"README.md:{step.line}: `{step.command}`"
    argv = step.argv
    output = argv[argv.index("-o") + 1] if "-o" in argv else "table"
    is_table = step.verb == "kubectl get" and output in ("table", "wide") and bool(step.output)

    def attempt() -> str | None:
        res = run(cp, step)
        if res.returncode != 0 and not (is_table and "No resources found" in res.stderr):
            raise AssertionError(f"{where} exited {res.returncode}:\n{res.stdout}{res.stderr}")
        printed = (res.stdout + res.stderr).splitlines()
        if is_table and step.output[0].startswith("No resources found"):
            return None if any("No resources found" in p for p in printed) else "\n".join(printed)
        if is_table:
            return tables_mismatch(step.output, printed)
        return lines_mismatch(step.output, printed)

    if not is_table:
        why = attempt()
        assert why is None, f"{where}: {why}"
        return
    last: list[str | None] = [None]

    def matches() -> bool:
        last[0] = attempt()
        return last[0] is None

    try:
        wait_for(matches, WAIT_S, f"{where} to print what the README shows", interval=1)
    except TimeoutError:
        raise AssertionError(f"{where}: {last[0]}") from None


def runnable(step: Step) -> bool:
    """kubectl and helm lines run; `make cluster` is the fixture, `export` its environment."""
    return step.argv[0] in ("kubectl", "helm")


# --- the walk ---------------------------------------------------------------------------------


def test_the_section_names_only_commands_the_walk_knows() -> None:
    for step in readme_steps():
        assert runnable(step) or step.argv[0] in ("make", "export"), (
            f"README.md:{step.line}: `{step.command}`: the walk does not know how to run it"
        )
    commands = [s.command for s in readme_steps()]
    assert commands[0] == "make cluster" and commands[-1] == "make cluster-down"


def test_every_shipped_example_is_applied_in_the_walk() -> None:
    applied = set()
    for step in readme_steps():
        argv = step.argv
        if step.verb == "kubectl apply":
            applied |= {argv[i + 1] for i, a in enumerate(argv) if a == "-f"}
    shipped = {
        str(p.relative_to(REPO))
        for d in ("charts/gpupart/examples", "docs/examples")
        for p in sorted((REPO / d).glob("*.yaml"))
    }
    assert shipped <= applied, f"never applied in README.md's walk: {sorted(shipped - applied)}"


def test_the_kubeconfig_the_readme_exports_is_the_one_make_cluster_writes() -> None:
    (export,) = [s for s in readme_steps() if s.argv[0] == "export"]
    assignments = dict(a.split("=", 1) for a in export.argv[1:])
    assert assignments["KUBECONFIG"] == "$PWD/.cluster/control-plane/kubeconfig"
    assert assignments["PATH"] == "$PWD/.cluster/bin:$PATH"
    # scripts/cluster.py's state directory is .cluster; the playground's control plane lives
    # in its control-plane/ folder and its clients in bin/.
    source = (REPO / "scripts" / "cluster.py").read_text()
    assert 'STATE = REPO / ".cluster"' in source and 'BIN = STATE / "bin"' in source


@pytest.fixture(scope="module")
def walked(playground: Playground) -> Playground:
    """Every kubectl and helm command of the section run, in order, each printing what the
    README shows (the first that does not fails every test that needs the walk)."""
    cp = playground.control_plane
    for step in readme_steps():
        if runnable(step):
            check(cp, step)
    return playground


def test_the_readme_walk(walked: Playground) -> None:
    assert walked.stack is not None and all(p.alive() for p in walked.stack.processes)


def test_dynamic_mig_works_with_only_the_gfd_labels(walked: Playground) -> None:
    """The walk's dynamic-MIG pod ran on gpu-h100, a node labelled only as GFD does, whose GPUs
    the operator counted from `nvidia.com/gpu.count`; the node agent made the slice."""
    cp = walked.control_plane
    core = client.CoreV1Api(cp.api_client())
    node = core.read_node("gpu-h100")
    (h100,) = [n for n in NODES if n.name == "gpu-h100"]
    ours = {k: v for k, v in node.metadata.labels.items() if k.startswith("nvidia.com/")}
    assert ours == h100.labels
    assert not any(k.startswith("gpupart.io/") for k in node.metadata.labels)
    shown = " ".join(s.command for s in readme_steps())
    assert "docs/examples/pod-mig-dynamic.yaml" in shown
    events = core.list_namespaced_event("default", field_selector="involvedObject.name=infer-4g")
    reasons = [e.message for e in events.items if e.reason == "MigSlicePlanned"] or [
        e.message for e in events.items
    ]
    assert any("4g.40gb" in m and "gpu-h100" in m for m in reasons), reasons


def test_the_chart_s_workloads_reach_their_replicas_on_the_simulated_nodes(
    walked: Playground,
) -> None:
    """After the walk's `helm install`: every Deployment has its replicas ready and every
    DaemonSet a ready pod on each GPU node, all Running in the fake runtime on the playground's
    nodes (their probes answered where the fake runtime listens for each declared port)."""
    cp = walked.control_plane
    apps = client.AppsV1Api(cp.api_client())
    core = client.CoreV1Api(cp.api_client())
    (install,) = [s for s in readme_steps() if s.argv[:2] == ["helm", "install"]]
    namespace = install.argv[install.argv.index("-n") + 1]
    # The walk uninstalls the release at its end; install it again as written.
    if not apps.list_namespaced_deployment(namespace).items:
        check(cp, install)
    try:
        deployments = apps.list_namespaced_deployment(namespace).items
        daemonsets = apps.list_namespaced_daemon_set(namespace).items
        assert {d.metadata.name for d in deployments} == {"gpupart-operator", "gpupart-scheduler"}
        assert {d.metadata.name for d in daemonsets} == {"gpupart-node"}

        def settled() -> bool:
            for d in apps.list_namespaced_deployment(namespace).items:
                if (d.status.ready_replicas or 0) != d.spec.replicas:
                    return False
            for ds in apps.list_namespaced_daemon_set(namespace).items:
                st = ds.status
                if not (st.desired_number_scheduled == len(NODES) == st.number_ready):
                    return False
            pods = core.list_namespaced_pod(namespace).items
            return bool(pods) and all(
                p.status.phase == "Running"
                and all(c.state.running for c in p.status.container_statuses or [])
                for p in pods
            )

        wait_for(settled, WAIT_S, "the chart's pods Running and Ready on the playground's nodes")
        pods = core.list_namespaced_pod(namespace).items
        expected = sum(d.spec.replicas for d in deployments) + len(NODES)
        assert len(pods) == expected
        assert {p.spec.node_name for p in pods} <= {n.name for n in NODES}
        agents = [p for p in pods if p.metadata.name.startswith("gpupart-node-")]
        assert sorted(p.spec.node_name for p in agents) == sorted(n.name for n in NODES)
    finally:
        subprocess.run(
            [str(cp.bin_dir / "helm"), "uninstall", "gpupart", "-n", namespace, "--wait"],
            capture_output=True,
            env=cp.env(),
            timeout=180,
        )


# --- a Pending pod says why, per kind ----------------------------------------------------------
#
# Each test, after the walk (which deletes its partitions), applies the shipped partition it
# needs, leaves one pod Pending and waits for the words of the pod's Event: the extender's
# FailedScheduling (`... nodes can take it (gpupart): ...`, docs/extender.md#reasons) for MIG,
# whole-GPU and shared pods, the dynamic-MIG planner's MigSliceUnavailable for a slice no GPU
# can make.


@pytest.fixture
def tenant(walked: Playground) -> Generator[str, None, None]:
    cp = walked.control_plane
    core = client.CoreV1Api(cp.api_client())
    name = f"readme-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    cp.wait_namespace_ready(name)
    yield name
    core.delete_namespace(name)


@contextlib.contextmanager
def partition(cp: ControlPlane, example: str) -> Iterator[None]:
    """The shipped example partition applied and Ready, deleted afterwards."""
    path = REPO / "charts" / "gpupart" / "examples" / f"{example}.yaml"
    cp.kubectl("apply", "-f", str(path))
    try:
        cp.kubectl(
            "wait",
            f"gpup/{example}",
            "--for=condition=Ready",
            f"--timeout={int(WAIT_S)}s",
            timeout=WAIT_S + 10,
        )
        yield
    finally:
        cp.kubectl("delete", "-f", str(path), "--wait=true")


def pending_reason(
    cp: ControlPlane,
    namespace: str,
    requests: dict[str, str],
    reason: str = "FailedScheduling",
    says: str = "",
) -> str:
    """A pod with these limits created; the message of its Event with this reason, once it
    holds `says` (the scheduler retries, and its message follows what the nodes advertise)."""
    core = client.CoreV1Api(cp.api_client())
    name = f"stuck-{uuid.uuid4().hex[:4]}"
    pod = {
        "metadata": {"name": name},
        "spec": {
            "schedulerName": "gpupart-scheduler",
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "sleep", "resources": {"limits": requests}}],
        },
    }
    core.create_namespaced_pod(namespace, pod)
    try:

        def event() -> str | None:
            for e in core.list_namespaced_event(namespace).items:
                if e.reason == reason and e.involved_object.name == name:
                    last[0] = str(e.message)
                    if says in last[0]:
                        return last[0]
            return None

        last = [""]
        try:
            message: str = wait_for(event, WAIT_S, f"the pod's {reason} event saying {says!r}")
        except TimeoutError:
            raise AssertionError(f"its last {reason} event: {last[0]!r}") from None
        assert core.read_namespaced_pod(name, namespace).status.phase == "Pending"
        return message
    finally:
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)


def test_a_gpu_pod_that_names_no_scheduler_is_placed_by_gpupart(
    walked: Playground, tenant: str
) -> None:
    # The chart's MutatingAdmissionPolicy sets it (HAMi does the same with a webhook): without
    # it the default scheduler would bind the pod and the node agent refuse its Allocate.
    cp = walked.control_plane
    core = client.CoreV1Api(cp.api_client())
    limits = {"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": "4096"}
    pod = {
        "metadata": {"name": "no-scheduler"},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "sleep", "resources": {"limits": limits}}],
        },
    }
    with partition(cp, "mps-h100"):
        created = core.create_namespaced_pod(tenant, pod)
        try:
            assert created.spec.scheduler_name == "gpupart-scheduler"
            wait_for(
                lambda: core.read_namespaced_pod("no-scheduler", tenant).status.phase == "Running",
                WAIT_S,
                "the pod Running on gpu-h100",
            )
            placed = core.read_namespaced_pod("no-scheduler", tenant)
            assert placed.spec.node_name == "gpu-h100"
            assert ASSIGNMENT_ANNOTATION in (placed.metadata.annotations or {})
        finally:
            core.delete_namespaced_pod("no-scheduler", tenant, grace_period_seconds=0)


def test_a_pending_shared_pod_says_why(walked: Playground, tenant: str) -> None:
    # 90000 MiB fits gpu-h100's two H100s together (kube-scheduler counts per node), no one GPU.
    cp = walked.control_plane
    with partition(cp, "mps-h100"):
        message = pending_reason(
            cp,
            tenant,
            {"nvidia.com/gpu.shared": "1", "gpupart.io/gpu-memory": "90000"},
            says="(gpupart)",
        )
    assert "gpu-h100" in message and "MiB" in message, message


def test_a_pending_mig_pod_says_why(walked: Playground, tenant: str) -> None:
    cp = walked.control_plane
    with partition(cp, "mig-a100"):
        # Two 3g.40gb slices; mig-a100 gives gpu-a100's one GPU one.
        message = pending_reason(cp, tenant, {"nvidia.com/mig-3g.40gb": "2"}, says="(gpupart)")
    assert "gpu-a100" in message and "3g.40gb" in message, message


def test_a_pending_whole_gpu_pod_says_why(walked: Playground, tenant: str) -> None:
    message = pending_reason(
        walked.control_plane, tenant, {"nvidia.com/gpu": "3"}, says="(gpupart)"
    )
    # Three whole GPUs: no node has them, whatever mode the walk left each GPU in (the reason
    # names each node: `none offered whole (modes: MIG)`, or the whole GPUs it has).
    assert "gpu-a100: 1 GPU, " in message and "gpu-h100: 2 GPUs, " in message, message
    assert "whole" in message, message


def test_a_pending_dynamic_mig_pod_says_why(walked: Playground, tenant: str) -> None:
    cp = walked.control_plane
    with partition(cp, "mig-dynamic-h100"):
        # Three 7g.80gb instances: gpu-h100 has two GPUs.
        message = pending_reason(
            cp,
            tenant,
            {"nvidia.com/mig-7g.80gb": "3"},
            reason="MigSliceUnavailable",
            says="7g.80gb",
        )
    assert "gpu-h100" in message, message


# --- `make cluster`'s check, before anything is built --------------------------------------------


def test_make_cluster_checks_this_machine_before_building() -> None:
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\ncluster: ", 1)[1].split("\n\n", 1)[0]
    steps = [line.strip() for line in recipe.splitlines()[1:]]
    assert steps == [
        "$(BIN)/python -P scripts/cluster.py check",
        "scripts/build-k8s-bins.sh",
        "$(BIN)/python -P scripts/cluster.py up",
    ]


def test_the_check_passes_here_and_refuses_a_user_without_root_in_one_line() -> None:
    script = [sys.executable, "-P", str(REPO / "scripts" / "cluster.py"), "check"]
    ok = subprocess.run(script, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *script]
    refused = subprocess.run(nobody, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1
    assert refused.stderr.splitlines() == [
        "cluster: needs root: each node's kubelet runs in its own mount namespace "
        "(unshare --mount); run `sudo make cluster`"
    ]
