"""The node agent's Kubernetes adapter when the API server is unreachable: retries with backoff, never a traceback."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from gpupart.keyfile import KeyFile
from gpupart.logs import KlogFormatter
from gpupart_plugin.kube import KubeUnavailable, NodeClient, PassInput
from gpupart_testsupport.ports import free_port

LOOPBACK = "127.0.0.1"
WATCH_FAILED = '"Failed to watch" resource="node" node="node-a"'


closed_port = free_port  # a loopback port nothing listens on (bound, then released)


def unreachable(node: str = "node-a") -> NodeClient:
    configuration = client.Configuration(host=f"http://{LOOPBACK}:{closed_port()}")
    configuration.retries = 0  # one refused connection per request, not urllib3's three
    keys = KeyFile.public(Path("/nonexistent/assignment-keys"))  # no pod is verified here
    return NodeClient(
        client.ApiClient(configuration), node, keys, timeout_s=2.0, backoff_s=(0.02, 0.1)
    )


def test_watch_retries_with_backoff_while_the_api_server_is_unreachable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = unreachable()
    stop = threading.Event()
    yielded: list[PassInput] = []
    raised: list[BaseException] = []

    def consume() -> None:
        try:
            yielded.extend(node.watch_input(stop, relist_s=1))
        except BaseException as error:  # noqa: BLE001 - the test reports it
            raised.append(error)

    caplog.set_level(logging.WARNING, logger="gpupart_plugin.kube")
    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(_failures(caplog)) < 4:
        time.sleep(0.02)
    stop.set()
    thread.join(5)
    assert not thread.is_alive(), "watch_input did not return after stop"
    assert raised == [] and yielded == []
    failures = _failures(caplog)
    assert len(failures) >= 4, failures
    assert 'node="node-a"' in failures[0] and 'retryAfter="0.02s"' in failures[0]
    # The wait doubles up to the cap, and each line is one line.
    assert 'retryAfter="0.1s"' in failures[-1]
    assert all("\n" not in f for f in failures)


def _failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The klog lines of the watch failures logged."""
    return [
        KlogFormatter().format(r) for r in caplog.records if r.getMessage() == "Failed to watch"
    ]


def test_publish_pod_list_and_inventory_read_raise_the_agents_error_when_unreachable() -> None:
    node = unreachable()
    with pytest.raises(KubeUnavailable, match="publish state of node node-a"):
        node.publish("{}", "[]", {})
    with pytest.raises(KubeUnavailable, match="list pods on node node-a"):
        node.shared_pods()
    with pytest.raises(KubeUnavailable, match="read the inventory of node node-a"):
        node.last_inventory()


def test_gpupart_node_keeps_running_without_an_api_server_and_stops_on_sigterm(
    tmp_path: Path, sock_dir: Path
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "c", "cluster": {"server": f"http://{LOOPBACK}:{closed_port()}"}}
                ],
                "users": [{"name": "u", "user": {}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    log = tmp_path / "node.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "gpupart"), "node", "--node-name=node-a",
                "--simulate=A100-SXM4-80GB:mig-off", f"--plugin-dir={sock_dir}",
                f"--pod-resources-socket={sock_dir / 'pr.sock'}",
                f"--mps-root={tmp_path / 'mps'}", "--metrics-port=0",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and log.read_text().count(WATCH_FAILED) < 2:
            assert process.poll() is None, log.read_text()
            time.sleep(0.1)
        assert log.read_text().count(WATCH_FAILED) >= 2, log.read_text()
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(5)
    assert "Traceback" not in log.read_text()
