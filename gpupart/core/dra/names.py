"""The DRA vocabulary gpupart publishes: driver, attribute, counter and object names, and the API's limits."""

from __future__ import annotations

import hashlib
import re

from gpupart.core.errors import InvalidInput, shown

DRIVER = "gpu.gpupart.io"
"""Our DRA driver name (a DNS subdomain under our API group)."""
API_VERSION = "resource.k8s.io/v1"
STANDARD_DOMAIN = "resource.kubernetes.io"
PCI_BUS_ID = f"{STANDARD_DOMAIN}/pciBusID"
"""The standard attribute for a device's PCI address (KEP-5316)."""

# Attribute names (C identifiers: the API allows no dashes). NVIDIA's where a user expects them.
TYPE = "type"
UUID = "uuid"
INDEX = "index"
PRODUCT_NAME = "productName"
ARCHITECTURE = "architecture"
CUDA_COMPUTE_CAPABILITY = "cudaComputeCapability"
DRIVER_VERSION = "driverVersion"
PROFILE = "profile"
PARENT_UUID = "parentUUID"
PARENT_INDEX = "parentIndex"
PLACEMENT_START = "placementStart"
PLACEMENT_SIZE = "placementSize"
COMPUTE_SLICES = "computeSlices"
SHARING = "sharing"
REPLICAS = "replicas"

# Capacity names.
MEMORY = "memory"
COMPUTE = "compute"
"""Percent of the GPU's multiprocessors (shared devices)."""

# Values of the `type` attribute, one per DeviceClass kind.
TYPE_GPU = "gpu"
TYPE_MIG = "mig"
TYPE_SHARED = "shared"

# Counter names (DNS labels) in a GPU's counter set.
MEMORY_SLICE_PREFIX = "memory-slice-"
COUNTER_COMPUTE_SLICES = "compute-slices"
COUNTER_DECODERS = "decoders"
COUNTER_ENCODERS = "encoders"
COUNTER_JPEG = "jpeg-engines"
COUNTER_OFA = "ofa-engines"
COUNTER_INSTANCES = "instances"
"""Only where the compute slices do not already bound the instance count (`max_instances`)."""
PROFILE_INSTANCES_SUFFIX = "-instances"
"""`<profile label>-instances`: only where a profile's `max_count` is below what fits."""

# Device taints (KEP-5055, GA in 1.37): a label key, its value a label value.
TAINT_UNHEALTHY = f"{DRIVER}/unhealthy"
"""The taint of a device on a GPU (or GPU instance) that had an Xid, until a clean window."""
TAINT_VALUE_UNRESPONSIVE = "unresponsive"
"""The taint's value when the GPU stopped answering; else `xid-<n>`."""

# The API's limits (k8s.io/kubernetes pkg/apis/resource/types.go, v1.37).
MAX_DEVICES = 128
MAX_DEVICES_WITH_COUNTERS = 64
"""With counters, taints or list attributes on any device of the slice."""
MAX_TAINTS = 16
MAX_LABEL_VALUE = 63
MAX_COUNTER_SETS = 8
MAX_COUNTERS_PER_SET = 32
MAX_CONSUMES_PER_DEVICE = 2
MAX_COUNTERS_PER_CONSUMPTION = 32
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_STRING_ATTRIBUTE = 64
MAX_DNS_LABEL = 63
MAX_OBJECT_NAME = 253
MAX_GPU_INDEX = 99
"""Slice names carry the GPU index in two digits, so that name order is index order."""

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SUFFIX_LABELS = {"+me": "-me", "-me": "-nome", "+me.all": "-meall", "+gfx": "-gfx"}
_PROFILE = re.compile(r"((?:[1-7]c\.)?[1-7]g\.[0-9]+gb)(\+me\.all|\+me|-me|\+gfx)?")


def profile_label(profile: str) -> str:
    """A MIG profile as a DNS label: ``1g.10gb`` → ``1g10gb``, ``1g.10gb+me`` → ``1g10gb-me``.

    One label per profile (``-me`` is ``-nome``, so ``+me`` and ``-me`` stay apart).
    """
    match = _PROFILE.fullmatch(profile)
    if match is None:
        raise InvalidInput("profile", f"{shown(profile)} is not a MIG profile name")
    base, suffix = match.groups()
    return base.replace(".", "") + _SUFFIX_LABELS.get(suffix or "", "")


def gpu_device_name(index: int) -> str:
    return f"gpu-{index}"


def shared_device_name(index: int) -> str:
    return f"gpu-{index}-shared"


def mig_device_name(index: int, profile: str, start: int) -> str:
    """One name per placement, the same whether the instance exists (static) or not (dynamic)."""
    return f"gpu-{index}-mig-{profile_label(profile)}-{start}"


def counter_set_name(index: int) -> str:
    return f"gpu-{index}-counters"


def memory_slice_counter(slot: int) -> str:
    return f"{MEMORY_SLICE_PREFIX}{slot}"


def profile_counter(profile: str) -> str:
    return f"{profile_label(profile)}{PROFILE_INSTANCES_SUFFIX}"


def xid_taint_value(xid: int | None) -> str:
    """A fault as a taint value (a label value): ``xid-79``; ``unresponsive`` for None."""
    return TAINT_VALUE_UNRESPONSIVE if xid is None else f"xid-{xid}"


def check_dns_label(name: str, where: str) -> str:
    if len(name) > MAX_DNS_LABEL or not _DNS_LABEL.fullmatch(name):
        raise InvalidInput(where, f"{shown(name)} is not a DNS label (a-z, 0-9, '-', ≤ 63)")
    return name


def slice_name(node: str, part: str) -> str:
    """`<node>-gpupart-<part>`, a DNS subdomain of at most 253 characters.

    Deterministic, because the scheduler searches a pool's slices in name order: a long node
    name is cut and a digest of the whole added, so two nodes never share a slice name.
    """
    name = f"{node}-gpupart-{part}"
    if len(name) <= MAX_OBJECT_NAME:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    keep = MAX_OBJECT_NAME - len(f"-{digest}-gpupart-{part}")
    return f"{node[:keep].rstrip('.-')}-{digest}-gpupart-{part}"


def check_gpu_index(index: int) -> int:
    if not 0 <= index <= MAX_GPU_INDEX:
        raise InvalidInput("gpu.index", f"{index} is outside 0-{MAX_GPU_INDEX}")
    return index


WHOLE_SLICE_PART = "whole"
"""The slice of the node's whole-GPU devices (after every MIG slice in name order)."""
SHARED_SLICE_PART = "shared"
"""The slice of the node's MPS and time-sliced devices."""


def mig_slice_part(profile: str, memory_slices: int, compute_slices: int) -> str:
    """`mig-<memory slices><compute slices>-<profile label>`: one slice per MIG profile across the
    node's GPUs, named so that name order is size order (the scheduler's search order: a
    request that several profiles satisfy takes the smallest). Both counts are one digit."""
    if not (0 < memory_slices <= 9 and 0 < compute_slices <= 9):
        raise InvalidInput("profile", f"{shown(profile)} has slice counts outside 1-9")
    return f"mig-{memory_slices}{compute_slices}-{profile_label(profile)}"


def counters_slice_part(number: int) -> str:
    return f"counters-{number}"


def mib(value: int) -> str:
    """MiB as a Kubernetes quantity."""
    return f"{value}Mi"


def version_text(text: str) -> str | None:
    """A version as the API's semver: ``535.104.05`` → ``535.104.5``, ``9.0`` → ``9.0.0``; None if
    the text is not dotted numbers (never guessed)."""
    parts = text.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isascii() and p.isdigit() for p in parts):
        return None
    numbers = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    return ".".join(numbers)
