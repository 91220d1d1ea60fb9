"""Trace parsing: both pod column sets, node lists, and every rejected input naming file:line."""

from __future__ import annotations

import pytest

from gpupart.sim.trace import (
    Node,
    Pod,
    TraceError,
    larger_than_any_node,
    parse_nodes,
    parse_pods,
)

NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,P100\nn1,32000,131072,0,\n"
PODS_FULL = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
    "creation_time,deletion_time,scheduled_time\n"
    "p0,12000,16384,1,1000,,LS,Running,0,12537496,0\n"
    "p1,6000,12288,1,460,V100M16|V100M32,LS,Running,427061,12902960,427061\n"
    "p2,4000,8192,0,0,,BE,Running,1,2,1\n"
)
PODS_SHORT = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,8000,1024,2,1000\n"


def test_parse_nodes_reads_gpu_and_cpu_only_nodes() -> None:
    nodes = parse_nodes(NODES, source="nodes.csv")
    assert nodes == (
        Node("n0", 64000, 262144, 2, "P100", line=2),
        Node("n1", 32000, 131072, 0, "", line=3),
    )
    assert nodes[0].gpu_milli == 2000


def test_parse_pods_reads_the_eleven_column_set() -> None:
    pods = parse_pods(PODS_FULL, source="pods.csv")
    assert [p.name for p in pods] == ["p0", "p1", "p2"]
    assert pods[1].gpu_spec == ("V100M16", "V100M32")
    assert pods[1].is_shared and not pods[0].is_shared
    assert pods[1].accepts("V100M32") and not pods[1].accepts("T4")
    assert pods[2].accepts("T4")  # CPU-only pods go anywhere
    assert pods[0].line == 2


def test_parse_pods_reads_the_five_column_set() -> None:
    (pod,) = parse_pods(PODS_SHORT, source="multigpu.csv")
    assert pod == Pod("p0", 8000, 1024, 2, 1000, (), line=2)
    assert pod.total_gpu_milli == 2000


@pytest.mark.parametrize(
    ("text", "where", "fragment"),
    [
        pytest.param("", "pods.csv:1", "empty file", id="empty-file"),
        pytest.param("\n\n", "pods.csv:1", "empty file", id="blank-file"),
        pytest.param(
            "name,cpu_milli,memory_mib,num_gpu\np,1,1,0\n",
            "pods.csv:1",
            "missing gpu_milli",
            id="missing-column",
        ),
        pytest.param(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli,color\np,1,1,0,0,red\n",
            "pods.csv:1",
            "unexpected color",
            id="extra-column",
        ),
        pytest.param(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n",
            "pods.csv:2",
            "no data rows",
            id="header-only",
        ),
        pytest.param(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,0,0\nq,abc,1,0,0\n",
            "pods.csv:3",
            "'cpu_milli': 'abc' is not a whole number",
            id="non-numeric",
        ),
        pytest.param(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1.5,1,0,0\n",
            "pods.csv:2",
            "not a whole number",
            id="fraction",
        ),
        pytest.param(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,-1,1,0,0\n",
            "pods.csv:2",
            "negative",
            id="negative",
        ),
        pytest.param(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,0\n",
            "pods.csv:2",
            "expected 5 fields",
            id="short-row",
        ),
        pytest.param(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,1200\n",
            "pods.csv:2",
            "more than one GPU",
            id="over-one-gpu",
        ),
        pytest.param(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,2,500\n",
            "pods.csv:2",
            "needs whole GPUs",
            id="shared-multi-gpu",
        ),
        pytest.param(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,0,300\n",
            "pods.csv:2",
            "with num_gpu 0",
            id="share-without-gpu",
        ),
    ],
)
def test_parse_pods_rejects_bad_input_with_file_and_line(
    text: str, where: str, fragment: str
) -> None:
    with pytest.raises(TraceError) as caught:
        parse_pods(text, source="pods.csv")
    assert str(caught.value).startswith(where + ":")
    assert fragment in str(caught.value)


@pytest.mark.parametrize(
    ("text", "where", "fragment"),
    [
        pytest.param(
            "sn,cpu_milli,memory_mib,gpu\nn,1,1,1\n", "nodes.csv:1", "missing model", id="missing"
        ),
        pytest.param(
            "sn,cpu_milli,memory_mib,gpu,model\nn,1,1,2,\n",
            "nodes.csv:2",
            "no 'model'",
            id="no-model",
        ),
        pytest.param(
            "sn,cpu_milli,memory_mib,gpu,model\nn,1,1,1,T4\nn,1,1,1,T4\n",
            "nodes.csv:3",
            "appears twice",
            id="duplicate",
        ),
        pytest.param(
            "sn,cpu_milli,memory_mib,gpu,model\nn,1,x,1,T4\n", "nodes.csv:2", "memory_mib", id="nan"
        ),
    ],
)
def test_parse_nodes_rejects_bad_input_with_file_and_line(
    text: str, where: str, fragment: str
) -> None:
    with pytest.raises(TraceError) as caught:
        parse_nodes(text, source="nodes.csv")
    assert str(caught.value).startswith(where + ":")
    assert fragment in str(caught.value)
    assert caught.value.source == "nodes.csv"


def test_larger_than_any_node_names_the_pod_and_its_line() -> None:
    nodes = parse_nodes(NODES, source="nodes.csv")
    pods = parse_pods(PODS_SHORT.replace("2,1000", "4,1000"), source="pods.csv")
    why = larger_than_any_node(nodes, pods[0])
    assert why.startswith("pod 'p0' (line 2): ") and why.endswith("is larger than any node")
    assert [larger_than_any_node(nodes, p) for p in pods[1:]] == [""] * (len(pods) - 1)


def test_larger_than_any_node_respects_gpu_models() -> None:
    nodes = parse_nodes(NODES, source="nodes.csv")
    assert "of T4" in larger_than_any_node(nodes, Pod("t4-only", 1000, 1, 1, 500, ("T4",), line=7))
    assert larger_than_any_node(nodes, Pod("p100", 1000, 1, 1, 500, ("P100",))) == ""
