"""gpupart's matching and parsing against Kubernetes' and NVIDIA's own code, on thousands of generated cases.

Aspects: label selectors (absent vs empty, every operator, what Kubernetes refuses to build) and
the PodDisruptionBudget rule of kube-scheduler's preemption; GpuPartition node selection;
required node affinity (nodeSelector, ORed terms, empty terms, Gt/Lt on int64, matchFields,
terms that do not parse); podAntiAffinity terms with namespaces and namespaceSelector (required:
kube-scheduler's Filter; preferred: its Score, weight by weight); resource.Quantity (acceptance
and exact value); MIG profile names (go-nvlib's parser).

The answers come from the real code: tests/k8s/kubernetes/matchref (k8s.io/apimachinery,
k8s.io/component-helpers and kube-scheduler's InterPodAffinity plugin at the pinned v1.37) and
tests/k8s/nvlib/migref (go-nvlib), built by scripts/build-k8s-bins.sh. One process of each
serves every question of the session. Without them these tests skip, and fail where
GPUPART_E2E_REQUIRED=1 (CI).

Generated objects are valid as the API server admits them, plus (where Kubernetes answers them
at all) the malformed pieces its code refuses, so refusals are compared too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from gpupart.core.api.pods import node_constraint
from gpupart.core.api.resources import MAX_QUANTITY, parse_quantity
from gpupart.core.api.selectors import parse_label_selector
from gpupart.core.api.spec import parse_partition
from gpupart.core.errors import InvalidInput
from gpupart.core.mig.catalogue import parse_profile_name
from gpupart.core.scheduling.demand import parse_demand
from gpupart.core.scheduling.preemption import parse_budget
from gpupart.core.scheduling.views import Tenant

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "build-k8s-bins.sh"
HOSTNAME = "kubernetes.io/hostname"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"

# Many examples each, several questions per example: thousands of comparisons per test.
MANY = settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --- the reference programs -------------------------------------------------------------------


def _bin_dir() -> Path:
    env = os.environ.get("GPUPART_K8S_BIN")
    if env:
        return Path(env)
    out = subprocess.run(
        [str(BUILD_SCRIPT), "--print-dir"], check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip())


class Reference:
    """One reference program, asked one JSON question per line."""

    def __init__(self, path: Path) -> None:
        self.process = subprocess.Popen(
            [str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
        )
        self.asked = 0

    def ask_all(self, questions: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The answers, in order (all questions are sent, then all answers read)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("".join(json.dumps(q) + "\n" for q in questions))
        self.process.stdin.flush()
        self.asked += len(questions)
        answers = []
        for question in questions:
            line = self.process.stdout.readline()
            assert line, f"the reference program exited (rc={self.process.poll()})"
            answer = json.loads(line)
            assert "fault" not in answer, f"the reference could not read {question}: {answer}"
            answers.append(answer)
        return answers

    def ask(self, **question: Any) -> dict[str, Any]:
        return self.ask_all([question])[0]

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)


def _reference(name: str) -> Iterator[Reference]:
    path = _bin_dir() / name
    if not os.access(path, os.X_OK):
        message = (
            f"missing {path}: build it with `scripts/build-k8s-bins.sh`, then run pytest with "
            'GPUPART_K8S_BIN="$(scripts/build-k8s-bins.sh --print-dir)"'
        )
        if os.environ.get("GPUPART_E2E_REQUIRED") == "1":
            pytest.fail(f"{message} (GPUPART_E2E_REQUIRED=1 turns this skip into a failure)")
        pytest.skip(message)
    reference = Reference(path)
    yield reference
    reference.close()
    print(f"\n{name}: {reference.asked} questions answered")  # shown with -s or -rP


@pytest.fixture(scope="module")
def kubernetes() -> Iterator[Reference]:
    """tests/k8s/kubernetes/matchref: Kubernetes' own code."""
    yield from _reference("matchref")


@pytest.fixture(scope="module")
def nvidia() -> Iterator[Reference]:
    """tests/k8s/nvlib/migref: NVIDIA's MIG profile parser."""
    yield from _reference("migref")


# --- generated labels, selectors and namespaces, valid per API validation --------------------

KEYS = ["app", "tier", "gpus", "example.com/team", "k8s.io/zone", "t"]
"""A few keys used everywhere, so that selectors and labels meet."""
NUMBERS = [
    "0", "1", "7", "007", "10", "18", "9223372036854775807", "9223372036854775808",
    "1700000000000000000", "18446744073709551616", "00000000000000000000000000001",
]  # fmt: skip
"""Label values read as int64 by Gt/Lt, and some just past int64."""
VALUES = ["", "a", "b", "web", "db", "abc", "1e3", "1.5", "x_y", "v" * 63, *NUMBERS]

PREFIX_253 = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])
"""A DNS subdomain of 253 characters, the longest a key's prefix may be."""
EDGE_KEYS = ["k" * 63, f"{PREFIX_253}/k"]

_name = st.from_regex(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,8}[A-Za-z0-9])?", fullmatch=True)
_prefix = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,4}[a-z0-9])?(\.[a-z0-9]{1,4}){0,2}", fullmatch=True)
label_keys = st.one_of(
    st.sampled_from(KEYS),
    st.sampled_from(EDGE_KEYS),
    _name,
    st.builds(lambda p, n: f"{p}/{n}", _prefix, _name),
)
label_values = st.one_of(
    st.sampled_from(VALUES),
    _name,
    st.integers(0, 2**64).map(str),
)
labels = st.dictionaries(label_keys, label_values, max_size=5)

BAD_KEYS = [
    "",
    "bad key",
    "-a",
    "a-",
    "a/b/c",
    "/a",
    "Example.com/a",
    "x\n",
    "k" * 64,
    f"{PREFIX_253}e/k",
]
BAD_VALUES = ["-a", "a b", "ü", "a\n", "v" * 64]


def _requirement(
    keys: st.SearchStrategy[str], operators: list[str], values: st.SearchStrategy[str]
) -> st.SearchStrategy[dict[str, Any]]:
    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        operator = draw(st.sampled_from(operators))
        if operator in ("In", "NotIn"):
            chosen = draw(st.lists(values, min_size=1, max_size=3))
        elif operator in ("Gt", "Lt"):
            chosen = [draw(values)]
        else:
            chosen = []
        requirement: dict[str, Any] = {"key": draw(keys), "operator": operator}
        if chosen or draw(st.booleans()):
            requirement["values"] = chosen
        return requirement

    return build()


SELECTOR_OPERATORS = ["In", "NotIn", "Exists", "DoesNotExist"]


@st.composite
def label_selectors(
    draw: st.DrawFn,
    *,
    valid: bool = True,
    keys: st.SearchStrategy[str] = label_keys,
    values: st.SearchStrategy[str] = label_values,
    operators: list[str] | None = None,
) -> dict[str, Any] | None:
    """A metav1.LabelSelector: None, {}, or matchLabels and matchExpressions."""
    kind = draw(st.sampled_from(["none", "empty", "empty-lists", "some"]))
    if kind == "none":
        return None
    if kind == "empty":
        return {}
    if kind == "empty-lists":
        return {"matchLabels": {}, "matchExpressions": []}
    operators = operators or SELECTOR_OPERATORS
    if not valid:
        keys = st.one_of(keys, st.sampled_from(BAD_KEYS))
        values = st.one_of(values, st.sampled_from(BAD_VALUES))
        operators = [*SELECTOR_OPERATORS, "Gt", "in", ""]
    selector: dict[str, Any] = {}
    if draw(st.booleans()):
        selector["matchLabels"] = draw(st.dictionaries(keys, values, max_size=3))
    expressions = draw(st.lists(_requirement(keys, operators, values), max_size=3))
    if not valid and expressions and draw(st.booleans()):
        # The wrong number of values for the operator.
        expressions[0]["values"] = [] if expressions[0]["operator"] in ("In", "NotIn") else ["a"]
    if expressions or draw(st.booleans()):
        selector["matchExpressions"] = expressions
    return selector


# --- label selectors, PodDisruptionBudgets, GpuPartitions -----------------------------------


@MANY
@given(
    selector=label_selectors(valid=False),
    # Pods without labels often: kube-scheduler's preemption never counts them under a budget.
    sets=st.lists(st.one_of(st.just({}), labels), min_size=1, max_size=6),
    namespaces=st.lists(st.sampled_from(["a", "b"]), min_size=6, max_size=6),
)
def test_law_label_selectors_match_as_kubernetes_builds_and_matches_them(
    kubernetes: Reference,
    selector: dict[str, Any] | None,
    sets: list[dict[str, str]],
    namespaces: list[str],
) -> None:
    answers = kubernetes.ask_all(
        [{"op": "selector", "selector": selector, "labels": s} for s in sets]
    )
    refused = bool(answers[0]["error"])
    event(f"Kubernetes refuses the selector: {refused}")
    try:
        ours = parse_label_selector(selector, "spec.selector")
    except InvalidInput as error:
        assert refused, f"Kubernetes builds {selector}, gpupart refused it: {error}"
        assert error.where.startswith("spec.selector")
        ours = None
    else:
        assert not refused, f"Kubernetes refuses {selector} ({answers[0]['error']}), gpupart not"
    # A PodDisruptionBudget in namespace "a" (kube-scheduler's filterPodsWithPDBViolation: a
    # pod without labels, in another namespace, or under a selector that is empty or does not
    # build, is not covered).
    pdb = {"metadata": {"name": "b", "namespace": "a"}, "spec": {"selector": selector}}
    for these, answer, namespace in zip(sets, answers, namespaces, strict=False):
        covered_by_kubernetes = (
            not answer["error"]
            and bool(these)
            and namespace == "a"
            and not answer["empty"]
            and answer["matches"]
        )
        tenant = Tenant(f"{namespace}/p", namespace, tuple(sorted(these.items())))
        if ours is None:
            continue  # the extender counts an unreadable budget for no pod
        assert ours.matches(these) == answer["matches"], (selector, these)
        assert ours.empty == answer["empty"], selector
        assert parse_budget(pdb).covers(tenant) == covered_by_kubernetes, (selector, these)


@MANY
@given(selector=label_selectors(valid=False), sets=st.lists(labels, min_size=1, max_size=6))
def test_law_gpupartition_node_selection_is_kubernetes_label_selection(
    kubernetes: Reference, selector: dict[str, Any] | None, sets: list[dict[str, str]]
) -> None:
    assume(selector is not None)  # an absent nodeSelector selects every node (the CRD's rule)
    document = {
        "apiVersion": "gpupart.io/v1alpha1",
        "kind": "GpuPartition",
        "metadata": {"name": "p"},
        "spec": {"mode": "None", "nodeSelector": selector},
    }
    answers = kubernetes.ask_all(
        [{"op": "selector", "selector": selector, "labels": s} for s in sets]
    )
    try:
        spec = parse_partition(document)
    except InvalidInput as error:
        assert answers[0]["error"], f"Kubernetes builds {selector}; gpupart refused: {error}"
        return
    assert not answers[0]["error"], f"Kubernetes refuses {selector}: {answers[0]['error']}"
    for these, answer in zip(sets, answers, strict=True):
        assert spec.node_selector.matches(these) == answer["matches"], (selector, these)


# --- required node affinity --------------------------------------------------------------------

NODE_OPERATORS = [*SELECTOR_OPERATORS, "Gt", "Lt"]
NODE_NAMES = ["n1", "n2"]


@st.composite
def node_selector_terms(draw: st.DrawFn) -> dict[str, Any]:
    term: dict[str, Any] = {}
    values = st.one_of(label_values, st.sampled_from(NUMBERS))
    if draw(st.booleans()):
        term["matchExpressions"] = draw(
            st.lists(_requirement(label_keys, NODE_OPERATORS, values), max_size=3)
        )
    if draw(st.booleans()):
        term["matchFields"] = draw(
            st.lists(
                st.builds(
                    lambda op, name: {"key": "metadata.name", "operator": op, "values": [name]},
                    st.sampled_from(["In", "NotIn"]),
                    st.sampled_from(NODE_NAMES),
                ),
                max_size=2,
            )
        )
    if draw(st.integers(0, 9)) == 0:
        # What API validation refuses but kube-scheduler still reads (an old object, or one
        # stored before a rule existed): the term does not parse, and matches no node.
        term["matchExpressions"] = [
            draw(
                st.sampled_from(
                    [
                        {"key": "app", "operator": "Near", "values": ["a"]},
                        {"key": "bad key", "operator": "Exists"},
                        {"key": "app", "operator": "In", "values": ["-a"]},
                        {"key": "gpus", "operator": "Gt", "values": ["1", "2"]},
                        {"key": "app", "operator": "In"},
                        # An int64, but no label value: labels.NewRequirement refuses it.
                        {"key": "gpus", "operator": "Gt", "values": ["-1"]},
                        {"key": "gpus", "operator": "Lt", "values": ["+50"]},
                    ]
                )
            )
        ]
    return term


@st.composite
def node_affinity_pods(draw: st.DrawFn) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if draw(st.booleans()):
        spec["nodeSelector"] = draw(
            st.dictionaries(st.sampled_from(KEYS), st.sampled_from(VALUES), max_size=2)
        )
    shape = draw(st.sampled_from(["none", "no-required", "required", "required-empty"]))
    if shape == "no-required":
        spec["affinity"] = {"nodeAffinity": {}}
    elif shape == "required":
        terms = draw(st.lists(node_selector_terms(), max_size=3))
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}
            }
        }
    elif shape == "required-empty":
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}
    return {"metadata": {"name": "p", "namespace": "a"}, "spec": spec}


nodes = st.builds(
    lambda name, these: {"metadata": {"name": name, "labels": these}},
    st.sampled_from([*NODE_NAMES, "", ""]),  # a node without a name has no fields
    st.dictionaries(
        st.sampled_from(KEYS),
        st.one_of(st.sampled_from(VALUES), st.integers(0, 2**64).map(str)),
        max_size=4,
    ),
)


@MANY
@given(pod=node_affinity_pods(), candidates=st.lists(nodes, min_size=1, max_size=6))
def test_law_node_constraint_allows_the_nodes_kube_scheduler_allows(
    kubernetes: Reference, pod: dict[str, Any], candidates: list[dict[str, Any]]
) -> None:
    answers = kubernetes.ask_all(
        [{"op": "nodeAffinity", "pod": pod, "node": n} for n in candidates]
    )
    constraint = node_constraint(pod)
    for node, answer in zip(candidates, answers, strict=True):
        event(f"node allowed: {answer['matches']}")
        meta = node["metadata"]
        assert constraint.allows(meta["labels"], meta["name"]) == answer["matches"], (
            pod["spec"],
            node,
        )


int_texts = st.one_of(
    st.sampled_from(NUMBERS),
    st.integers(0, 40).map(str),
    st.integers(2**63 - 3, 2**63 + 3).map(str),
    st.integers(0, 2**63 - 1).map(str),
    st.sampled_from(["", "abc", "0x10", "1e3"]),
)


@MANY
@given(
    cases=st.lists(
        st.tuples(st.sampled_from(["Gt", "Lt"]), int_texts, st.one_of(st.none(), int_texts)),
        min_size=1,
        max_size=8,
    )
)
def test_law_gt_and_lt_compare_as_kubernetes_compares(
    kubernetes: Reference, cases: list[tuple[str, str, str | None]]
) -> None:
    """One requirement on label t: the bound, and the node's label (None: the node lacks it)."""
    questions = []
    for operator, bound, label in cases:
        expression = {"key": "t", "operator": operator, "values": [bound]}
        required = {"nodeSelectorTerms": [{"matchExpressions": [expression]}]}
        pod = {"spec": {"affinity": {"nodeAffinity": {REQUIRED: required}}}}
        labels_of = {} if label is None else {"t": label}
        questions.append(
            {
                "op": "nodeAffinity",
                "pod": pod,
                "node": {"metadata": {"name": "n", "labels": labels_of}},
            }
        )
    answers = kubernetes.ask_all(questions)
    for question, answer in zip(questions, answers, strict=True):
        labels_of = question["node"]["metadata"]["labels"]
        assert node_constraint(question["pod"]).allows(labels_of, "n") == answer["matches"], (
            question
        )


# --- podAntiAffinity terms ---------------------------------------------------------------------

NAMESPACES = ["a", "b", "team-x"]
_namespace_keys = st.sampled_from(["team", "env", "k8s.io/tier"])
_namespace_values = st.sampled_from(["", "1", "gpu", "x"])
namespace_labels = st.dictionaries(_namespace_keys, _namespace_values, max_size=2)


@st.composite
def pod_affinity_terms(draw: st.DrawFn) -> dict[str, Any]:
    term: dict[str, Any] = {"topologyKey": HOSTNAME}
    selector = draw(label_selectors())
    if selector is not None or draw(st.booleans()):
        term["labelSelector"] = selector
    if draw(st.booleans()):
        term["namespaces"] = draw(
            st.lists(st.sampled_from([*NAMESPACES, "unknown"]), max_size=2, unique=True)
        )
    namespace_selector = draw(
        st.one_of(
            st.just("absent"),
            label_selectors(keys=_namespace_keys, values=_namespace_values),
            label_selectors(),
        )
    )
    if namespace_selector != "absent":
        term["namespaceSelector"] = namespace_selector
    if term.get("labelSelector") is not None and draw(st.integers(0, 3)) == 0:
        # Merged into labelSelector by the API server at admission; read by nobody after.
        term["matchLabelKeys"] = draw(st.lists(st.sampled_from(KEYS), max_size=2, unique=True))
    return term


@st.composite
def anti_affinity_cases(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    namespace = draw(st.sampled_from(NAMESPACES))
    required = draw(st.lists(pod_affinity_terms(), max_size=2))
    preferred = draw(st.lists(pod_affinity_terms(), max_size=4))
    anti: dict[str, Any] = {}
    if required:
        anti["requiredDuringSchedulingIgnoredDuringExecution"] = required
    if preferred:
        # Weights 1, 2, 4, 8: the score tells which terms matched.
        anti["preferredDuringSchedulingIgnoredDuringExecution"] = [
            {"weight": 1 << n, "podAffinityTerm": t} for n, t in enumerate(preferred)
        ]
    pod = {
        "metadata": {"name": "p", "namespace": namespace, "labels": draw(labels)},
        "spec": {
            "affinity": {"podAntiAffinity": anti},
            "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu.shared": "1"}}}],
        },
    }
    existing = {
        "metadata": {
            "name": "e",
            "namespace": draw(st.sampled_from([*NAMESPACES, "unknown"])),
            "labels": draw(labels),
        }
    }
    known = draw(st.dictionaries(st.sampled_from(NAMESPACES), namespace_labels, max_size=3))
    namespaces = [{"metadata": {"name": n, "labels": ls}} for n, ls in sorted(known.items())]
    return pod, existing, namespaces


@MANY
@given(case=anti_affinity_cases())
def test_law_anti_affinity_terms_select_the_pods_kube_scheduler_selects(
    kubernetes: Reference, case: tuple[dict[str, Any], dict[str, Any], list[Any]]
) -> None:
    pod, existing, namespaces = case
    answer = kubernetes.ask(op="podAffinity", pod=pod, existing=existing, namespaces=namespaces)
    assert not answer["error"], answer
    known = {n["metadata"]["name"]: n["metadata"]["labels"] for n in namespaces}
    demand = parse_demand(pod, anti_affinity_label="", namespace_labels=known)
    meta = existing["metadata"]
    tenant = Tenant("x/e", meta["namespace"], tuple(sorted(meta["labels"].items())))
    required = [t for t in demand.terms if t.required]
    preferred = [t for t in demand.terms if not t.required]
    shown = json.dumps(case)
    event(f"node filtered: {answer['filtered']}, scored: {answer['score'] != 0}")
    assert any(t.matches(tenant) for t in required) == answer["filtered"], shown
    # kube-scheduler's raw score: minus the weight of each preferred term that matches.
    matched = -sum(1 << n for n, t in enumerate(preferred) if t.matches(tenant))
    assert matched == answer["score"], shown


@st.composite
def namespace_selectors(draw: st.DrawFn) -> dict[str, Any] | None:
    """Mostly selectors that pick some namespaces by their labels; also None, {} and ones
    that match a namespace without labels."""
    kind = draw(st.sampled_from(["labels", "labels", "in", "exists", "negative", "none", "empty"]))
    if kind == "none":
        return None
    if kind == "empty":
        return {}
    if kind == "labels":
        return {
            "matchLabels": draw(
                st.dictionaries(_namespace_keys, _namespace_values, min_size=1, max_size=2)
            )
        }
    key = draw(_namespace_keys)
    if kind == "in":
        values = draw(st.lists(_namespace_values, min_size=1, max_size=2))
        return {"matchExpressions": [{"key": key, "operator": "In", "values": values}]}
    if kind == "exists":
        return {"matchExpressions": [{"key": key, "operator": "Exists"}]}
    operator = draw(st.sampled_from(["NotIn", "DoesNotExist"]))
    expression = {"key": key, "operator": operator}
    if operator == "NotIn":
        expression["values"] = [draw(_namespace_values)]
    return {"matchExpressions": [expression]}


@MANY
@given(
    known=st.dictionaries(st.sampled_from(NAMESPACES), namespace_labels, min_size=1, max_size=3),
    own=st.sampled_from(NAMESPACES),
    listed=st.one_of(
        st.none(), st.lists(st.sampled_from([*NAMESPACES, "unknown"]), max_size=2, unique=True)
    ),
    selector=st.one_of(st.just("absent"), namespace_selectors()),
)
def test_law_the_namespaces_a_term_looks_at_are_kube_schedulers(
    kubernetes: Reference,
    known: dict[str, dict[str, str]],
    own: str,
    listed: list[str] | None,
    selector: dict[str, Any] | None | str,
) -> None:
    """One required term selecting every pod by its labels (`{}`), so that only its namespaces
    decide; asked for a pod in each namespace, known or not."""
    term: dict[str, Any] = {"topologyKey": HOSTNAME, "labelSelector": {}}
    if listed is not None:
        term["namespaces"] = listed
    if selector != "absent":
        term["namespaceSelector"] = selector
    anti = {"podAntiAffinity": {REQUIRED: [term]}}
    shared = {"limits": {"nvidia.com/gpu.shared": "1"}}
    pod = {
        "metadata": {"name": "p", "namespace": own},
        "spec": {"affinity": anti, "containers": [{"name": "c", "resources": shared}]},
    }
    namespaces = [{"metadata": {"name": n, "labels": ls}} for n, ls in sorted(known.items())]
    where = [*NAMESPACES, "unknown"]
    answers = kubernetes.ask_all(
        [
            {
                "op": "podAffinity",
                "pod": pod,
                "existing": {"metadata": {"name": "e", "namespace": n, "labels": {}}},
                "namespaces": namespaces,
            }
            for n in where
        ]
    )
    (ours,) = parse_demand(pod, anti_affinity_label="", namespace_labels=known).terms
    for namespace, answer in zip(where, answers, strict=True):
        event(f"a pod in the namespace is selected: {answer['filtered']}")
        assert ours.matches(_tenant_in(namespace)) == answer["filtered"], (term, known, namespace)


def _tenant_in(namespace: str) -> Tenant:
    return Tenant(f"{namespace}/e", namespace, ())


_FEW_VALUES = st.sampled_from(["", "a", "web", "db"])
_few_labels = st.dictionaries(st.sampled_from(KEYS), _FEW_VALUES, max_size=3)


@MANY
@given(
    selector=label_selectors(
        keys=st.sampled_from(KEYS),
        values=_FEW_VALUES,
        operators=["NotIn", "DoesNotExist", "NotIn", "In", "Exists"],
    ),
    sets=st.lists(st.one_of(st.just({}), _few_labels), min_size=1, max_size=6),
)
def test_law_budgets_cover_the_pods_kube_schedulers_preemption_counts(
    kubernetes: Reference, selector: dict[str, Any] | None, sets: list[dict[str, str]]
) -> None:
    """kube-scheduler's filterPodsWithPDBViolation: a pod is under a budget of its namespace
    when it has labels, the selector builds, is not empty, and matches them."""
    answers = kubernetes.ask_all(
        [{"op": "selector", "selector": selector, "labels": s} for s in sets]
    )
    budget = parse_budget(
        {"metadata": {"name": "b", "namespace": "a"}, "spec": {"selector": selector}}
    )
    for these, answer in zip(sets, answers, strict=True):
        counted = bool(these) and not answer["empty"] and answer["matches"]
        event(f"counted: {counted}")
        tenant = Tenant("a/p", "a", tuple(sorted(these.items())))
        assert budget.covers(tenant) == counted, (selector, these)


# --- resource.Quantity ----------------------------------------------------------------------------


@st.composite
def quantity_texts(draw: st.DrawFn) -> str:
    sign = draw(st.sampled_from(["", "", "+", "-"]))
    whole = draw(st.from_regex(r"0{0,3}[0-9]{0,22}", fullmatch=True))
    point = draw(st.sampled_from(["", "", "."]))
    fraction = draw(st.from_regex(r"[0-9]{0,22}", fullmatch=True)) if point else ""
    suffix = draw(
        st.one_of(
            st.sampled_from(["", "n", "u", "m", "k", "M", "G", "T", "P", "E"]),
            st.sampled_from(["Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "ki", "K", "i", "mi"]),
            st.from_regex(r"[eE][+-]?0{0,3}[0-9]{1,4}", fullmatch=True),
            st.sampled_from(["e", "E+", "e-", "eE5", "e5e", "e4294967297", "e-4294967297"]),
            st.sampled_from(["e-4294967306", "E4294967295", "e9223372036854775807", "e-999999999"]),
        )
    )
    text = sign + whole + point + fraction + suffix
    junk = draw(st.sampled_from(["", "", "", "", " ", "\n", "\t", "\x00", "١", "x", "\u00a0"]))
    place = draw(st.sampled_from(["start", "end", "middle"]))
    if place == "start":
        return junk + text
    if place == "end":
        return text + junk
    cut = len(text) // 2
    return text[:cut] + junk + text[cut:]


_EXPONENT_AT_END = re.compile(r"[eE]([+-]?[0-9]{1,25})")


def _slow_for_kubernetes(text: str) -> bool:
    """Whether Kubernetes would compute 10^|e| for a large e: it keeps an int64 exponent's low
    32 bits (so 1e4294967297 is 1e1), and 1e-99999999 takes it over a minute (1e-2147483648
    for ever). Such texts are not asked; gpupart's answers to them are checked alone."""
    found = _EXPONENT_AT_END.search(text)
    if not found or found.end() != len(text):
        return False
    exponent = int(found.group(1))
    if not -(2**63) <= exponent < 2**63:
        return False  # refused at once: the exponent is no int64
    kept = (exponent + 2**31) % 2**32 - 2**31
    return abs(kept) >= 10**6


_NO_DIGITS = re.compile(r"[+-]?\.?([eEinumkKMGTP].*)?")
"""A mantissa without a digit (`+`, `.`, `Ki`): Kubernetes reads it as 0; gpupart refuses it."""


def _value(answer: dict[str, Any]) -> Fraction:
    """Kubernetes' exact value; one of more than 30 digits as ±10^30 (past any bound here, and
    Python reads no more than 4300 digits as an int)."""
    text = answer["value"]
    if "." in text:  # a zero keeps its scale: 0e-5000 is "0.000…" with 5000 zeros
        text = text.rstrip("0").rstrip(".")
    if len(text.lstrip("-").split(".")[0]) > 30:
        return Fraction(-(10**30) if text.startswith("-") else 10**30)
    return Fraction(text)


@MANY
@given(texts=st.lists(st.one_of(quantity_texts(), st.text(max_size=12)), min_size=1, max_size=8))
def test_law_quantities_are_read_as_resource_quantity_reads_them(
    kubernetes: Reference, texts: list[str]
) -> None:
    for text in [t for t in texts if _slow_for_kubernetes(t)]:
        try:
            value = parse_quantity(text, where="x")
        except InvalidInput:
            continue
        assert abs(value) <= Fraction(1, 10**9), f"{text!r} read as {value}"  # a tiny exponent
    texts = [t for t in texts if not _slow_for_kubernetes(t)]
    answers = kubernetes.ask_all([{"op": "quantity", "text": t} for t in texts])
    for text, answer in zip(texts, answers, strict=True):
        event(f"Kubernetes refuses a quantity: {bool(answer['error'])}")
        try:
            ours = parse_quantity(text, where="x")
        except InvalidInput as error:
            assert error.where == "x"
            if answer["error"]:
                continue
            theirs = _value(answer)
            # Where gpupart refuses what Kubernetes reads, it is one of the documented cases.
            assert (
                len(text) > 64
                or _NO_DIGITS.fullmatch(text)
                or abs(theirs) > MAX_QUANTITY
                or re.search(r"[eE][+-]?0*[0-9]{10}", text)
            ), f"Kubernetes reads {text!r} as {theirs}; gpupart refused it: {error}"
        else:
            assert not answer["error"], f"Kubernetes refuses {text!r} ({answer['error']})"
            assert ours == _value(answer), text


@pytest.mark.parametrize(
    "text",
    [
        "5\n",
        " 5",
        "5 ",
        "\t1Gi",
        "1Gi\x00",
        "1\u00a0",
        "١٠",
        "1e-99999999999999999999",
        "1e4294967297",
        "1e-4294967297",
        "+",
        ".",
        "Ki",
    ],
)
def test_what_kubernetes_refuses_or_misreads_is_refused(kubernetes: Reference, text: str) -> None:
    """Refused by gpupart; Kubernetes refuses it too, or reads it as something else (an
    exponent truncated to 32 bits, a digit-less spelling read as 0)."""
    answer = kubernetes.ask(op="quantity", text=text)
    with pytest.raises(InvalidInput, match="^x: "):
        parse_quantity(text, where="x")
    misread = {"1e4294967297": 10, "1e-4294967297": Fraction(1, 10), "+": 0, ".": 0, "Ki": 0}
    assert answer["error"] or _value(answer) == misread[text], answer


# --- MIG profile names -----------------------------------------------------------------------------

ATTRIBUTES = {
    "": ([], []),
    "+me": (["me"], []),
    "+me.all": (["me.all"], []),
    "+gfx": (["gfx"], []),
    "-me": ([], ["me"]),
}


@st.composite
def profile_texts(draw: st.DrawFn) -> str:
    """Names in gpupart's grammar (most), and near misses: NVIDIA's other spellings, junk."""
    gigabytes = draw(
        st.one_of(st.integers(0, 200), st.integers(0, 10**18 - 1)).map(str)
        | st.sampled_from(["0010", "0" * 30 + "5"])
    )
    if draw(st.integers(0, 7)) == 0:
        gigabytes = str(draw(st.integers(10**18, 10**25)))  # past what Atoi reads
    if draw(st.integers(0, 7)) == 0:
        cut = len(gigabytes) // 2  # another script's digit among ASCII ones
        gigabytes = gigabytes[:cut] + draw(st.sampled_from(["١", "٣", "𝟘", "_"])) + gigabytes[cut:]
    if draw(st.integers(0, 3)):
        compute = draw(st.sampled_from(["", "1c.", "2c.", "3c.", "7c."]))
        slices = draw(st.sampled_from("1234567"))
        return f"{compute}{slices}g.{gigabytes}gb{draw(st.sampled_from(sorted(ATTRIBUTES)))}"
    compute = draw(st.sampled_from(["", "1c.", "8c.", "0c.", "+1c.", "1c", "c."]))
    slices = draw(st.sampled_from(["1", "7", "8", "0", "01", "+1", "١", ""]))
    if draw(st.booleans()):
        gigabytes = str(draw(st.integers(10**18, 10**25)))
    suffix = draw(
        st.sampled_from(
            [*ATTRIBUTES, "+ME", "+me,gfx", "-gfx", "+", "-", "+me.", "+1me", "-me,me", "+me-me"]
        )
    )
    text = f"{compute}{slices}g.{gigabytes}gb{suffix}"
    junk = draw(st.sampled_from(["", " ", "\n", "\t", "١", "x", "\x00"]))
    return draw(st.sampled_from([text + junk, junk + text, text]))


@MANY
@given(
    texts=st.lists(
        st.one_of(profile_texts(), profile_texts(), st.text(max_size=16)), min_size=1, max_size=8
    )
)
def test_law_a_profile_name_gpupart_reads_is_the_same_profile_to_nvidia(
    nvidia: Reference, texts: list[str]
) -> None:
    for text in texts:
        try:
            compute, slices, gigabytes, suffix = parse_profile_name(text, where="x")
        except InvalidInput as error:
            assert error.where == "x"
            event("gpupart refuses a profile name")
            continue
        event("gpupart reads a profile name")
        positive, negative = ATTRIBUTES[suffix]
        info = {
            "c": compute, "g": slices, "gb": gigabytes,
            "attributes": positive, "negAttributes": negative,
        }  # fmt: skip
        answer = nvidia.ask(op="profile", text=text, info=info)
        assert not answer["error"], f"NVIDIA refuses {text!r}: {answer['error']}"
        assert answer["matches"], f"{text!r} is another profile to NVIDIA than {info}"


profiles = st.tuples(
    st.integers(1, 7),
    st.integers(1, 7),
    st.integers(0, 10**18 - 1),
    st.sampled_from(sorted(ATTRIBUTES)),
)


@MANY
@given(chosen=st.lists(profiles, min_size=1, max_size=8))
def test_law_every_name_nvidia_gives_a_profile_reads_back_as_that_profile(
    nvidia: Reference, chosen: list[tuple[int, int, int, str]]
) -> None:
    infos = [
        {
            "c": c,
            "g": g,
            "gb": gb,
            "attributes": ATTRIBUTES[s][0],
            "negAttributes": ATTRIBUTES[s][1],
        }
        for c, g, gb, s in chosen
    ]
    answers = nvidia.ask_all([{"op": "name", "info": info} for info in infos])
    for profile, answer in zip(chosen, answers, strict=True):
        assert parse_profile_name(answer["name"], where="x") == profile, answer


def test_the_references_answer_what_gpupart_fixed(kubernetes: Reference) -> None:
    """The issue's cases, straight from Kubernetes (so a reference that drifts shows here)."""
    empty_term = {
        "spec": {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{}]}
                }
            }
        }
    }
    node = {"metadata": {"name": "n1", "labels": {"app": "a"}}}
    assert kubernetes.ask(op="nodeAffinity", pod=empty_term, node=node)["matches"] is False
    assert not node_constraint(empty_term).allows({"app": "a"}, "n1")
    stamp = {
        "spec": {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": "t",
                                        "operator": "Gt",
                                        "values": ["1700000000000000000"],
                                    }
                                ]
                            }
                        ]
                    }
                }
            }
        }
    }
    later = {"metadata": {"name": "n1", "labels": {"t": "1700000000000000001"}}}
    assert kubernetes.ask(op="nodeAffinity", pod=stamp, node=later)["matches"] is True
    assert node_constraint(stamp).allows({"t": "1700000000000000001"}, "n1")
