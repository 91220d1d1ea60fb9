"""Which kubelet interface serves a GPU now: its target's, once nothing holds it through the other (ADR 022).

A GPU is served through the device plugin or through DRA, never both. A switch is two passes:
the pass that sees the new target withdraws the GPU from the old interface (served: None, so
neither offers it and no new pod or claim lands on it), and a later pass offers it through the
new one, once nothing holds it through the old one: no pod holds any of its device-plugin
devices (PodResources), or no allocated ResourceClaim names any of its DRA devices. Unknown
use (PodResources or the claims list did not answer) counts as held.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpupart.core.api.spec import GpuConfig, Interface


@dataclass(frozen=True, slots=True)
class Holders:
    """Who holds one GPU through one interface: pods (device plugin) or claims (DRA), namespace/name."""

    names: tuple[str, ...] = ()
    known: bool = True
    """False: the source did not answer (`problem` says why); the GPU then counts as held."""
    problem: str = ""

    @property
    def held(self) -> bool:
        return bool(self.names) or not self.known

    def text(self, kind: str) -> str:
        if self.names:
            return f"{kind} {', '.join(self.names)}"
        return f"unknown {kind} ({self.problem})" if not self.known else f"no {kind}"


@dataclass(frozen=True, slots=True)
class ClaimUse:
    """What this node's allocated ResourceClaims of our driver hold, per GPU index."""

    claims: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    """GPU index → the claims (namespace/name) allocated one of its devices."""
    known: bool = True
    """False: the claims could not be read (`problem`); every GPU then counts as held."""
    problem: str = ""

    def holders(self, index: int) -> Holders:
        return Holders(tuple(sorted(self.claims.get(index, ()))), self.known, self.problem)


NO_CLAIMS = ClaimUse()
"""No claim holds anything (a node agent without the DRA publisher, or tests)."""


@dataclass(frozen=True, slots=True)
class Served:
    """The interface a GPU is offered through in this pass; None while it moves (then `message`)."""

    interface: Interface | None
    message: str = ""
    """Why neither interface offers the GPU ('' when one does)."""
    pods: tuple[str, ...] = ()
    """The pods (namespace/name) the move waits for (to DRA)."""
    claims: tuple[str, ...] = ()
    """The claims (namespace/name) the move waits for (to the device plugin)."""


def wanted_interface(target: GpuConfig | None) -> Interface:
    """A GPU's target interface; no desired state yet: the device plugin (a GPU in no partition
    has the node's interface in its target, `gpupart.core.node.targets`)."""
    return target.interface if target is not None else Interface.DEVICE_PLUGIN


def served_interface(
    wanted: Interface, now: Interface | None, pods: Holders, claims: Holders
) -> Served:
    """This pass's interface for a GPU that the last pass offered through `now`.

    `now` is the wanted one: unchanged. `now` the other one: withdrawn (None), whatever holds
    it. `now` None (withdrawn, or unknown after a restart): the wanted interface once nothing
    holds the GPU through the other one, else still None.
    """
    if now is wanted:
        return Served(wanted)
    old, kind = (claims, "claims") if wanted is Interface.DEVICE_PLUGIN else (pods, "pods")
    other = Interface.DRA if wanted is Interface.DEVICE_PLUGIN else Interface.DEVICE_PLUGIN
    moving = f"moving from {other} to {wanted}"
    if old.held:
        return Served(
            None,
            f"{moving}: offered by neither while {old.text(kind)} hold it through {other}",
            **{kind: old.names},
        )
    if now is not None:
        return Served(None, f"{moving}: withdrawn from {other}, offered through {wanted} next")
    return Served(wanted)
