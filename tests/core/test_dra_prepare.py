"""DRA prepare decisions: per-claim refusals with reasons, and the laws of what a claim is given."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupart.core.api.jsontext import loads
from gpupart.core.api.spec import Mode
from gpupart.core.dra import names
from gpupart.core.dra.prepare import (
    CDI_KIND,
    CONFIG_API_VERSION,
    CONFIG_KIND,
    DraGpuNow,
    cdi_ids,
    cdi_spec,
    claim_gpus,
    instances_to_make,
    layouts_after_release,
    plan_claim,
    read_for_prepare,
)
from gpupart.core.dra.prepared import (
    ClaimRef,
    DeviceKind,
    PreparedClaim,
    decode_checkpoint,
    encode_checkpoint,
)
from gpupart.core.errors import ClaimRefused, InvalidInput
from gpupart.core.mig.catalogue import require_gpu_model
from gpupart.core.mig.layout import MigInstance, Placement
from gpupart.core.node.devices import OfferedGpu, OfferedMigDevice

NODE = "node-a"
A100 = require_gpu_model("A100-SXM4-80GB")
POD_UID = "pod-uid-1"


def _gpus(existing: tuple[OfferedMigDevice, ...] = ()) -> dict[int, DraGpuNow]:
    """GPU 0 dynamic MIG, GPU 1 whole, GPU 2 MPS (10 clients, whole-GPU ceilings)."""
    return {
        0: DraGpuNow(
            OfferedGpu(0, "GPU-0", "A100-SXM4-80GB", 81920, 0, 0, Mode.MIG, existing),
            A100,
            dynamic=True,
            warm=(("1g.10gb", 1),),
        ),
        1: DraGpuNow(OfferedGpu(1, "GPU-1", "A100-SXM4-80GB", 81920, 1, 0, Mode.NONE)),
        2: DraGpuNow(
            OfferedGpu(
                2,
                "GPU-2",
                "A100-SXM4-80GB",
                81920,
                2,
                0,
                Mode.MPS,
                replicas=10,
                mps_pipe_directory="/run/gpupart/mps/GPU-2/pipe",
                mps_memory_mib=81920,
                mps_compute_percent=100,
            )
        ),
    }


MIG_NAMES = [
    (
        names.mig_device_name(0, p.name, start),
        MigInstance(Placement(start, p.memory_slices), p.name),
    )
    for p in A100.profiles
    for start in p.starts
]


def _claim(
    uid: str,
    results: list[dict[str, Any]],
    *,
    reserved: tuple[str, ...] = (POD_UID,),
    config: list[Any] | None = None,
) -> dict[str, Any]:
    devices: dict[str, Any] = {"results": results}
    if config is not None:
        devices["config"] = config
    return {
        "metadata": {"namespace": "ns", "name": f"c-{uid}", "uid": uid},
        "status": {
            "allocation": {"devices": devices},
            "reservedFor": [{"resource": "pods", "name": f"p-{r}", "uid": r} for r in reserved],
        },
    }


def _result(device: str, *, request: str = "r", driver: str = names.DRIVER, **more: Any) -> Any:
    return {"request": request, "driver": driver, "pool": NODE, "device": device, **more}


def _plan(obj: dict[str, Any], held: tuple[PreparedClaim, ...] = (), **gpus: Any) -> PreparedClaim:
    ref = ClaimRef("ns", obj["metadata"]["name"], obj["metadata"]["uid"])
    view = read_for_prepare(ref, obj)
    return plan_claim(
        ref,
        view,
        pool=NODE,
        gpus=gpus.get("gpus") or _gpus(),
        pods_here=frozenset({POD_UID}),
        held=held,
    )


def test_mig_claim_makes_the_allocated_placement_and_whole_gpu_is_given_as_is() -> None:
    name, instance = next((n, i) for n, i in MIG_NAMES if i.profile == "3g.40gb")
    claim = _plan(_claim("u1", [_result(name, request="mig/small"), _result("gpu-1", request="w")]))
    assert not claim.complete
    assert instances_to_make(claim) == {0: (instance,)}
    assert [d.request for d in claim.devices] == ["mig", "w"]  # the subrequest stripped
    assert claim.devices[1].kind is DeviceKind.GPU and claim.devices[1].gpu_uuid == "GPU-1"


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        (_claim("u", [_result("gpu-1", driver="gpu.example.com")]), "holds no device of driver"),
        (_claim("u", [_result("gpu-1")], reserved=("someone-else",)), "is not reserved for a pod"),
        (
            _claim(
                "u",
                [_result("gpu-1")],
                config=[{"opaque": {"driver": names.DRIVER, "parameters": {"kind": 3}}}],
            ),
            "parameters.apiVersion: is required",
        ),
        (
            _claim(
                "u",
                [_result("gpu-1")],
                config=[
                    {
                        "opaque": {
                            "driver": names.DRIVER,
                            "parameters": {
                                "apiVersion": CONFIG_API_VERSION,
                                "kind": CONFIG_KIND,
                                "limits": 1,
                            },
                        }
                    }
                ],
            ),
            "parameters.limits: unknown field",
        ),
        (_claim("u", [_result("gpu-7")]), "is no device of this node"),
        (_claim("u", [_result("gpu-0")]), "is a whole GPU, and GPU 0 is in mode MIG"),
        (_claim("u", [{**_result("gpu-1"), "pool": "node-b"}]), "is not this node's pool"),
        (_claim("u", [_result("gpu-2-shared")]), "needs memory and compute"),
        (
            _claim(
                "u", [_result("gpu-2-shared", consumedCapacity={"memory": "1.5Mi", "compute": "5"})]
            ),
            "is not a whole number of MiB",
        ),
    ],
)
def test_a_claim_is_refused_with_a_reason_naming_it(obj: dict[str, Any], reason: str) -> None:
    with pytest.raises(ClaimRefused) as refused:
        _plan(obj)
    assert reason in str(refused.value)
    assert str(refused.value).startswith("claim ns/c-u: ")


def test_a_foreign_drivers_opaque_config_is_not_ours_to_read() -> None:
    obj = _claim("u", [_result("gpu-1")], config=[{"opaque": {"driver": "x.io", "parameters": 7}}])
    assert _plan(obj).complete


@pytest.mark.parametrize("depth", [40, 800, 20_000])
def test_our_opaque_config_nested_deep_is_refused_naming_it(depth: int) -> None:
    """Free-form JSON a tenant wrote, refused by its depth: at 800 levels (which `json` still
    walks) without recursion, at 20,000 after `loads` cut it when the claim was read."""
    parameters = json.dumps({"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND})[:-1] + ',"x":'
    nested = '{"a":' * depth + "1" + "}" * depth
    text = json.dumps(
        _claim(
            "u",
            [_result("gpu-1")],
            config=[{"opaque": {"driver": names.DRIVER, "parameters": "P"}}],
        )
    ).replace('"P"', parameters + nested + "}")
    with pytest.raises(ClaimRefused) as refused:
        _plan(loads(text, "claim"))
    assert "config[0].opaque.parameters" in str(refused.value)
    assert str(refused.value).endswith("parameters: nests deeper than 32 levels")


def test_a_shared_claim_is_for_one_pod_and_a_whole_gpu_for_many() -> None:
    """The scheduler counts a claim's consumedCapacity once: a shared device's claim reserved
    for two pods would give two MPS clients the memory counted for one."""
    consumed = {"memory": "10Gi", "compute": "10"}
    two = (POD_UID, "pod-uid-2")
    shared = _claim("u", [_result("gpu-2-shared", consumedCapacity=consumed)], reserved=two)
    with pytest.raises(ClaimRefused, match=r"is reserved for 2 pods \(p-pod-uid-1, p-pod-uid-2\)"):
        _plan(shared)
    assert _plan(_claim("u", [_result("gpu-1")], reserved=two)).complete


def test_the_kubelet_asking_for_another_uid_is_refused() -> None:
    obj = _claim("u", [_result("gpu-1")])
    with pytest.raises(ClaimRefused, match="uid"):
        read_for_prepare(ClaimRef("ns", "c-u", "other"), obj)


def test_an_existing_instance_at_the_placement_is_reused_and_released_unless_warm() -> None:
    name, instance = next((n, i) for n, i in MIG_NAMES if i.profile == "1g.10gb")
    existing = (OfferedMigDevice("MIG-1", instance, 1, 0, (101, 102)),)
    gpus = _gpus(existing)
    claim = _plan(_claim("u1", [_result(name)]), gpus=gpus)
    assert claim.complete and claim.devices[0].mig_uuid == "MIG-1"
    # GPU 0 keeps one idle 1g.10gb warm: the only one stays, and goes once warm is 0.
    assert layouts_after_release(claim, (claim,), gpus) == {0: (instance,)}
    cold = {**gpus, 0: DraGpuNow(gpus[0].gpu, A100, dynamic=True)}
    assert layouts_after_release(claim, (claim,), cold) == {0: ()}
    spec = cdi_spec(claim, gpus)
    assert spec["kind"] == CDI_KIND
    assert spec["devices"][0]["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=MIG-1"]
    paths = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert "/dev/nvidia-caps/nvidia-cap101" in paths and "/dev/nvidia0" in paths


def test_admin_access_views_what_exists_and_never_makes_takes_or_keeps_an_instance() -> None:
    """adminAccess (the namespace label Kubernetes requires for it is the admin's): a view of
    a device. Of a MIG placement with no instance it is refused: it would make one (and hold
    the placement) for a claim that only watches; of an instance another claim holds it is
    given the same instance, conflicts with nothing, and neither keeps it nor destroys it."""
    name, instance = next((n, i) for n, i in MIG_NAMES if i.profile == "1g.10gb")
    with pytest.raises(ClaimRefused, match=f"adminAccess to {name}, and no instance is at that"):
        _plan(_claim("adm", [_result(name, adminAccess=True)]))
    existing = (OfferedMigDevice("MIG-1", instance, 1, 0, (101, 102)),)
    gpus = {**_gpus(existing), 0: DraGpuNow(_gpus(existing)[0].gpu, A100, dynamic=True)}
    user = _plan(_claim("u1", [_result(name)]), gpus=gpus)
    admin = _plan(_claim("adm", [_result(name, adminAccess=True)]), (user,), gpus=gpus)
    assert admin.complete and admin.devices[0].mig_uuid == "MIG-1"
    assert layouts_after_release(admin, (user, admin), gpus) == {}  # the view destroys nothing
    assert layouts_after_release(user, (user, admin), gpus) == {0: ()}  # nor keeps it alive
    assert _plan(_claim("u2", [_result(name)]), (admin,), gpus=gpus).complete
    assert decode_checkpoint(encode_checkpoint(NODE, [admin]), node=NODE, where="f") == {
        "adm": admin
    }
    # a view of a shared GPU is no MPS client: the GPU's UUID, no limits
    shared = _plan(_claim("adm2", [_result("gpu-2-shared", adminAccess=True)]))
    env = cdi_spec(shared, _gpus())["devices"][0]["containerEdits"]["env"]
    assert env == ["NVIDIA_VISIBLE_DEVICES=GPU-2"]


def test_checkpoint_round_trips_and_refuses_another_version() -> None:
    name, _ = MIG_NAMES[0]
    claim = _plan(_claim("u1", [_result(name), _result("gpu-1", request="b")]))
    text = encode_checkpoint(NODE, [claim])
    assert decode_checkpoint(text, node=NODE, where="f") == {"u1": claim}
    with pytest.raises(InvalidInput, match="another node"):
        decode_checkpoint(text, node="node-b", where="f")
    with pytest.raises(InvalidInput, match="version"):
        decode_checkpoint(text.replace('"version":1', '"version":2'), node=NODE, where="f")


# ---- laws ----

EXISTING = OfferedMigDevice("MIG-1", MigInstance(Placement(0, 1), "1g.10gb"), 1, 0, (101, 102))
LAW_GPUS = _gpus((EXISTING,))
DEVICE_NAMES = [n for n, _ in MIG_NAMES] + [
    "gpu-0",
    "gpu-1",
    "gpu-2-shared",
    "gpu-9",
    "gpu-1-mig-x-0",
]
results = st.lists(
    st.fixed_dictionaries(
        {
            "device": st.sampled_from(DEVICE_NAMES),
            "driver": st.sampled_from([names.DRIVER, names.DRIVER, "gpu.example.com"]),
            "request": st.sampled_from(["a", "b"]),
        }
    ),
    min_size=1,
    max_size=4,
)


def _consumed(device: str) -> dict[str, Any]:
    return (
        {"consumedCapacity": {"memory": "1Gi", "compute": "5"}} if device.endswith("shared") else {}
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(results, min_size=1, max_size=6))
def test_law_only_allocated_devices_and_never_one_exclusive_device_twice(
    batch: list[list[dict[str, str]]],
) -> None:
    held: list[PreparedClaim] = []
    for k, entries in enumerate(batch):
        obj = _claim(
            f"u{k}",
            [
                _result(
                    e["device"], request=e["request"], driver=e["driver"], **_consumed(e["device"])
                )
                for e in entries
            ],
        )
        try:
            claim = _plan(obj, tuple(held), gpus=LAW_GPUS)
        except ClaimRefused:
            continue
        allocated = {(NODE, e["device"]) for e in entries if e["driver"] == names.DRIVER}
        assert {(d.pool, d.device) for d in claim.devices} <= allocated
        assert len(claim.devices) == sum(e["driver"] == names.DRIVER for e in entries)
        for device in claim.devices:
            if device.instance is not None:
                # The placement is the one the name says, and an instance there is that one.
                name = names.mig_device_name(
                    0, device.instance.profile, device.instance.placement.start
                )
                assert name == device.device
                existing = EXISTING.uuid if device.instance == EXISTING.instance else ""
                assert device.mig_uuid == existing
        held.append(claim)
    # Exclusive: per GPU, the memory slices of every MIG device and whole GPU held, disjoint.
    slices: dict[int, set[int]] = {}
    for claim in held:
        for device in claim.devices:
            if device.kind is DeviceKind.SHARED:
                continue
            taken = (
                set(range(8))
                if device.kind is DeviceKind.GPU
                else set(
                    range(
                        device.instance.placement.start,
                        device.instance.placement.start + device.instance.placement.size,
                    )
                )  # type: ignore[union-attr]
            )
            assert not taken & slices.get(device.gpu_index, set()), (claim, slices)
            slices.setdefault(device.gpu_index, set()).update(taken)


@settings(max_examples=200, deadline=None)
@given(results)
def test_law_the_claims_own_gpus_decide_as_every_gpu_does(entries: list[dict[str, str]]) -> None:
    """Prepare reads only `claim_gpus` (ADR 029): the same plan and spec, or the same refusal."""
    obj = _claim(
        "u",
        [
            _result(e["device"], request=e["request"], driver=e["driver"], **_consumed(e["device"]))
            for e in entries
        ],
    )
    ref = ClaimRef("ns", "c-u", "u")
    try:
        view = read_for_prepare(ref, obj)
    except ClaimRefused:
        return
    own = {i: g for i, g in LAW_GPUS.items() if i in claim_gpus(view)}

    def decided(gpus: dict[int, DraGpuNow]) -> object:
        try:
            claim = plan_claim(
                ref, view, pool=NODE, gpus=gpus, pods_here=frozenset({POD_UID}), held=()
            )
        except ClaimRefused as refused:
            return str(refused)
        try:
            return claim, cdi_spec(claim, gpus) if claim.complete else None
        except InvalidInput as error:
            return claim, str(error)

    assert decided(own) == decided(LAW_GPUS)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 81920), st.integers(1, 100))
def test_law_mps_limits_equal_the_consumed_capacity(memory_mib: int, compute: int) -> None:
    obj = _claim(
        "u1",
        [
            _result(
                "gpu-2-shared",
                consumedCapacity={"memory": f"{memory_mib}Mi", "compute": str(compute)},
                shareID="s1",
            )
        ],
    )
    claim = _plan(obj)
    (device,) = claim.devices
    assert (device.memory_mib, device.compute_percent, device.share_id) == (
        memory_mib,
        compute,
        "s1",
    )
    env = cdi_spec(claim, _gpus())["devices"][0]["containerEdits"]["env"]
    assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=GPU-2={memory_mib}M" in env
    assert f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={compute}" in env
    assert cdi_ids(claim) == ((f"{CDI_KIND}=u1-r",),)


def test_a_device_another_claim_holds_is_refused_naming_that_claim() -> None:
    name_3g, three_g = next((n, i) for n, i in MIG_NAMES if i.profile == "3g.40gb")
    name_1g = next(
        n
        for n, i in MIG_NAMES
        if i.profile == "1g.10gb" and three_g.placement.overlaps(i.placement)
    )
    first = _plan(_claim("u1", [_result(name_3g)]))
    with pytest.raises(ClaimRefused, match=f"overlaps {name_3g}, which claim ns/c-u1 holds"):
        _plan(_claim("u2", [_result(name_1g)]), (first,))
    whole = _plan(_claim("u3", [_result("gpu-1")]))
    with pytest.raises(ClaimRefused, match="which claim ns/c-u3 holds"):
        _plan(_claim("u4", [_result("gpu-1")]), (whole,))
    # Shared devices are many claims' by design.
    shared = {"consumedCapacity": {"memory": "1Gi", "compute": "5"}}
    one = _plan(_claim("u5", [_result("gpu-2-shared", **shared)]))
    assert _plan(_claim("u6", [_result("gpu-2-shared", **shared)]), (one,)).complete


def test_a_gpu_the_device_plugin_serves_is_refused() -> None:
    gpus = _gpus()
    gpus[1] = DraGpuNow(gpus[1].gpu, served=False)
    with pytest.raises(ClaimRefused, match="GPU 1 is not served through DRA now"):
        _plan(_claim("u", [_result("gpu-1")]), gpus=gpus)


def test_a_time_sliced_claim_gets_its_gpu_without_mps_limits() -> None:
    gpus = _gpus()
    gpus[2] = DraGpuNow(
        OfferedGpu(2, "GPU-2", "A100-SXM4-80GB", 81920, 2, 0, Mode.TIME_SLICING, replicas=4)
    )
    claim = _plan(
        _claim("u", [_result("gpu-2-shared", consumedCapacity={"memory": "2Gi", "compute": "7"})]),
        gpus=gpus,
    )
    edits = cdi_spec(claim, gpus)["devices"][0]["containerEdits"]
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=GPU-2"] and "mounts" not in edits


def test_an_mps_claim_above_the_daemons_ceiling_is_refused() -> None:
    gpus = _gpus()
    low = OfferedGpu(
        2, "GPU-2", "A100-SXM4-80GB", 81920, 2, 0, Mode.MPS, replicas=4,
        mps_pipe_directory="/p/GPU-2/pipe", mps_memory_mib=20480, mps_compute_percent=25,
    )  # fmt: skip
    gpus[2] = DraGpuNow(low)
    obj = _claim(
        "u", [_result("gpu-2-shared", consumedCapacity={"memory": "30Gi", "compute": "5"})]
    )
    with pytest.raises(ClaimRefused, match="at most 20480 MiB"):
        _plan(obj, gpus=gpus)
