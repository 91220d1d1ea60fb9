"""Bounded reading of ResourceSlices and ResourceClaims read back from the API into typed views.

A foreign driver's object is not ours (skipped, not an error); a malformed one raises
InvalidInput naming the object and field, and `read_slices` / `read_claims` skip it with that
reason, so one bad object affects only itself. Quantities go through the core's Kubernetes
quantity parser. Fields we do not use are ignored (the API adds fields; we never reject them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from fractions import Fraction
from typing import Any, Generic, TypeVar

from gpupart.core.api.records import Record
from gpupart.core.api.resources import parse_quantity
from gpupart.core.dra import names
from gpupart.core.errors import InvalidInput, shown

T = TypeVar("T")

MAX_SLICE_COUNT = 10_000
"""More slices than any node's pool has; a larger `resourceSliceCount` is refused as absurd."""
MAX_RESULTS = 32
MAX_RESERVED_FOR = 256
MAX_NAME = 253
MAX_QUALIFIED_NAME = names.MAX_DNS_LABEL + 1 + 32
"""An attribute or capacity name: a domain (≤ 63) and an identifier (≤ 32, the API's limits)."""

AttributeValue = tuple[str, str | int | bool]
"""(kind, value): kind is `string`, `int`, `bool` or `version` (the API's one-of)."""
Amounts = tuple[tuple[str, Fraction], ...]
"""Named quantities, sorted by name."""


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """A consumable capacity's request policy: default, and valid values or a range."""

    default: Fraction | None = None
    valid_values: tuple[Fraction, ...] = ()
    minimum: Fraction | None = None
    maximum: Fraction | None = None
    step: Fraction | None = None


@dataclass(frozen=True, slots=True)
class Capacity:
    value: Fraction
    policy: RequestPolicy | None = None


@dataclass(frozen=True, slots=True)
class DeviceTaint:
    """One `taints[]` entry of a device, as read back."""

    key: str
    value: str = ""
    effect: str = ""
    added: int | None = None
    """`timeAdded` in Unix seconds (the API keeps whole seconds); None when not set."""


@dataclass(frozen=True, slots=True)
class DeviceView:
    """One device of a slice, as read back."""

    name: str
    attributes: tuple[tuple[str, AttributeValue], ...] = ()
    capacity: tuple[tuple[str, Capacity], ...] = ()
    consumes: tuple[tuple[str, Amounts], ...] = ()
    """(counter set, counters taken) per entry of `consumesCounters`."""
    multiple: bool = False
    """`allowMultipleAllocations`."""
    taints: tuple[DeviceTaint, ...] = ()

    def attribute(self, name: str) -> str | int | bool | None:
        for key, (_, value) in self.attributes:
            if key == name:
                return value
        return None

    def capacity_of(self, name: str) -> Capacity | None:
        for key, capacity in self.capacity:
            if key == name:
                return capacity
        return None


@dataclass(frozen=True, slots=True)
class SliceView:
    """One ResourceSlice of our driver, as read back."""

    name: str
    driver: str
    pool: str
    generation: int
    slice_count: int
    node: str
    devices: tuple[DeviceView, ...] = ()
    counter_sets: tuple[tuple[str, Amounts], ...] = ()
    resource_version: str = ""

    @property
    def content(self) -> tuple[str, tuple[DeviceView, ...], tuple[tuple[str, Amounts], ...]]:
        """What the slice publishes, without its pool bookkeeping (generation, count)."""
        return (self.node, self.devices, self.counter_sets)

    @property
    def holds(self) -> tuple[frozenset[str], tuple[tuple[str, Amounts], ...]]:
        """Which devices the slice holds, in any order, and its counter sets: what a pool's
        consistency depends on (an order, a taint or an attribute does not change it)."""
        return (frozenset(d.name for d in self.devices), self.counter_sets)


@dataclass(frozen=True, slots=True)
class AllocationResult:
    """One `status.allocation.devices.results[]` entry."""

    request: str
    driver: str
    pool: str
    device: str
    share_id: str = ""
    consumed: Amounts = ()
    admin_access: bool = False
    """`adminAccess`: a view of the device for monitoring, which the scheduler does not count
    as allocated (the device may be another claim's too, or nobody's)."""


@dataclass(frozen=True, slots=True)
class Consumer:
    """One `status.reservedFor[]` entry."""

    resource: str
    name: str
    uid: str


@dataclass(frozen=True, slots=True)
class ClaimView:
    """A ResourceClaim with its allocation results for our driver."""

    namespace: str
    name: str
    uid: str
    results: tuple[AllocationResult, ...] = ()
    reserved_for: tuple[Consumer, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def allocated(self) -> tuple[AllocationResult, ...]:
        """The results that hold their device, as the scheduler counts them: an admin access
        holds nothing."""
        return tuple(r for r in self.results if not r.admin_access)


@dataclass(frozen=True, slots=True)
class Skipped:
    """An object left out, and why (the InvalidInput message, naming object and field)."""

    kind: str
    name: str
    reason: str


@dataclass(frozen=True, slots=True)
class Reading(Generic[T]):
    """What a batch of objects gave: the views, the malformed ones skipped, the foreign count."""

    items: tuple[T, ...] = ()
    skipped: tuple[Skipped, ...] = ()
    foreign: int = 0


def _string(record: Record, key: str, *, limit: int = MAX_NAME, default: str | None = None) -> str:
    text = record.string(key, default)
    if len(text) > limit:
        raise InvalidInput(record.path(key), f"{shown(text)} is longer than {limit} characters")
    return text


def _list(record: Record, key: str, limit: int) -> list[Any]:
    items = record.items(key)
    if len(items) > limit:
        raise InvalidInput(record.path(key), f"{len(items)} entries, at most {limit} are read")
    return items


def _mapping(record: Record, key: str, limit: int) -> Record | None:
    """A map of at most `limit` entries whose keys are qualified names (domain/identifier)."""
    found = record.optional_record(key)
    if found is not None and len(found.raw) > limit:
        raise InvalidInput(record.path(key), f"{len(found.raw)} entries, at most {limit} are read")
    if found is not None:
        for name in found.raw:
            if not name or len(name) > MAX_QUALIFIED_NAME:
                raise InvalidInput(
                    found.path(name), f"a name of {len(name)} characters is not a qualified name"
                )
    return found


def _quantity(raw: object, where: str) -> Fraction:
    value = parse_quantity(raw, where=where)
    if value < 0:
        raise InvalidInput(where, f"must not be negative, got {shown(str(raw))}")
    return value


def _amounts(record: Record | None, limit: int) -> Amounts:
    """A `counters` map: name → {value: quantity}."""
    if record is None:
        return ()
    if len(record.raw) > limit:
        raise InvalidInput(record.where, f"{len(record.raw)} counters, at most {limit} are read")
    found = []
    for name in sorted(record.raw):
        names.check_dns_label(name, record.path(name))
        entry = record.record(name)
        found.append((name, _quantity(entry.value("value"), entry.path("value"))))
    return tuple(found)


def _attribute(record: Record) -> AttributeValue:
    kinds = [k for k in ("string", "int", "bool", "version") if record.has(k)]
    if len(kinds) != 1:
        raise InvalidInput(record.where, "must hold exactly one of string, int, bool, version")
    kind = kinds[0]
    if kind == "int":
        return kind, record.integer("int", minimum=-(2**63))
    if kind == "bool":
        return kind, record.boolean("bool", False)
    return kind, _string(record, kind, limit=names.MAX_STRING_ATTRIBUTE)


def _policy(record: Record | None) -> RequestPolicy | None:
    if record is None:
        return None
    default = (
        _quantity(record.value("default"), record.path("default"))
        if record.has("default")
        else None
    )
    values = tuple(
        _quantity(v, f"{record.path('validValues')}[{k}]")
        for k, v in enumerate(_list(record, "validValues", 10))
    )
    span = record.optional_record("validRange")
    if span is None:
        return RequestPolicy(default, values)

    def bound(key: str) -> Fraction | None:
        assert span is not None
        return _quantity(span.value(key), span.path(key)) if span.has(key) else None

    return RequestPolicy(default, values, bound("min"), bound("max"), bound("step"))


def _taint(raw: object, where: str) -> DeviceTaint:
    record = Record(raw, where)
    added = None
    if record.has("timeAdded"):
        text = _string(record, "timeAdded", limit=64)
        try:
            moment = datetime.fromisoformat(text)
        except ValueError as error:
            raise InvalidInput(record.path("timeAdded"), f"{shown(text)} is not a time") from error
        added = int((moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp())
    return DeviceTaint(
        _string(record, "key", limit=MAX_QUALIFIED_NAME + MAX_NAME),
        _string(record, "value", limit=names.MAX_LABEL_VALUE, default=""),
        _string(record, "effect", limit=names.MAX_DNS_LABEL, default=""),
        added,
    )


def _device(raw: object, where: str) -> DeviceView:
    record = Record(raw, where)
    name = names.check_dns_label(_string(record, "name"), record.path("name"))
    attributes_record = _mapping(record, "attributes", names.MAX_ATTRIBUTES_AND_CAPACITIES)
    capacity_record = _mapping(record, "capacity", names.MAX_ATTRIBUTES_AND_CAPACITIES)
    attributes: tuple[tuple[str, AttributeValue], ...] = ()
    if attributes_record is not None:
        attributes = tuple(
            (key, _attribute(attributes_record.record(key)))
            for key in sorted(attributes_record.raw)
        )
    capacity: tuple[tuple[str, Capacity], ...] = ()
    if capacity_record is not None:
        found = []
        for key in sorted(capacity_record.raw):
            entry = capacity_record.record(key)
            value = _quantity(entry.value("value"), entry.path("value"))
            found.append((key, Capacity(value, _policy(entry.optional_record("requestPolicy")))))
        capacity = tuple(found)
    if len(attributes) + len(capacity) > names.MAX_ATTRIBUTES_AND_CAPACITIES:
        raise InvalidInput(where, "more attributes and capacities than the API allows")
    consumes = []
    for k, entry_raw in enumerate(_list(record, "consumesCounters", names.MAX_CONSUMES_PER_DEVICE)):
        entry = Record(entry_raw, f"{record.path('consumesCounters')}[{k}]")
        counter_set = names.check_dns_label(_string(entry, "counterSet"), entry.path("counterSet"))
        consumes.append(
            (
                counter_set,
                _amounts(entry.optional_record("counters"), names.MAX_COUNTERS_PER_CONSUMPTION),
            )
        )
    taints = tuple(
        _taint(entry, f"{record.path('taints')}[{k}]")
        for k, entry in enumerate(_list(record, "taints", names.MAX_TAINTS))
    )
    return DeviceView(
        name,
        attributes,
        capacity,
        tuple(consumes),
        record.boolean("allowMultipleAllocations", False),
        taints,
    )


def _kind_name(obj: object) -> str:
    """The object's name for a reason, even when the rest is malformed."""
    if isinstance(obj, dict):
        metadata = obj.get("metadata")
        if isinstance(metadata, dict):
            name = metadata.get("name")
            namespace = metadata.get("namespace")
            if isinstance(name, str):
                text = f"{namespace}/{name}" if isinstance(namespace, str) else name
                return text[:MAX_NAME]
    return "?"


def read_slice(obj: object, *, driver: str = names.DRIVER) -> SliceView | None:
    """A ResourceSlice as a view; None when another driver's; InvalidInput when malformed."""
    record = Record(obj, "ResourceSlice")
    metadata = record.record("metadata")
    name = _string(metadata, "name")
    record = Record(obj, f"ResourceSlice {name}")
    spec = record.record("spec")
    if _string(spec, "driver", limit=names.MAX_DNS_LABEL) != driver:
        return None
    pool = spec.record("pool")
    devices = tuple(
        _device(raw, f"{spec.path('devices')}[{k}]")
        for k, raw in enumerate(_list(spec, "devices", names.MAX_DEVICES))
    )
    if len({d.name for d in devices}) != len(devices):
        raise InvalidInput(spec.path("devices"), "two devices have the same name")
    if (
        any(d.consumes or d.taints for d in devices)
        and len(devices) > names.MAX_DEVICES_WITH_COUNTERS
    ):
        raise InvalidInput(
            spec.path("devices"), "more devices with counters or taints than the API allows"
        )
    counter_sets = []
    for k, raw in enumerate(_list(spec, "sharedCounters", names.MAX_COUNTER_SETS)):
        entry = Record(raw, f"{spec.path('sharedCounters')}[{k}]")
        set_name = names.check_dns_label(_string(entry, "name"), entry.path("name"))
        counter_sets.append(
            (set_name, _amounts(entry.optional_record("counters"), names.MAX_COUNTERS_PER_SET))
        )
    return SliceView(
        name=name,
        driver=driver,
        pool=_string(pool, "name"),
        generation=pool.integer("generation", 0, minimum=0),
        slice_count=pool.integer("resourceSliceCount", minimum=1, maximum=MAX_SLICE_COUNT),
        node=_string(spec, "nodeName", default=""),
        devices=devices,
        counter_sets=tuple(counter_sets),
        resource_version=_string(metadata, "resourceVersion", default=""),
    )


def _result(raw: object, where: str) -> AllocationResult:
    record = Record(raw, where)
    consumed = _mapping(record, "consumedCapacity", names.MAX_ATTRIBUTES_AND_CAPACITIES)
    amounts: Amounts = ()
    if consumed is not None:
        amounts = tuple(
            (key, _quantity(consumed.raw[key], consumed.path(key))) for key in sorted(consumed.raw)
        )
    return AllocationResult(
        request=_string(record, "request"),
        driver=_string(record, "driver", limit=names.MAX_DNS_LABEL),
        pool=_string(record, "pool"),
        device=_string(record, "device", limit=names.MAX_DNS_LABEL),
        share_id=_string(record, "shareID", default=""),
        consumed=amounts,
        admin_access=record.boolean("adminAccess", False),
    )


def read_claim(obj: object, *, driver: str = names.DRIVER) -> ClaimView | None:
    """A ResourceClaim's allocation for `driver`; None when it holds nothing of that driver
    (foreign, or not allocated); InvalidInput when malformed."""
    record = Record(obj, "ResourceClaim")
    metadata = record.record("metadata")
    namespace, name = _string(metadata, "namespace", default=""), _string(metadata, "name")
    record = Record(obj, f"ResourceClaim {namespace}/{name}")
    status = record.optional_record("status")
    if status is None:
        return None
    allocation = status.optional_record("allocation")
    if allocation is None:
        return None
    devices = allocation.optional_record("devices")
    results: tuple[AllocationResult, ...] = ()
    if devices is not None:
        results = tuple(
            _result(raw, f"{devices.path('results')}[{k}]")
            for k, raw in enumerate(_list(devices, "results", MAX_RESULTS))
        )
    ours = tuple(r for r in results if r.driver == driver)
    if not ours:
        return None
    consumers = []
    for k, raw in enumerate(_list(status, "reservedFor", MAX_RESERVED_FOR)):
        entry = Record(raw, f"{status.path('reservedFor')}[{k}]")
        consumers.append(
            Consumer(
                _string(entry, "resource", default="pods"),
                _string(entry, "name"),
                _string(entry, "uid", default=""),
            )
        )
    return ClaimView(namespace, name, _string(metadata, "uid", default=""), ours, tuple(consumers))


def _read_all(
    kind: str, objects: Iterable[object], read: Callable[[object], T | None]
) -> Reading[T]:
    items: list[T] = []
    skipped: list[Skipped] = []
    foreign = 0
    for obj in objects:
        try:
            found = read(obj)
        except InvalidInput as error:
            skipped.append(Skipped(kind, _kind_name(obj), str(error)))
            continue
        if found is None:
            foreign += 1
        else:
            items.append(found)
    return Reading(tuple(items), tuple(skipped), foreign)


def read_slices(objects: Iterable[object], *, driver: str = names.DRIVER) -> Reading[SliceView]:
    """Every slice of `driver` that reads; each malformed one skipped with its reason."""
    return _read_all("ResourceSlice", objects, lambda o: read_slice(o, driver=driver))


def read_claims(objects: Iterable[object], *, driver: str = names.DRIVER) -> Reading[ClaimView]:
    """Every claim allocated from `driver` that reads; each malformed one skipped with its reason."""
    return _read_all("ResourceClaim", objects, lambda o: read_claim(o, driver=driver))
