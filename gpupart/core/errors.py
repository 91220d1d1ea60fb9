"""The one error vocabulary of gpupart: every failure the core can name, each adapter maps it once."""

from __future__ import annotations


def shown(text: str, limit: int = 40) -> str:
    """`text` quoted for a message, cut to `limit` characters: an error never echoes 100 KB."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"


class GpupartError(Exception):
    """Base of every error gpupart raises on purpose; the message is written for a person."""


class InvalidInput(GpupartError):
    """Input that can never be valid: a malformed spec, quantity, trace row or annotation.

    `where` names the place (a field path like ``spec.mig.devices``, or ``file.csv:12``) so the
    message can point at it.
    """

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}" if where else problem)
        self.where = where
        self.problem = problem


class UnknownProduct(GpupartError):
    """A GPU product that the catalogue does not know; gpupart never guesses its MIG tables."""

    def __init__(self, product: str, known: tuple[str, ...]) -> None:
        super().__init__(
            f"unknown GPU product {product!r}: gpupart has no MIG profile table for it "
            f"(known: {', '.join(known)})"
        )
        self.product = product


class UnknownProfile(GpupartError):
    """A MIG profile name that the GPU in question does not offer."""

    def __init__(self, profile: str, product: str, offered: tuple[str, ...]) -> None:
        super().__init__(
            f"MIG profile {profile!r} is not offered by {product} (offered: {', '.join(offered)})"
        )
        self.profile = profile
        self.product = product


class InfeasibleLayout(GpupartError):
    """The requested MIG instances cannot be placed on one GPU; the message says why."""


class PlanBlocked(GpupartError):
    """Reaching the desired layout would destroy a GPU instance that is in use."""


class WireFormatError(GpupartError):
    """An annotation that does not parse, or whose format version this build does not know."""


class ClaimRefused(GpupartError):
    """A DRA claim this node will not prepare as allocated; the message names the claim and why.

    The kubelet shows it on the pod (`FailedPrepareDynamicResources`); the batch's other claims
    are prepared all the same.
    """

    def __init__(self, claim: str, reason: str) -> None:
        super().__init__(f"claim {claim}: {reason}")
        self.claim = claim
        self.reason = reason
