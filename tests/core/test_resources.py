"""Resource names and pod requests: quantities, summing containers, and every malformed request.

Aspects: Kubernetes quantity grammar, effective request (sum of containers vs largest init
container), one kind of GPU per pod, extender-managed memory/compute, errors that name the field.
"""

import contextlib
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupart.core.api.pods import parse_pod_request, pod_cpu_milli
from gpupart.core.api.resources import (
    GpuRequest,
    find_mig_profile,
    mig_resource_name,
    parse_memory_mib,
    parse_quantity,
)
from gpupart.core.errors import InvalidInput
from gpupart.core.scheduling.demand import parse_demand

NANO = Fraction(1, 10**9)
MAX = 2**63 - 1
BOUND_S = 30
"""Seconds a bound test may take: it takes milliseconds, and hours if a bound is missing."""

# Facts from Kubernetes' own table (k8s.io/apimachinery/pkg/api/resource, TestQuantityParse):
# the exact value resource.Quantity gives each text.
KUBERNETES_TABLE = [
    ("0", 0), ("0n", 0), ("0u", 0), ("0m", 0), ("0Ki", 0), ("0k", 0), ("0Mi", 0), ("0M", 0),
    ("0Gi", 0), ("0G", 0), ("0Ti", 0), ("0T", 0), ("1", 1),
    ("1Ki", 1024), ("8Ki", 8 * 1024), ("7Mi", 7 * 2**20), ("6Gi", 6 * 2**30),
    ("5Ti", 5 * 2**40), ("4Pi", 4 * 2**50), ("3Ei", 3 * 2**60), ("100Ti", 100 * 2**40),
    ("5n", 5 * NANO), ("4u", Fraction(4, 10**6)), ("3m", Fraction(3, 1000)), ("9", 9),
    ("8k", 8000), ("50k", 50000), ("7M", 7 * 10**6), ("6G", 6 * 10**9), ("5T", 5 * 10**12),
    ("40T", 4 * 10**13), ("300T", 3 * 10**14), ("2P", 2 * 10**15), ("1E", 10**18),
    ("1E-3", Fraction(1, 1000)), ("1e3", 1000), ("1E6", 10**6), ("1e9", 10**9),
    ("1E12", 10**12), ("1e15", 10**15), ("1E18", 10**18), ("1e14", 10**14),
    ("100.035k", 100035), ("0.001", Fraction(1, 1000)), ("0.0005k", Fraction(1, 2)),
    ("0.00050k", Fraction(1, 2)), ("0.05000", Fraction(1, 20)), ("0.5e0", Fraction(1, 2)),
    ("0.5e-1", Fraction(1, 20)), ("0.5e-2", Fraction(1, 200)), ("10.035M", 10035000),
    ("1.2e3", 1200), ("1.3E+6", 1300000), ("1.40e9", 14 * 10**8), ("1.53E12", 153 * 10**10),
    ("1.6e15", 16 * 10**14), ("1.7E18", 17 * 10**17), ("9.01", Fraction(901, 100)),
    ("8.1k", 8100), ("7.123456M", 7123456), ("6.987654321G", 6987654321),
    ("5.444T", 5444 * 10**9), ("2.5P", 25 * 10**14), ("1.01E", 101 * 10**16),
    # Rounded up (away from zero) to a whole nano; binary SI capped at 2^63-1.
    ("3.001n", 4 * NANO), ("1.1E-9", 2 * NANO), ("0.0000000001", NANO), ("0.5e-9", NANO),
    ("0.9n", NANO), ("0.00000012345", 124 * NANO), ("0.00000012354", 124 * NANO),
    ("9Ei", MAX), ("9223372036854775807Ki", MAX),
    ("100.035Ki", Fraction(10243584, 100)), ("0.5Mi", 2**19), ("0.05Gi", Fraction(536870912, 10)),
    ("0.025Ti", Fraction(274877906944, 10)), ("0.000000000001Ki", 2 * NANO),
    (".001", Fraction(1, 1000)), (".0001k", Fraction(1, 10)), ("1.", 1), ("1.G", 10**9),
]  # fmt: skip
KUBERNETES_INVALID = [
    "", "1.1.M", "1+1.0M", "0.1mi", "0.1am", "aoeu", ".5i", "1i", "-3.01i", "-3.01e-",
    "1e4294967297",
]  # fmt: skip


@pytest.mark.parametrize(("text", "value"), KUBERNETES_TABLE)
def test_quantities_parse_as_kubernetes_parses_them(text, value):
    assert parse_quantity(text, where="x") == value
    # Signs, as Kubernetes' table checks them: "-" negates, "+" changes nothing.
    assert parse_quantity(f"-{text}", where="x") == -value
    assert parse_quantity(f"+{text}", where="x") == value


@pytest.mark.parametrize("text", KUBERNETES_INVALID)
def test_what_kubernetes_refuses_is_refused(text):
    with pytest.raises(InvalidInput, match="^x: "):
        parse_quantity(text, where="x")


@pytest.mark.parametrize(("text", "value"), [(3, 3), (-2, -2), ("1Ei", 2**60), ("1E", 10**18)])
def test_other_spellings(text, value):
    assert parse_quantity(text, where="x") == value


@pytest.mark.parametrize("text", ["", "ten", "1.2.3", "5 Gi", "1GB", None, True, [1], 1.5])
def test_malformed_quantities_name_the_field(text):
    with pytest.raises(InvalidInput, match="^limits.nvidia.com/gpu: "):
        parse_quantity(text, where="limits.nvidia.com/gpu")


@pytest.mark.timeout(BOUND_S)  # past its bound the parser computes for hours
@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("1e99999999", "more than a quantity can hold"),
        ("12E", "more than a quantity can hold"),  # Kubernetes keeps it; nothing here counts so far
        ("9223372036854775808", "more than a quantity can hold"),
        (2**63, "more than a quantity can hold"),
        ("1" * 100_000, "100000 characters long"),
        ("9" * 65, "65 characters long"),
    ],
)
def test_beyond_the_bounds_is_refused_before_any_arithmetic(text, words):
    with pytest.raises(InvalidInput, match=words) as refused:
        parse_quantity(text, where="x")
    assert len(str(refused.value)) < 200, "the message never echoes the whole input"


@pytest.mark.timeout(BOUND_S)  # past its bound the parser computes for hours
def test_tiny_exponents_round_up_to_a_nano_without_computing_them():
    assert parse_quantity("1e-99999999", where="x") == NANO
    assert parse_quantity("-1e-99999999", where="x") == -NANO
    assert parse_quantity("0e99999999", where="x") == 0


@st.composite
def quantities(draw):
    """Text of a quantity with its exact value (before Kubernetes' rounding and cap)."""
    whole = draw(st.integers(0, 10**12))
    places = draw(st.integers(0, 6))
    fraction = draw(st.integers(0, 10**places - 1)) if places else 0
    number = f"{whole}.{fraction:0{places}d}" if places else str(whole)
    exact = whole + Fraction(fraction, 10**places)
    kind = draw(st.sampled_from(["binary", "decimal", "exponent"]))
    if kind == "binary":
        suffix, power = draw(st.sampled_from([("Ki", 10), ("Mi", 20), ("Gi", 30), ("Ti", 40)]))
        return number + suffix, exact * 2**power
    if kind == "decimal":
        suffix, power = draw(
            st.sampled_from([("n", -9), ("u", -6), ("m", -3), ("", 0), ("k", 3), ("M", 6)])
        )
    else:
        power = draw(st.integers(-12, 6))
        suffix = draw(st.sampled_from(["e", "E"])) + str(power)
    return number + suffix, exact * Fraction(10) ** power


def kubernetes_value(exact):
    """resource.Quantity's rounding: up to a whole nano, away from zero; binary capped."""
    nanos = -((-abs(exact) * 10**9) // 1)
    return min(Fraction(nanos, 10**9), MAX)


def canonical(value):
    """A quantity text for an exact value in nanos: "<n>n", or a plain integer when whole."""
    if value.denominator == 1:
        return str(value)
    return f"{value * 10**9}n"


@given(quantities())
def test_law_parse_is_exact_up_to_kubernetes_rounding(case):
    text, exact = case
    assert parse_quantity(text, where="x") == kubernetes_value(exact)


@given(quantities(), st.sampled_from(["", "+", "-"]))
def test_law_round_trip_through_a_canonical_text(case, sign):
    text, _ = case
    value = parse_quantity(sign + text, where="x")
    assert parse_quantity(canonical(value), where="x") == value
    assert (value * 10**9).denominator == 1, "every value is a whole number of nanos"


@given(st.text(alphabet="0123456789.+-eEinumkKMGTPx ", max_size=80))
def test_law_any_text_parses_or_is_refused_with_the_field(text):
    try:
        value = parse_quantity(text, where="x")
    except InvalidInput as error:
        assert error.where == "x"
    else:
        assert abs(value) <= MAX


@pytest.mark.timeout(BOUND_S)  # past its bound the parser computes for hours
@given(st.integers(min_value=10, max_value=10**9))
def test_law_huge_exponents_are_refused_by_the_bound(exponent):
    with pytest.raises(InvalidInput, match="more than a quantity can hold|exponent is beyond"):
        parse_quantity(f"1e{exponent + 10}", where="x")


def test_memory_rounds_up_to_whole_mib_and_is_at_least_one_mib():
    assert parse_memory_mib("10Gi", where="m") == 10240
    assert parse_memory_mib("1Mi", where="m") == 1
    assert parse_memory_mib("1.5Mi", where="m") == 2
    assert parse_memory_mib("10G", where="m") == 9537
    for small in ("0", "1", "1.5", "100m", "1023Ki", "-1Gi"):
        with pytest.raises(InvalidInput, match="at least 1Mi"):
            parse_memory_mib(small, where="m")
    with pytest.raises(InvalidInput, match="more memory than any GPU has"):
        parse_memory_mib("1Ei", where="m")


@given(
    st.integers(2, 10**6),
    st.sampled_from([("k", 10**3), ("M", 10**6), ("G", 10**9), ("Ki", 2**10), ("Mi", 2**20)]),
)
def test_law_memory_suffixes_keep_their_own_unit(number, suffix):
    """Decimal M is 10^6 bytes and binary Mi 2^20: "4000M" is 3815 MiB, never 4000."""
    unit, size = suffix
    total = number * size
    if total < 2**20 or total > 16 * 2**40:
        return  # below 1 MiB or above any GPU: refused, checked above
    assert parse_memory_mib(f"{number}{unit}", where="m") == -(-total // 2**20)


def test_memory_in_decimal_megabytes_is_not_mebibytes():
    assert parse_memory_mib("4000M", where="m") == 3815
    assert parse_memory_mib("4000Mi", where="m") == 4000


@given(
    st.sampled_from(
        [
            "1g.10gb",
            "3g.40gb",
            "1g.18gb+me",
            "7g.141gb",
            "1g.24gb+me.all",
            "1c.3g.40gb",
            "1g.23gb-me",
        ]
    )
)
def test_law_mig_resource_name_round_trips(profile):
    name = mig_resource_name(profile)
    assert "+" not in name, "extended-resource names allow no +"
    assert find_mig_profile(name) == profile
    assert find_mig_profile("nvidia.com/gpu") is None


def pod(*containers, init=()):
    return {"spec": {"containers": list(containers), "initContainers": list(init)}}


def container(limits=None, requests=None):
    resources = {}
    if limits is not None:
        resources["limits"] = limits
    if requests is not None:
        resources["requests"] = requests
    return {"name": "c", "resources": resources}


def test_mig_requests_sum_over_containers():
    request = parse_pod_request(
        pod(
            container({"nvidia.com/mig-1g.10gb": "1"}),
            container({"nvidia.com/mig-1g.10gb": 2, "cpu": "4"}),
        )
    )
    assert request == GpuRequest(mig=(("1g.10gb", 3),))


def test_media_extension_profiles_use_the_device_plugin_spelling():
    assert mig_resource_name("1g.10gb+me") == "nvidia.com/mig-1g.10gb.me"
    request = parse_pod_request(pod(container({"nvidia.com/mig-1g.10gb.me": 1})))
    assert request.mig == (("1g.10gb+me", 1),)


def test_init_container_counts_when_larger_than_the_sum():
    request = parse_pod_request(
        pod(container({"nvidia.com/gpu": 1}), init=[container({"nvidia.com/gpu": 2})])
    )
    assert request.whole_gpus == 2


def test_shared_gpu_with_memory_and_compute():
    request = parse_pod_request(
        pod(
            container(
                {
                    "nvidia.com/gpu.shared": 1,
                    "gpupart.io/gpu-memory": 10240,
                    "gpupart.io/gpu-compute": 25,
                }
            )
        )
    )
    assert (request.shared, request.memory_mib, request.compute_percent) == (1, 10240, 25)


def test_requests_alone_count_for_extended_resources():
    assert parse_pod_request(pod(container(requests={"nvidia.com/gpu": "2"}))).whole_gpus == 2


def test_pod_without_gpu_is_empty():
    assert parse_pod_request(pod(container({"cpu": "1"}))).empty


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (
            pod(container({"nvidia.com/gpu": "1.5"})),
            r"containers\[0\].resources.limits.nvidia.com/gpu: must be a whole number",
        ),
        (pod(container({"nvidia.com/gpu": "-1"})), "whole number"),
        (pod(container({"nvidia.com/gpu": "lots"})), "not a Kubernetes quantity"),
        (pod(container({"nvidia.com/mig-9g.1tb": 1})), "not a MIG profile name"),
        (
            pod(container({"nvidia.com/gpu": 1}, {"nvidia.com/gpu": 2})),
            "requests .2. and limits .1. differ",
        ),
        (pod(container({"nvidia.com/gpu": 1, "nvidia.com/mig-1g.10gb": 1})), "at once"),
        (pod(container({"gpupart.io/gpu-memory": 1024})), "need nvidia.com/gpu.shared"),
        (
            pod(container({"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": "10Gi"})),
            "write 10240",
        ),
        (
            pod(container({"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-compute": 150})),
            "at most 100",
        ),
        (
            pod(container({"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": "1E"})),
            "more than any GPU has",
        ),
        (
            pod(container({"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": "1Ei"})),
            "more than any GPU has",
        ),
        (
            pod(container({"nvidia.com/gpu.shared": 1, "gpupart.io/gpu-memory": "1e99999999"})),
            "gpu-memory: '1e99999999' is more than a quantity can hold",
        ),
        (pod(container({"nvidia.com/gpu": "1" * 100_000})), "100000 characters long"),
        (pod(container({f"nvidia.com/mig-1g.{'9' * 100_000}gb": 1})), "at most 32 characters"),
        ({"spec": {"containers": "x"}}, "must be a list"),
        ({"spec": {"containers": [{"resources": "x"}]}}, "must be a mapping"),
    ],
)
def test_malformed_requests_are_rejected_with_the_field(spec, words):
    with pytest.raises(InvalidInput, match=words) as refused:
        parse_pod_request(spec)
    assert len(str(refused.value)) < 400, "the message never echoes the whole input"


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=3)
    ),
    max_leaves=8,
)
_QUANTITY_LIKE = _JSON | st.sampled_from(["1", "1E", "1Ei", "1e99999999", "-1", "0.5", "9" * 5000])
_NAMES = st.sampled_from(
    ["nvidia.com/gpu", "gpupart.io/gpu-memory", "gpupart.io/gpu-compute", "nvidia.com/gpu.shared",
     "nvidia.com/mig-1g.10gb", "nvidia.com/mig-x", "cpu"]
)  # fmt: skip


def _either(structured):
    """The structured value, or anything at all in its place."""
    return structured | _JSON


_AMOUNTS = _either(st.dictionaries(_NAMES, _QUANTITY_LIKE, max_size=4))
_CONTAINER = _either(
    st.fixed_dictionaries(
        {},
        optional={
            "resources": _either(
                st.fixed_dictionaries({}, optional={"limits": _AMOUNTS, "requests": _AMOUNTS})
            ),
            "restartPolicy": _either(st.just("Always")),
        },
    )
)
_POD = st.fixed_dictionaries(
    {},
    optional={
        "metadata": _either(
            st.fixed_dictionaries({}, optional={"labels": _JSON, "name": _JSON, "namespace": _JSON})
        ),
        "spec": _either(
            st.fixed_dictionaries(
                {},
                optional={
                    "containers": _either(st.lists(_CONTAINER, max_size=3)),
                    "initContainers": _either(st.lists(_CONTAINER, max_size=2)),
                    "overhead": _AMOUNTS,
                    "priority": _JSON,
                    "affinity": _JSON,
                },
            )
        ),
    },
)


@given(_POD)
def test_law_any_pod_shaped_input_is_read_or_refused_with_invalid_input(raw):
    for read in (
        parse_pod_request,
        pod_cpu_milli,
        lambda p: parse_demand(p, anti_affinity_label="g"),
    ):
        with contextlib.suppress(InvalidInput):
            read(raw)


def _c(slots: int, memory: int, *, sidecar: bool = False) -> dict[str, object]:
    limits = {"nvidia.com/gpu.shared": str(slots), "gpupart.io/gpu-memory": str(memory)}
    container: dict[str, object] = {"name": "c", "resources": {"limits": limits}}
    if sidecar:
        container["restartPolicy"] = "Always"
    return container


@pytest.mark.parametrize(
    ("init", "app", "slots", "memory"),
    [
        ([_c(1, 25000)], [_c(1, 20000)], 1, 25000),  # an init container runs alone
        ([_c(1, 10000, sidecar=True)], [_c(1, 20000)], 2, 30000),  # a sidecar runs beside
        # An ordinary init container after a sidecar runs with it: 10000 + 25000.
        ([_c(1, 10000, sidecar=True), _c(1, 25000)], [_c(1, 20000)], 2, 35000),
    ],
)
def test_pod_request_counts_sidecars_beside_the_app_as_kube_scheduler_does(
    init: list[dict[str, object]], app: list[dict[str, object]], slots: int, memory: int
) -> None:
    request = parse_pod_request({"spec": {"initContainers": init, "containers": app}})
    assert (request.shared, request.memory_mib) == (slots, memory)


def test_node_constraint_reads_node_selector_and_required_node_affinity() -> None:
    from gpupart.core.api.pods import node_constraint

    pod = {
        "spec": {
            "nodeSelector": {"zone": "a"},
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "gpus", "operator": "Gt", "values": ["3"]}
                                ]
                            },
                            {
                                "matchExpressions": [
                                    {"key": "pool", "operator": "In", "values": ["x"]}
                                ]
                            },
                        ]
                    }
                }
            },
        }
    }
    constraint = node_constraint(pod)
    assert constraint.allows({"zone": "a", "gpus": "4"})
    assert constraint.allows({"zone": "a", "pool": "x"})
    assert not constraint.allows({"zone": "a", "gpus": "3"})
    assert not constraint.allows({"zone": "b", "gpus": "8"})
    assert not constraint.allows({"zone": "a", "gpus": "many"})
    assert node_constraint({"spec": {}}).allows({})


@pytest.mark.parametrize(
    ("affinity", "words"),
    [
        ({"nodeSelectorTerms": "all"}, "nodeSelectorTerms: must be a list"),
        (
            {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "k", "operator": "In", "values": [1]}]}
                ]
            },
            "values: must be a list of strings",
        ),
    ],
)
def test_node_constraint_refuses_bad_affinity_naming_the_field(affinity, words) -> None:
    from gpupart.core.api.pods import node_constraint
    from gpupart.core.errors import InvalidInput

    pod = {
        "spec": {
            "affinity": {
                "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": affinity}
            }
        }
    }
    with pytest.raises(InvalidInput, match=words):
        node_constraint(pod)
