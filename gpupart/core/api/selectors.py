"""Kubernetes label matching as kube-scheduler does it: label selectors, node affinity, pod affinity terms (pure).

Every match gpupart makes goes through here: GpuPartition node selection, a pending pod's
nodes (the dynamic planner), PodDisruptionBudgets (preemption) and podAntiAffinity terms (the
extender). The rules are those of the Kubernetes v1.37 code that kube-scheduler runs:
k8s.io/apimachinery `labels` and `metav1.LabelSelectorAsSelector`, k8s.io/component-helpers
`nodeaffinity`, and kube-scheduler's interpodaffinity plugin. tests/core/test_reference_kubernetes.py
asks that code the same questions and compares every answer.

- A label selector that is absent (nil) matches nothing; an empty one (`{}`) matches
  everything. `NotIn` and `DoesNotExist` match a node or pod without the label; `In`,
  `Exists`, `Gt` and `Lt` need it. `Gt`/`Lt` compare base-10 int64s (`strconv.ParseInt`): a
  label that is not one never matches.
- Required node affinity: the pod's `nodeSelector` (every pair equal) and the terms, ORed. A
  term with neither matchExpressions nor matchFields matches no node, so does a term that does
  not parse (an unknown operator, a `Gt` bound that is not an integer: kube-scheduler's "lazy"
  errors drop that term only), and so does an empty `nodeSelectorTerms`.
- A pod affinity term looks at the pod's own namespace when it has neither `namespaces` nor a
  `namespaceSelector`; otherwise at the listed namespaces plus the known ones whose labels the
  `namespaceSelector` matches (a namespace the caller does not know is not selected by its
  labels, as kube-scheduler's lister does not list it). Only an empty `namespaceSelector`
  (`{}`) takes every namespace, known or not. kube-scheduler v1.37's PreFilter merges the
  selected namespaces into the term itself (`mergeAffinityTermNamespacesIfNotEmpty` takes
  `*fwk.AffinityTerm`), so a non-empty selector that matches no labels (`NotIn`,
  `DoesNotExist`) takes the known namespaces it matches and no other; v1.36 took a copy and
  so every namespace (a 1.36 scheduler answers so; gpupart follows the pinned 1.37 code).
- `matchLabelKeys` and `mismatchLabelKeys` are not read: the API server merges them into
  `labelSelector` when it admits the pod (MatchLabelKeysInPodAffinity, GA and locked on since
  v1.33), and kube-scheduler reads only the merged `labelSelector`.

Structural garbage (a string where a list belongs) is InvalidInput naming the field; so is a
label selector Kubernetes refuses to build (kube-scheduler then refuses the pod).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from gpupart.core.errors import InvalidInput, shown

NamespaceLabels = Mapping[str, Mapping[str, str]]
"""Namespace name -> its labels, for every Namespace the caller knows (its watch cache)."""

_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_INT64_TEXT = re.compile(r"[+-]?[0-9]+")
_INT64_DIGITS = 19
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class Operator(StrEnum):
    """A requirement's operator (metav1.LabelSelectorOperator; Gt and Lt: node affinity only)."""

    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"
    GT = "Gt"
    LT = "Lt"


SELECTOR_OPERATORS = (Operator.IN, Operator.NOT_IN, Operator.EXISTS, Operator.DOES_NOT_EXIST)
"""What a metav1.LabelSelector's matchExpressions may use."""
NODE_OPERATORS = (*SELECTOR_OPERATORS, Operator.GT, Operator.LT)
"""What a node selector requirement may use."""


def parse_int64(text: str) -> int | None:
    """`text` as Go's `strconv.ParseInt(text, 10, 64)` reads it; None where that fails.

    An optional sign and ASCII digits only (no spaces, underscores or other scripts' digits),
    within int64; any length is read in time linear in it.
    """
    if not _INT64_TEXT.fullmatch(text):
        return None
    digits = text.lstrip("+-").lstrip("0")
    if len(digits) > _INT64_DIGITS:
        return None
    value = int(digits or "0")
    value = -value if text[0] == "-" else value
    return value if INT64_MIN <= value <= INT64_MAX else None


def check_label_key(key: str, *, where: str) -> str:
    """`key` when it is a Kubernetes label key ([prefix/]name), else InvalidInput naming it."""
    prefix, slash, name = key.rpartition("/")
    problem = ""
    if len(name) > 63 or not _LABEL_NAME.fullmatch(name):
        problem = "its name must be 1-63 letters, digits, '-', '_' or '.', starting and ending alphanumeric"
    elif slash and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        problem = "its prefix must be a DNS subdomain of at most 253 characters (e.g. example.com)"
    if problem:
        raise InvalidInput(where, f"{shown(key)} is not a label key: {problem}")
    return key


def check_label_value(value: str, where: str) -> str:
    """`value` when it is a Kubernetes label value (empty, or a name of up to 63 characters)."""
    if value and (len(value) > 63 or not _LABEL_NAME.fullmatch(value)):
        raise InvalidInput(
            where,
            f"{shown(value)} is not a label value: at most 63 letters, digits, '-', '_' or '.', "
            "starting and ending alphanumeric",
        )
    return value


@dataclass(frozen=True, slots=True, order=True)
class Requirement:
    """One requirement of a selector (labels.Requirement); build it with `requirement`."""

    key: str
    operator: Operator
    values: tuple[str, ...] = ()
    bound: int = 0
    """`Gt`/`Lt`: the value as an int64."""

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        operator = self.operator
        if operator is Operator.IN:
            return value is not None and value in self.values
        if operator is Operator.NOT_IN:
            return value is None or value not in self.values
        if operator is Operator.EXISTS:
            return value is not None
        if operator is Operator.DOES_NOT_EXIST:
            return value is None
        number = None if value is None else parse_int64(value)
        if number is None:
            return False
        return number > self.bound if operator is Operator.GT else number < self.bound


def requirement(key: str, operator: Operator, values: Sequence[str], *, where: str) -> Requirement:
    """A Requirement checked as `labels.NewRequirement` checks it; InvalidInput names the field."""
    check_label_key(key, where=f"{where}.key")
    bound = 0
    if operator in (Operator.IN, Operator.NOT_IN) and not values:
        raise InvalidInput(f"{where}.values", f"{operator} needs at least one value")
    if operator in (Operator.EXISTS, Operator.DOES_NOT_EXIST) and values:
        raise InvalidInput(f"{where}.values", f"{operator} takes no values")
    if operator in (Operator.GT, Operator.LT):
        if len(values) != 1:
            raise InvalidInput(f"{where}.values", f"{operator} takes exactly one value")
        number = parse_int64(values[0])
        if number is None:
            raise InvalidInput(
                f"{where}.values[0]", f"{shown(values[0])} is not an integer (int64) for {operator}"
            )
        bound = number
    for position, value in enumerate(values):
        check_label_value(value, f"{where}.values[{position}]")
    return Requirement(key, operator, tuple(values), bound)


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """A selector over labels (labels.Selector): every requirement must match.

    `EVERYTHING` (no requirements) matches all; `NOTHING` (an absent selector) matches none.
    Requirements are kept sorted, so equal selectors compare and hash equal.
    """

    requirements: tuple[Requirement, ...] = ()
    nothing: bool = False

    def matches(self, labels: Mapping[str, str]) -> bool:
        return not self.nothing and all(r.matches(labels) for r in self.requirements)

    @property
    def empty(self) -> bool:
        """`labels.Selector.Empty()`: the selector of `{}`, matching everything (never NOTHING)."""
        return not self.nothing and not self.requirements


EVERYTHING = LabelSelector()
NOTHING = LabelSelector(nothing=True)


def selector_from_set(labels: Mapping[str, str]) -> LabelSelector:
    """`labels.SelectorFromSet`: every pair must be equal; an empty set matches everything.

    Unvalidated, as kube-scheduler builds it from a pod's `spec.nodeSelector`.
    """
    return LabelSelector(
        tuple(Requirement(k, Operator.IN, (v,)) for k, v in sorted(labels.items()))
    )


def selector_of(requirements: Iterable[Requirement]) -> LabelSelector:
    """The selector of these requirements, all ANDed (none: EVERYTHING)."""
    return LabelSelector(tuple(sorted(requirements)))


def parse_label_selector(raw: object, where: str) -> LabelSelector:
    """A metav1.LabelSelector as `metav1.LabelSelectorAsSelector` reads it.

    None is NOTHING, `{}` EVERYTHING; a selector Kubernetes refuses to build (a key or value
    that is not a label's, an unknown operator, the wrong number of values) is InvalidInput.
    """
    if raw is None:
        return NOTHING
    if not isinstance(raw, Mapping):
        raise InvalidInput(where, "must be a label selector object")
    labels = string_map(raw.get("matchLabels"), f"{where}.matchLabels")
    expressions = object_list(raw.get("matchExpressions"), f"{where}.matchExpressions")
    found = []
    for key, value in sorted(labels.items()):
        check_label_key(key, where=f"{where}.matchLabels")
        check_label_value(value, f"{where}.matchLabels.{key[:64]}")
        found.append(Requirement(key, Operator.IN, (value,)))
    for position, expression in enumerate(expressions):
        place = f"{where}.matchExpressions[{position}]"
        key, operator, values = read_requirement(expression, place)
        if operator not in SELECTOR_OPERATORS:
            raise InvalidInput(
                f"{place}.operator",
                f"unknown operator {shown(operator)} (a label selector takes In, NotIn, Exists or DoesNotExist)",
            )
        found.append(requirement(key, Operator(operator), values, where=place))
    return selector_of(found)


def read_requirement(raw: object, where: str) -> tuple[str, str, tuple[str, ...]]:
    """(key, operator, values) of a requirement object, checked for shape only."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise InvalidInput(where, "must be an object with key, operator and values")
    key, operator = raw.get("key") or "", raw.get("operator") or ""
    if not isinstance(key, str) or not isinstance(operator, str):
        raise InvalidInput(where, "key and operator must be strings")
    values = raw.get("values") or []
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise InvalidInput(f"{where}.values", "must be a list of strings")
    return key, operator, tuple(values)


def string_map(raw: object, where: str) -> dict[str, str]:
    """A map of strings to strings (labels, matchLabels, nodeSelector); None is empty."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise InvalidInput(where, "must map strings to strings")
    return dict(raw)


def optional_object(raw: object, where: str) -> Mapping[str, object]:
    """An object (None is empty); anything else is InvalidInput."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise InvalidInput(where, "must be an object")
    return raw


def object_list(raw: object, where: str) -> list[object]:
    """A list (None is empty); anything else is InvalidInput."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InvalidInput(where, "must be a list")
    return raw


# --- node affinity ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FieldRequirement:
    """One matchFields requirement (`In`/`NotIn` with one value; Kubernetes admits only
    `metadata.name`)."""

    key: str
    value: str
    negated: bool = False

    def matches(self, fields: Mapping[str, str]) -> bool:
        # fields.Selector: a field the node lacks reads as "".
        return (fields.get(self.key, "") == self.value) != self.negated


@dataclass(frozen=True, slots=True)
class NodeSelectorTerm:
    """One nodeSelectorTerm: its expressions over labels and its fields, ANDed."""

    labels: LabelSelector | None = None
    """None: the term has no matchExpressions."""
    fields: tuple[FieldRequirement, ...] | None = None
    """None: the term has no matchFields."""
    problem: str = ""
    """Why the term does not parse; such a term matches no node."""

    def matches(self, labels: Mapping[str, str], name: str = "") -> bool:
        if self.problem:
            return False
        if self.labels is not None and not self.labels.matches(labels):
            return False
        # nodeaffinity matches fields only on a node that has some (a name).
        if self.fields is not None and name:
            fields = {"metadata.name": name}
            return all(f.matches(fields) for f in self.fields)
        return True


@dataclass(frozen=True, slots=True)
class NodeConstraint:
    """The nodes a pod may run on: `spec.nodeSelector` and the required node affinity
    (nodeaffinity.RequiredNodeAffinity). The default allows every node."""

    selector: LabelSelector = EVERYTHING
    """From `spec.nodeSelector`: every pair must be equal."""
    terms: tuple[NodeSelectorTerm, ...] | None = None
    """The required node affinity's terms, ORed (the empty ones dropped); None: none given."""

    def allows(self, labels: Mapping[str, str], name: str = "") -> bool:
        """Whether a node with these labels (and this name, for matchFields) is allowed."""
        if not self.selector.matches(labels):
            return False
        return self.terms is None or any(t.matches(labels, name) for t in self.terms)


def parse_node_selector_terms(raw: object, where: str) -> tuple[NodeSelectorTerm, ...]:
    """A v1.NodeSelector's terms as `nodeaffinity.NewLazyErrorNodeSelector` keeps them.

    A term with neither expressions nor fields is dropped (it selects nothing); a term that
    does not parse is kept with its problem and matches nothing.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise InvalidInput(where, "must be a node selector object")
    place = f"{where}.nodeSelectorTerms"
    terms = []
    for position, term in enumerate(object_list(raw.get("nodeSelectorTerms"), place)):
        parsed = parse_node_selector_term(term, f"{place}[{position}]")
        if parsed is not None:
            terms.append(parsed)
    return tuple(terms)


def parse_node_selector_term(raw: object, where: str) -> NodeSelectorTerm | None:
    """One nodeSelectorTerm; None when it has neither matchExpressions nor matchFields."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise InvalidInput(where, "must be a node selector term object")
    expressions = object_list(raw.get("matchExpressions"), f"{where}.matchExpressions")
    fields = object_list(raw.get("matchFields"), f"{where}.matchFields")
    if not expressions and not fields:
        return None
    read_expressions = [
        read_requirement(e, f"{where}.matchExpressions[{n}]") for n, e in enumerate(expressions)
    ]
    read_fields = [read_requirement(f, f"{where}.matchFields[{n}]") for n, f in enumerate(fields)]
    try:
        labels = None
        if read_expressions:
            found = []
            for n, (key, operator, values) in enumerate(read_expressions):
                at = f"{where}.matchExpressions[{n}]"
                if operator not in NODE_OPERATORS:
                    raise InvalidInput(f"{at}.operator", f"unknown operator {shown(operator)}")
                found.append(requirement(key, Operator(operator), values, where=at))
            labels = selector_of(found)
        parsed_fields = None
        if read_fields:
            parsed_fields = tuple(
                _field_requirement(key, operator, values, f"{where}.matchFields[{n}]")
                for n, (key, operator, values) in enumerate(read_fields)
            )
    except InvalidInput as error:
        return NodeSelectorTerm(problem=str(error))
    return NodeSelectorTerm(labels, parsed_fields)


def _field_requirement(
    key: str, operator: str, values: tuple[str, ...], where: str
) -> FieldRequirement:
    if operator not in (Operator.IN, Operator.NOT_IN):
        raise InvalidInput(f"{where}.operator", f"{shown(operator)} is not In or NotIn")
    if len(values) != 1:
        raise InvalidInput(f"{where}.values", "must have one element")
    return FieldRequirement(key, values[0], operator == Operator.NOT_IN)


def parse_node_constraint(spec: Mapping[str, object], where: str = "Pod.spec") -> NodeConstraint:
    """A pod spec's NodeConstraint (`nodeaffinity.GetRequiredNodeAffinity`)."""
    selector = selector_from_set(string_map(spec.get("nodeSelector"), f"{where}.nodeSelector"))
    affinity = optional_object(spec.get("affinity"), f"{where}.affinity")
    node_affinity = optional_object(affinity.get("nodeAffinity"), f"{where}.affinity.nodeAffinity")
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return NodeConstraint(selector)
    place = f"{where}.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    return NodeConstraint(selector, parse_node_selector_terms(required, place))


# --- pod (anti-)affinity terms ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AffinityTerm:
    """A pod affinity term as kube-scheduler matches it once its namespaces are known
    (framework.AffinityTerm after the plugin's PreFilter merged the namespaceSelector)."""

    selector: LabelSelector
    namespaces: frozenset[str] = frozenset()
    every_namespace: bool = False
    """The namespaceSelector matches a namespace without labels (`{}` does): pods of every
    namespace count."""

    def matches(self, namespace: str, labels: Mapping[str, str]) -> bool:
        """Whether a pod in `namespace` with `labels` is one this term selects."""
        if not self.every_namespace and namespace not in self.namespaces:
            return False
        return self.selector.matches(labels)


@dataclass(frozen=True, slots=True)
class PodAffinityTerm:
    """A v1.PodAffinityTerm as read from a pod (framework.newAffinityTerm)."""

    selector: LabelSelector
    namespaces: frozenset[str]
    """The listed namespaces, or the pod's own when neither these nor a selector are given."""
    namespace_selector: LabelSelector
    topology_key: str = ""

    def resolve(self, namespace_labels: NamespaceLabels | None) -> AffinityTerm:
        """The term with its namespaceSelector turned into namespaces, as kube-scheduler's
        PreFilter and PreScore do for the incoming pod's terms: each known namespace whose
        labels the selector matches is added; an empty selector (`{}`) takes every namespace
        (see the module docstring)."""
        if self.namespace_selector.empty:
            return AffinityTerm(self.selector, self.namespaces, every_namespace=True)
        chosen = {
            name
            for name, labels in (namespace_labels or {}).items()
            if self.namespace_selector.matches(labels)
        }
        return AffinityTerm(self.selector, self.namespaces | chosen)


def parse_pod_affinity_term(raw: object, namespace: str, where: str) -> PodAffinityTerm:
    """One v1.PodAffinityTerm of a pod in `namespace`; InvalidInput names the field."""
    if not isinstance(raw, Mapping):
        raise InvalidInput(where, "must be a PodAffinityTerm object")
    selector = parse_label_selector(raw.get("labelSelector"), f"{where}.labelSelector")
    listed = object_list(raw.get("namespaces"), f"{where}.namespaces")
    if not all(isinstance(n, str) for n in listed):
        raise InvalidInput(f"{where}.namespaces", "must be a list of namespace names")
    raw_namespace_selector = raw.get("namespaceSelector")
    namespace_selector = parse_label_selector(raw_namespace_selector, f"{where}.namespaceSelector")
    names = frozenset(str(n) for n in listed)
    if not names and raw_namespace_selector is None:
        names = frozenset((namespace,))
    topology_key = raw.get("topologyKey") or ""
    if not isinstance(topology_key, str):
        raise InvalidInput(f"{where}.topologyKey", "must be a string")
    return PodAffinityTerm(selector, names, namespace_selector, topology_key)
