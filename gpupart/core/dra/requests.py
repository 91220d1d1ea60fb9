"""What a pod asks of DRA, read bounded: DeviceClasses' selectors, ResourceClaims' requests, the pod's claims.

The allocator model (`allocator.first_fit`) matches devices on attribute equality, which is what
our DeviceClasses' CEL says (`device.driver == "gpu.gpupart.io" && device.attributes[...].type
== "mig" && ...`). That one shape, a conjunction of equalities on the driver and on attributes,
is read exactly; any other expression is not guessed at: the class or request is kept with a
reason ("class X's selector is not one gpupart reads") so that the words say so. Malformed
objects raise InvalidInput naming the object and field (`read_classes` skips each with its
reason). Nothing here is trusted from a tenant beyond what the scheduler itself reads: a claim's
spec is what the scheduler allocates for.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from gpupart.core.api.pods import parse_pod_request
from gpupart.core.api.records import Record, find_time
from gpupart.core.api.resources import GPU, mig_resource_name
from gpupart.core.dra import names
from gpupart.core.dra.allocator import DeviceToleration
from gpupart.core.dra.read import MAX_NAME, Reading, Skipped, _kind_name, _quantity
from gpupart.core.errors import InvalidInput, shown

MAX_SELECTORS = 32
MAX_EXPRESSION = 2048
"""Longer CEL than any of our classes writes: refused as not one gpupart reads."""
MAX_REQUESTS = 32
MAX_SUBREQUESTS = 8
MAX_CONSTRAINTS = 32
MAX_COUNT = 128
MAX_POD_CLAIMS = 32
MAX_TOLERATIONS = 16
"""The API's limit per request."""
EXTENDED_PREFIX = "deviceclass.resource.kubernetes.io/"
"""The implicit extended resource name of every DeviceClass (KEP-5004)."""

Match = tuple[tuple[str, str | int | bool], ...]
"""Attribute equalities (our attribute names unqualified, others `domain/name`), sorted."""

_VALUE = r'"(?:[^"\\]*)"|-?[0-9]+|true|false'
_TERM = re.compile(
    r'\s*(?:device\.driver\s*==\s*(?P<driver>"[^"\\]*")'
    r'|device\.attributes\["(?P<domain>[^"\\]+)"\](?:\.(?P<dotted>[A-Za-z_][A-Za-z0-9_]*)'
    r'|\["(?P<indexed>[A-Za-z_][A-Za-z0-9_]*)"\])'
    rf"\s*==\s*(?P<value>{_VALUE}))\s*"
)


@dataclass(frozen=True, slots=True)
class Selector:
    """One CEL selector as gpupart reads it: the driver it names ("" none), attribute equalities;
    or the reason it cannot be read (`problem`)."""

    driver: str = ""
    match: Match = ()
    problem: str = ""


def read_selector(expression: str) -> Selector:
    """A conjunction of `device.driver == "…"` and `device.attributes["domain"].name == value`."""
    if len(expression) > MAX_EXPRESSION:
        return Selector(problem=f"an expression of {len(expression)} characters")
    driver = ""
    match: dict[str, str | int | bool] = {}
    for term in _split(expression):
        found = _TERM.fullmatch(term)
        if found is None:
            return Selector(problem=f"{shown(term.strip(), 60)} is not an equality gpupart reads")
        value = found.group("value")
        if found.group("driver") is not None:
            named = found.group("driver")[1:-1]
            if driver and driver != named:
                return Selector(problem="it names two drivers")
            driver = named
            continue
        domain = found.group("domain")
        attribute = found.group("dotted") or found.group("indexed")
        key = attribute if domain == names.DRIVER else f"{domain}/{attribute}"
        parsed = _literal(value)
        if key in match and match[key] != parsed:
            return Selector(problem=f"it asks {key} to be two values")
        match[key] = parsed
    return Selector(driver, tuple(sorted(match.items())))


def _split(expression: str) -> list[str]:
    """The `&&` terms, outside string literals."""
    terms, start, quoted = [], 0, False
    k = 0
    while k < len(expression):
        c = expression[k]
        if c == '"':
            quoted = not quoted
        elif not quoted and expression.startswith("&&", k):
            terms.append(expression[start:k])
            start = k + 2
            k += 1
        k += 1
    terms.append(expression[start:])
    return terms


def _literal(text: str) -> str | int | bool:
    if text.startswith('"'):
        return text[1:-1]
    if text in ("true", "false"):
        return text == "true"
    return int(text)


def _selectors(record: Record, key: str) -> tuple[Selector, ...]:
    raw = record.items(key)
    if len(raw) > MAX_SELECTORS:
        raise InvalidInput(record.path(key), f"{len(raw)} entries, at most {MAX_SELECTORS} read")
    found = []
    for k, item in enumerate(raw):
        entry = Record(item, f"{record.path(key)}[{k}]")
        cel = entry.optional_record("cel")
        if cel is None:
            found.append(Selector(problem="a selector that is not CEL"))
            continue
        found.append(read_selector(cel.string("expression")))
    return tuple(found)


def combine(selectors: Iterable[Selector]) -> Selector:
    """Every selector must hold: one selector (or the first problem)."""
    driver = ""
    match: dict[str, str | int | bool] = {}
    for s in selectors:
        if s.problem:
            return s
        if s.driver:
            if driver and s.driver != driver:
                return Selector(problem="its selectors name two drivers")
            driver = s.driver
        for key, value in s.match:
            if key in match and match[key] != value:
                return Selector(problem=f"its selectors ask {key} to be two values")
            match[key] = value
    return Selector(driver, tuple(sorted(match.items())))


@dataclass(frozen=True, slots=True)
class ClassView:
    """A DeviceClass: its selectors as one, and the extended resource name it serves ("" none)."""

    name: str
    selector: Selector
    extended_resource: str = ""
    created: float = 0.0
    """`metadata.creationTimestamp` (Unix seconds; 0 when absent): the newer class serves a
    clashing extended resource name."""

    @property
    def ours(self) -> bool:
        """Whether it selects our driver's devices (a class naming no driver selects any)."""
        return self.selector.driver in ("", names.DRIVER)


def read_class(obj: object) -> ClassView:
    """A DeviceClass; InvalidInput when malformed (an unreadable selector is not malformed)."""
    record = Record(obj, "DeviceClass")
    name = record.record("metadata").string("name")
    if len(name) > MAX_NAME:
        raise InvalidInput("DeviceClass.metadata.name", f"longer than {MAX_NAME} characters")
    record = Record(obj, f"DeviceClass {name}")
    spec = record.optional_record("spec")
    if spec is None:
        return ClassView(name, Selector())
    extended = spec.string("extendedResourceName", "")
    if len(extended) > MAX_NAME:
        raise InvalidInput(spec.path("extendedResourceName"), "longer than a resource name")
    created = find_time(record.record("metadata").raw.get("creationTimestamp")) or 0.0
    return ClassView(name, combine(_selectors(spec, "selectors")), extended, created)


def read_classes(objects: Iterable[object]) -> Reading[ClassView]:
    """Every DeviceClass that reads (ours, others' and those whose selector we cannot read)."""
    items: list[ClassView] = []
    skipped: list[Skipped] = []
    for obj in objects:
        try:
            items.append(read_class(obj))
        except InvalidInput as error:
            skipped.append(Skipped("DeviceClass", _kind_name(obj), str(error)))
    return Reading(tuple(items), tuple(skipped))


@dataclass(frozen=True, slots=True)
class Alternative:
    """One way to satisfy a request: `exactly`, or one `firstAvailable` subrequest."""

    name: str
    """The request's name, or `request/subrequest`."""
    device_class: str
    selector: Selector
    count: int = 1
    capacity: tuple[tuple[str, Fraction], ...] = ()
    problem: str = ""
    """Why the model cannot allocate it as asked (allocationMode All, ...)."""
    tolerations: tuple[DeviceToleration, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestSpec:
    name: str
    alternatives: tuple[Alternative, ...]


@dataclass(frozen=True, slots=True)
class Constraint:
    requests: tuple[str, ...]
    """The requests it applies to (empty: all)."""
    match_attribute: str = ""
    problem: str = ""


@dataclass(frozen=True, slots=True)
class ClaimSpec:
    """A ResourceClaim's spec: what the scheduler allocates for it."""

    namespace: str
    name: str
    requests: tuple[RequestSpec, ...]
    constraints: tuple[Constraint, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def _alternative(record: Record, name: str) -> Alternative:
    device_class = record.string("deviceClassName")
    if len(device_class) > MAX_NAME:
        raise InvalidInput(record.path("deviceClassName"), "longer than an object name")
    mode = record.string("allocationMode", "ExactCount")
    count = record.integer("count", 1, minimum=1, maximum=MAX_COUNT)
    capacity_record = record.optional_record("capacity")
    requests = capacity_record.optional_record("requests") if capacity_record else None
    amounts: list[tuple[str, Fraction]] = []
    if requests is not None:
        if len(requests.raw) > names.MAX_ATTRIBUTES_AND_CAPACITIES:
            raise InvalidInput(requests.where, "more capacity requests than a device has")
        for key in sorted(requests.raw):
            short = key.removeprefix(f"{names.DRIVER}/")
            amounts.append((short, _quantity(requests.raw[key], requests.path(key))))
    problem = ""
    if mode != "ExactCount":
        problem = f"allocationMode {shown(mode)} is not one gpupart models"
    return Alternative(
        name,
        device_class,
        combine(_selectors(record, "selectors")),
        count,
        tuple(amounts),
        problem,
        _tolerations(record),
    )


def _tolerations(record: Record) -> tuple[DeviceToleration, ...]:
    """A request's `tolerations` (each field bounded; `tolerationSeconds` is eviction's)."""
    raw = record.items("tolerations")
    if len(raw) > MAX_TOLERATIONS:
        raise InvalidInput(record.path("tolerations"), f"more than {MAX_TOLERATIONS} tolerations")
    found = []
    for k, item in enumerate(raw):
        entry = Record(item, f"{record.path('tolerations')}[{k}]")
        fields = {}
        for key, default in (("key", ""), ("operator", "Equal"), ("value", ""), ("effect", "")):
            text = entry.string(key, default)
            if len(text) > MAX_NAME + names.MAX_DNS_LABEL + 1:
                raise InvalidInput(entry.path(key), "longer than a label key")
            fields[key] = text
        found.append(DeviceToleration(**fields))
    return tuple(found)


def read_claim_spec(obj: object) -> ClaimSpec:
    """A ResourceClaim's requests and constraints; InvalidInput when malformed."""
    record = Record(obj, "ResourceClaim")
    metadata = record.record("metadata")
    namespace, name = metadata.string("namespace", ""), metadata.string("name")
    record = Record(obj, f"ResourceClaim {namespace}/{name}")
    devices = record.record("spec").optional_record("devices")
    if devices is None:
        return ClaimSpec(namespace, name, ())
    raw = devices.items("requests")
    if len(raw) > MAX_REQUESTS:
        raise InvalidInput(devices.path("requests"), f"more than {MAX_REQUESTS} requests")
    requests = []
    for k, item in enumerate(raw):
        entry = Record(item, f"{devices.path('requests')}[{k}]")
        request = entry.string("name")
        exactly = entry.optional_record("exactly")
        if exactly is not None:
            requests.append(RequestSpec(request, (_alternative(exactly, request),)))
            continue
        subs = entry.items("firstAvailable")
        if not subs or len(subs) > MAX_SUBREQUESTS:
            raise InvalidInput(entry.where, "needs exactly, or 1-8 firstAvailable subrequests")
        alternatives = []
        for j, sub in enumerate(subs):
            subrecord = Record(sub, f"{entry.path('firstAvailable')}[{j}]")
            alternatives.append(_alternative(subrecord, f"{request}/{subrecord.string('name')}"))
        requests.append(RequestSpec(request, tuple(alternatives)))
    constraints = []
    raw_constraints = devices.items("constraints")
    if len(raw_constraints) > MAX_CONSTRAINTS:
        raise InvalidInput(devices.path("constraints"), "too many constraints")
    for k, item in enumerate(raw_constraints):
        entry = Record(item, f"{devices.path('constraints')}[{k}]")
        applies = tuple(str(r) for r in entry.items("requests")[:MAX_REQUESTS])
        attribute = entry.string("matchAttribute", "")
        if attribute:
            short = attribute.removeprefix(f"{names.DRIVER}/")
            constraints.append(Constraint(applies, short))
        else:
            constraints.append(
                Constraint(applies, problem="a constraint other than matchAttribute")
            )
    return ClaimSpec(namespace, name, tuple(requests), tuple(constraints))


@dataclass(frozen=True, slots=True)
class PodClaims:
    """The ResourceClaims a pod waits on, by name (None: not made yet, with its template), and
    the DRA extended resources it asks (`nvidia.com/mig-1g.10gb`: 1), mapped to their class."""

    claims: tuple[tuple[str, str | None, str], ...] = ()
    """(the pod's name for it, the claim's object name or None, the template name or "")."""
    extended: tuple[tuple[str, int], ...] = ()
    """(extended resource name, count)."""


def pod_claims(pod: Mapping[str, Any]) -> PodClaims:
    """What a pod asks through DRA; InvalidInput when its claims or requests are malformed."""
    record = Record(pod, "Pod")
    spec = record.record("spec")
    status = record.optional_record("status")
    made: dict[str, str] = {}
    if status is not None:
        raw_status = status.items("resourceClaimStatuses")
        for k, item in enumerate(raw_status[:MAX_POD_CLAIMS]):
            entry = Record(item, f"{status.path('resourceClaimStatuses')}[{k}]")
            if entry.has("resourceClaimName"):
                made[entry.string("name")] = entry.string("resourceClaimName")
    claims: list[tuple[str, str | None, str]] = []
    raw = spec.items("resourceClaims")
    if len(raw) > MAX_POD_CLAIMS:
        raise InvalidInput(spec.path("resourceClaims"), f"more than {MAX_POD_CLAIMS} claims")
    for k, item in enumerate(raw):
        entry = Record(item, f"{spec.path('resourceClaims')}[{k}]")
        own = entry.string("name")
        if entry.has("resourceClaimName"):
            claims.append((own, entry.string("resourceClaimName"), ""))
        else:
            template = entry.string("resourceClaimTemplateName", "")
            claims.append((own, made.get(own), template))
    request = parse_pod_request(pod)
    extended = [(mig_resource_name(profile), count) for profile, count in request.mig]
    if request.whole_gpus:
        extended.append((GPU, request.whole_gpus))
    return PodClaims(tuple(claims), tuple(extended))


def extended_class(resource: str, classes: Mapping[str, ClassView]) -> ClassView | None:
    """The DeviceClass serving an extended resource name: the implicit name, else the class
    whose `extendedResourceName` it is; of several, the newest, then the lowest name (the
    scheduler's resolver, `deviceclass/extendedresourcecache`)."""
    if resource.startswith(EXTENDED_PREFIX):
        return classes.get(resource.removeprefix(EXTENDED_PREFIX))
    serving = [c for c in classes.values() if c.extended_resource == resource]
    return min(serving, key=lambda c: (-c.created, c.name), default=None)
