"""The served interface as laws: never both, a held GPU never changes interface, a switch goes through neither."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpupart.core.api.spec import GpuConfig, Interface, Mode
from gpupart.core.node.interface import (
    ClaimUse,
    Holders,
    served_interface,
    wanted_interface,
)

DP, DRA = Interface.DEVICE_PLUGIN, Interface.DRA

# One step of the world: the target's interface, whether the pass's use reads answered, which
# holders leave, and whether a new pod or claim arrives through what is offered now.
steps = st.lists(
    st.tuples(
        st.sampled_from(Interface),
        st.booleans(),
        st.booleans(),
        st.sets(st.integers(0, 3), max_size=4),
        st.booleans(),
    ),
    max_size=40,
)


@given(st.sampled_from([DP, DRA, None]), steps)
def test_no_gpu_is_ever_held_or_offered_through_both(start, world):
    """Pods arrive only through an offered device plugin, claims only through offered DRA
    devices; at no step do both hold the GPU, and what is offered has no holder of the other."""
    now: Interface | None = start
    # A restart may find holders of either kind, but never of both (that is the invariant).
    pods: set[str] = {"ns/p0"} if start is DP else set()
    claims: set[str] = {"ns/c0"} if start is DRA else set()
    for k, (wanted, pods_known, claims_known, leaving, arrives) in enumerate(world):
        pods -= {f"ns/p{n}" for n in leaving}
        claims -= {f"ns/c{n}" for n in leaving}
        seen_pods = Holders(tuple(sorted(pods)), pods_known, "" if pods_known else "down")
        seen_claims = Holders(tuple(sorted(claims)), claims_known, "" if claims_known else "down")
        served = served_interface(wanted, now, seen_pods, seen_claims)
        # Never straight from one interface to the other: always through neither.
        assert not (now is not None and served.interface not in (None, now))
        if served.interface is DP:
            assert not claims, (k, served)
        if served.interface is DRA:
            assert not pods, (k, served)
        if served.interface is None:
            assert served.message
        if arrives and served.interface is DP:
            pods.add(f"ns/p{k % 4}")
        if arrives and served.interface is DRA:
            claims.add(f"ns/c{k % 4}")
        assert not (pods and claims)
        now = served.interface


@given(st.sampled_from(Interface), st.sampled_from([DP, DRA, None]), st.booleans())
def test_a_held_gpu_keeps_its_interface_or_is_withdrawn(wanted, now, known):
    """Held through `now`: served through `now` (wanted there) or by neither, never the other."""
    held = Holders(("ns/x",), known)
    free = Holders()
    pods, claims = (held, free) if now is DP else (free, held) if now is DRA else (held, held)
    served = served_interface(wanted, now, pods, claims)
    if now is None:
        assert served.interface is None
    else:
        assert served.interface in (now, None)
        assert (served.interface is now) == (wanted is now)


def test_a_switch_is_withdrawn_first_then_offered_once_free():
    busy = Holders(("team-a/train",))
    first = served_interface(DRA, DP, busy, Holders())
    assert first.interface is None
    assert "pods team-a/train" in first.message and first.pods == ("team-a/train",)
    draining = served_interface(DRA, None, busy, Holders())
    assert draining.interface is None and "team-a/train" in draining.message
    assert served_interface(DRA, None, Holders(), Holders()).interface is DRA
    free = served_interface(DRA, DP, Holders(), Holders())
    assert free.interface is None and "withdrawn from devicePlugin" in free.message
    back = served_interface(DP, None, Holders(), ClaimUse({0: ("ns/c",)}).holders(0))
    assert back.interface is None and "claims ns/c" in back.message and back.claims == ("ns/c",)
    unknown = served_interface(DP, None, Holders(), ClaimUse(known=False, problem="503").holders(0))
    assert unknown.interface is None and "unknown claims (503)" in unknown.message


def test_a_gpu_in_no_partition_is_the_device_plugins():
    assert wanted_interface(None) is DP
    assert wanted_interface(GpuConfig(Mode.NONE, interface=DRA)) is DRA
