"""Node agent settings: the `--simulate` spec with its MIG-mode suffix, and the simulated admin reset."""

from __future__ import annotations

import argparse

import pytest

from gpupart.core.dra.taints import TaintEffect
from gpupart.core.errors import InvalidInput
from gpupart_plugin import settings as node_settings
from gpupart_plugin.settings import SimulatedGpu, simulated_gpus


def parse(*argv: str) -> node_settings.NodeSettings:
    parser = argparse.ArgumentParser()
    node_settings.add_arguments(parser)
    return node_settings.from_args(parser.parse_args(["--node-name=n", *argv]))


def test_simulate_spec_counts_products_and_mig_suffixes() -> None:
    assert simulated_gpus("2xA100-SXM4-80GB:mig-off, A30 ,H200-141GB:mig-on") == (
        SimulatedGpu("A100-SXM4-80GB", False),
        SimulatedGpu("A100-SXM4-80GB", False),
        SimulatedGpu("A30", True),
        SimulatedGpu("H200-141GB", True),
    )
    assert simulated_gpus("") == ()


def test_simulate_spec_refuses_an_unknown_suffix() -> None:
    with pytest.raises(InvalidInput, match="mig-of"):
        simulated_gpus("A100-SXM4-80GB:mig-of")


def test_auto_reset_flag_bare_or_valued_and_only_with_simulated_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GPUPART_SIMULATE_AUTO_RESET", raising=False)
    assert not parse("--simulate=A30").simulate_auto_reset
    assert parse("--simulate=A30", "--simulate-auto-reset").simulate_auto_reset
    assert not parse("--simulate=A30", "--simulate-auto-reset=false").simulate_auto_reset
    monkeypatch.setenv("GPUPART_SIMULATE_AUTO_RESET", "true")
    assert parse("--simulate=A30").simulate_auto_reset
    with pytest.raises(InvalidInput, match="only with --simulate"):
        parse()


def test_simulated_latencies_default_to_zero_and_need_simulated_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("GPUPART_SIMULATE_CREATE_SECONDS", "GPUPART_SIMULATE_DESTROY_SECONDS"):
        monkeypatch.delenv(name, raising=False)
    quick = parse("--simulate=A30")
    assert (quick.simulate_create_s, quick.simulate_destroy_s) == (0.0, 0.0)
    slow = parse("--simulate=A30", "--simulate-create-seconds=1.0")
    assert (slow.simulate_create_s, slow.simulate_destroy_s) == (1.0, 0.0)
    monkeypatch.setenv("GPUPART_SIMULATE_DESTROY_SECONDS", "0.5")
    assert parse("--simulate=A30").simulate_destroy_s == 0.5
    with pytest.raises(InvalidInput, match="^GPUPART_SIMULATE_DESTROY_SECONDS: works only with"):
        parse()
    with pytest.raises(InvalidInput, match=r"^--simulate-create-seconds: must be .* got -1"):
        parse("--simulate=A30", "--simulate-create-seconds=-1")
    with pytest.raises(InvalidInput, match="^--simulate-create-seconds: expected a number"):
        parse("--simulate=A30", "--simulate-create-seconds=soon")


def test_a_faults_file_needs_simulated_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUPART_SIMULATE_FAULTS", raising=False)
    assert parse("--simulate=A30").simulate_faults is None
    assert str(parse("--simulate=A30", "--simulate-faults=f.json").simulate_faults) == "f.json"
    with pytest.raises(InvalidInput, match="^--simulate-faults: works only with --simulate"):
        parse("--simulate-faults=f.json")


def test_dra_taint_effect_is_noschedule_unless_told_and_refuses_another_word(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GPUPART_DRA_TAINT_EFFECT", raising=False)
    assert parse().dra_taint_effect is TaintEffect.NO_SCHEDULE
    assert parse("--dra-taint-effect=NoExecute").dra_taint_effect is TaintEffect.NO_EXECUTE
    with pytest.raises(InvalidInput, match="--dra-taint-effect.*NoSchedule, NoExecute"):
        parse("--dra-taint-effect=PreferNoSchedule")


def test_the_agent_writes_as_its_node_unless_told_and_refuses_another_identity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GPUPART_WRITE_AS", raising=False)
    assert parse().write_as_node is True
    assert parse("--write-as=service-account").write_as_node is False
    monkeypatch.setenv("GPUPART_WRITE_AS", "service-account")
    assert parse().write_as_node is False
    with pytest.raises(InvalidInput, match="--write-as.*node, service-account"):
        parse("--write-as=admin")
