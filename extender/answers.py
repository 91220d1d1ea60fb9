"""One node's answer for one pod shape, and batches of answers with their JSON pre-encoded in blocks.

At 5,000 nodes pydantic (or json.dumps) serialising a filter reply would cost more than the
decision: each answer carries its JSON pieces, a `Batch` joins them per block of 64 answers, and
a change re-encodes only its block.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

from gpupart.core.scheduling.evaluate import FailureKind, Fit, Verdict

from .snapshot import Signature
from .texts import UNKNOWN_SUMMARY

PASSED, FAILED, UNRESOLVABLE = 0, 1, 2
"""`Answer.status`; also the index of the JSON piece it goes into."""


@dataclass(frozen=True, slots=True)
class Answer:
    """One node's answer for one pod shape, memoised per node state, with its JSON pre-encoded.

    `sig` is the snapshot's signature of the node the answer was made for (None: a node the
    cluster state does not know); a later request reuses the answer only while its snapshot
    holds that very tuple for the node (and the fragmentation model is the same, see `memo`).
    """

    sig: Signature | None
    name: str
    status: int
    score: int
    summary: str
    """`NoFit.summary`: no node or pod names, so that equal failures count as one reason."""
    shortfall: int
    """`NoFit.shortfall` (unknown nodes: 1000, the farthest)."""
    kind: FailureKind | None
    item: str
    """JSON: the quoted name (passed) or `"name":"summary"` (failed, unresolvable)."""
    host: str
    """JSON: `{"Host":"name","Score":n}` for prioritize."""


MISSING = Answer((-1, -1), "", FAILED, 0, "", 0, None, "", "")
"""Stands for "no memo entry": its `sig` is a tuple no snapshot holds, so it never matches."""
SIG = attrgetter("sig")
_HOST = attrgetter("host")
_KIND = attrgetter("kind")


def answer_of(name: str, sig: Signature | None, verdict: Verdict | None) -> Answer:
    quoted = json.dumps(name)
    if isinstance(verdict, Fit):
        return Answer(
            sig, name, PASSED, verdict.score, "", 0, None, quoted,
            f'{{"Host":{quoted},"Score":{verdict.score}}}',
        )  # fmt: skip
    if verdict is None:
        summary, shortfall = UNKNOWN_SUMMARY, 1000
        status, kind = FAILED, FailureKind.UNKNOWN_NODE
    else:
        summary, shortfall, kind = verdict.summary, verdict.shortfall, verdict.kind
        status = UNRESOLVABLE if verdict.unresolvable else FAILED
    return Answer(
        sig, name, status, 0, summary, shortfall, kind, json_item(quoted, summary),
        f'{{"Host":{quoted},"Score":0}}',
    )  # fmt: skip


def json_item(quoted: str, text: str) -> str:
    return f"{quoted}:{json.dumps(text)}"


DETAILED_NODES = 3
"""Failed nodes per filter reply whose reason is given in full (node, GPUs, the pods in the way);
the others carry their summary. kube-scheduler writes the reasons, counted by text, into the
pod's FailedScheduling event and PodScheduled condition: summaries keep that message a few
lines long at any cluster size (with a reason per node it grew by ~70 bytes a node, ~350 KB at
5,000 nodes), and the few in full show what is in the way. Chosen: nodes where waiting or
preemption can help (FailedNodes) before unresolvable ones, then the closest to fitting
(`NoFit.shortfall`), then by name, so that the same nodes are shown attempt after attempt."""


_Failing = tuple[int, int, str, int]
"""A failed node as (status, shortfall, name, position in its batch): sorts in showing order."""

_BLOCK = 64
"""Answers per `_Block`: a change re-encodes one block, a reply joins len/64 pieces."""


@dataclass(frozen=True, slots=True)
class _Block:
    """The JSON pieces of a run of consecutive answers (items joined by ',', maybe empty)."""

    passed: str
    failed: str
    unresolvable: str
    hosts: str
    """`{"Host","Score"}` of every node."""
    passed_hosts: str
    """`{"Host","Score"}` of the passed nodes only (prioritize after filter)."""
    passed_names: tuple[str, ...]


_PASSED, _FAILED, _UNRESOLVABLE = (attrgetter(f) for f in ("passed", "failed", "unresolvable"))
_HOSTS, _PASSED_HOSTS = attrgetter("hosts"), attrgetter("passed_hosts")


def _block(answers: Sequence[Answer]) -> _Block:
    items: tuple[list[str], list[str], list[str]] = ([], [], [])
    passed_hosts = []
    for answer in answers:
        items[answer.status].append(answer.item)
        if answer.status == PASSED:
            passed_hosts.append(answer.host)
    return _Block(
        ",".join(items[PASSED]),
        ",".join(items[FAILED]),
        ",".join(items[UNRESOLVABLE]),
        ",".join(map(_HOST, answers)),
        ",".join(passed_hosts),
        tuple(a.name for a in answers if a.status == PASSED),
    )


def _join(pieces: Iterable[str]) -> str:
    return ",".join(filter(None, pieces))  # empty blocks add no comma


@dataclass(slots=True, eq=False)  # identity: batches are found in lists and dicts by identity
class Batch:
    """The answers to one list of node names for one pod shape, patched in place.

    kube-scheduler sends the same candidate nodes pod after pod, and the survivors of filter
    to prioritize; between two calls only the nodes changed since snapshot `clock` (a bind,
    a watch event) need new answers. A repeated set of names then costs one set comparison,
    the changed nodes, and re-encoding their blocks; the reply joins the blocks' pieces.
    Read and changed under the service's memo lock only.
    """

    names: list[str]
    answers: list[Answer]
    clock: int
    kinds: Counter[FailureKind | None]
    """How many nodes failed for each reason kind (None counts the nodes that passed)."""
    index: dict[str, int] = dataclasses.field(default_factory=dict)
    _blocks: list[_Block | None] = dataclasses.field(default_factory=list)
    _passed: frozenset[str] | None = None
    _failing: list[list[_Failing] | None] = dataclasses.field(default_factory=list)
    """Per block, its first `DETAILED_NODES` failed nodes in the order they are shown in full."""
    _detailed: list[_Failing] | None = None
    _shown: dict[int, tuple[object, str, str]] = dataclasses.field(default_factory=dict)
    """Per block holding nodes given in full: the reasons and the block's failed and
    unresolvable pieces with them (the same nodes are shown request after request)."""

    @classmethod
    def of(cls, names: list[str], answers: list[Answer], clock: int) -> Batch:
        count = -(-len(answers) // _BLOCK)
        return cls(
            names, answers, clock, Counter(map(_KIND, answers)),
            _blocks=[None] * count, _failing=[None] * count,
        )  # fmt: skip

    def patch(self, position: int, answer: Answer) -> None:
        old = self.answers[position]
        if old is not answer:
            self.answers[position] = answer
            self.kinds[old.kind] -= 1
            self.kinds[answer.kind] += 1
            b = position // _BLOCK
            self._blocks[b] = None
            self._shown.pop(b, None)
            if (old.status, old.shortfall) != (answer.status, answer.shortfall):
                self._failing[b] = self._detailed = None  # the `_Failing` keys moved
            if old.status != answer.status:
                self._passed = None

    def blocks(self) -> list[_Block]:
        blocks = self._blocks
        for b, block in enumerate(blocks):
            if block is None:
                blocks[b] = _block(self.answers[b * _BLOCK : (b + 1) * _BLOCK])
        return blocks  # type: ignore[return-value]  # no None left

    def passed(self) -> frozenset[str]:
        """The names of the nodes that passed."""
        if self._passed is None:
            self._passed = frozenset(chain.from_iterable(b.passed_names for b in self.blocks()))
        return self._passed

    def detailed(self) -> list[_Failing]:
        """The failed nodes to give in full (see `DETAILED_NODES`)."""
        if self._detailed is None:
            failing = self._failing
            for b, kept in enumerate(failing):
                if kept is None:
                    start = b * _BLOCK
                    run = self.answers[start : start + _BLOCK]
                    found = [
                        (a.status, a.shortfall, a.name, start + n)
                        for n, a in enumerate(run)
                        if a.status
                    ]
                    failing[b] = sorted(found)[:DETAILED_NODES]
            every = chain.from_iterable(kept or () for kept in failing)  # none is None now
            self._detailed = sorted(every)[:DETAILED_NODES]
        return self._detailed

    def filter_json(self, reasons: Mapping[int, str]) -> tuple[str, str, str]:
        """`NodeNames`, `FailedNodes` and `FailedAndUnresolvableNodes` as JSON text; the answers
        at the positions in `reasons` carry that text instead of their summary."""
        blocks = self.blocks()
        failed, unresolvable = list(map(_FAILED, blocks)), list(map(_UNRESOLVABLE, blocks))
        for b in {position // _BLOCK for position in reasons}:
            start = b * _BLOCK
            mine = [(p, t) for p, t in reasons.items() if start <= p < start + _BLOCK]
            shown = self._shown.get(b)
            if shown is None or shown[0] != mine:
                items: tuple[list[str], list[str], list[str]] = ([], [], [])
                for position, answer in enumerate(self.answers[start : start + _BLOCK], start):
                    text = reasons.get(position)
                    item = answer.item if text is None else json_item(json.dumps(answer.name), text)
                    items[answer.status].append(item)
                shown = self._shown[b] = (
                    mine, ",".join(items[FAILED]), ",".join(items[UNRESOLVABLE])
                )  # fmt: skip
            failed[b], unresolvable[b] = shown[1], shown[2]
        return (
            f"[{_join(map(_PASSED, blocks))}]",
            f"{{{_join(failed)}}}",
            f"{{{_join(unresolvable)}}}",
        )

    def hosts_json(self, *, passed_only: bool) -> str:
        """The HostPriorityList as JSON text: of every node, or of the passed ones only."""
        blocks = self.blocks()
        return f"[{_join(map(_PASSED_HOSTS if passed_only else _HOSTS, blocks))}]"
