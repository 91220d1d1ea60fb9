"""Filter, prioritize, preempt and bind on domain types: the cache, the core's terms, holds and binding.

HTTP-free: `app.py` parses the wire models and calls these methods. Every core error is turned
into extender words here, in `explain`, and nowhere else.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import attrgetter, is_not
from typing import Any, Protocol

from gpupart.core.api.wire import ASSIGNMENT_ANNOTATION, PodAssignment, encode_assignment
from gpupart.core.errors import GpupartError, InvalidInput
from gpupart.core.scheduling.evaluate import FailureKind, Fit, NoFit, Verdict, evaluate
from gpupart.core.scheduling.pods import Demand, parse_demand, tenant_of
from gpupart.core.scheduling.preemption import Budget, choose_victims, order_victims, violations
from gpupart.core.scheduling.scoring import FragmentationModel
from gpupart.core.scheduling.shares import Shape, fragmentation_model, fragmentation_model_of
from gpupart.core.scheduling.terms import ScoringConfig
from gpupart.core.scheduling.views import NodeView, PlacedPod, assemble_node

from .cache import ClusterCache, PodEntry, read_node
from .metrics import Metrics

log = logging.getLogger(__name__)


class Binder(Protocol):
    """The one API write of a bind: a Binding that also carries the pod's new annotations (the
    API server copies a Binding's annotations onto the pod in the same update as its nodeName).
    `kube.ApiBinder` does it for real, tests pass a fake."""

    def bind(
        self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str]
    ) -> None: ...


def explain(error: BaseException) -> str:
    """The one place an error becomes the text of an `Error` field."""
    if isinstance(error, InvalidInput):
        return f"invalid pod: {error}"
    if isinstance(error, GpupartError):
        return str(error)
    return f"internal error: {type(error).__name__}: {error}"


@dataclass(frozen=True, slots=True)
class FilterOutcome:
    passed: list[str]
    failed: dict[str, str]
    unresolvable: dict[str, str]
    error: str = ""
    encoded: tuple[str, str, str] | None = None
    """`passed`, `failed` and `unresolvable` as JSON text, joined from memoised pieces."""


@dataclass(frozen=True, slots=True)
class NodeVictims:
    """Victims on one candidate node (pod UIDs, highest priority first) and the PDB violations
    their eviction makes: a node of ExtenderPreemptionArgs or ExtenderPreemptionResult."""

    uids: tuple[str, ...]
    violations: int


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """Every asked node's verdict for one pod, reasons in full (see `ExtenderService.diagnose`)."""

    pod: str
    scores: dict[str, int]
    failed: dict[str, str]
    unresolvable: dict[str, str]
    unreadable: dict[str, str]
    """Objects the watch cache could not read ("Pod ns/name", "Node name") and why."""


PASSED, FAILED, UNRESOLVABLE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Answer:
    """One node's answer for one pod shape, memoised per node state, with its JSON pre-encoded.

    `sig` is the cache's (version, state id) tuple the answer was made for (None: a node the
    cache does not know); a later request reuses the answer only while the cache still holds
    that very tuple for the node.
    """

    sig: tuple[int, int] | None
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


_MISSING = Answer((-1, -1), "", FAILED, 0, "", 0, None, "", "")
"""Stands for "no memo entry": its `sig` is a tuple the cache never holds, so it never matches."""
_SIG = attrgetter("sig")
_HOST = attrgetter("host")
_KIND = attrgetter("kind")


def _answer(name: str, sig: tuple[int, int] | None, verdict: Verdict | None) -> Answer:
    quoted = json.dumps(name)
    if isinstance(verdict, Fit):
        return Answer(
            sig, name, PASSED, verdict.score, "", 0, None, quoted,
            f'{{"Host":{quoted},"Score":{verdict.score}}}',
        )  # fmt: skip
    if verdict is None:
        summary, shortfall = _UNKNOWN_SUMMARY, 1000
        status, kind = FAILED, FailureKind.UNKNOWN_NODE
    else:
        summary, shortfall, kind = verdict.summary, verdict.shortfall, verdict.kind
        status = UNRESOLVABLE if verdict.unresolvable else FAILED
    return Answer(
        sig, name, status, 0, summary, shortfall, kind, _item(quoted, summary),
        f'{{"Host":{quoted},"Score":0}}',
    )  # fmt: skip


_UNKNOWN_SUMMARY = "node(s) not yet known to the gpupart extender"


def _unknown_reason(name: str) -> str:
    return f"{name}: not known to the gpupart extender (no such Node watched yet)"


def _item(quoted: str, text: str) -> str:
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
class _Batch:
    """The answers to one list of node names for one pod shape, patched in place.

    kube-scheduler sends the same candidate nodes pod after pod, and the survivors of filter
    to prioritize; between two calls only the nodes the cache changed since `clock` (a bind,
    a watch event) need new answers. A repeated set of names then costs one set comparison,
    the changed nodes, and re-encoding their blocks; the reply joins the blocks' pieces.
    Read and changed under the cache's lock only.
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
    def of(cls, names: list[str], answers: list[Answer], clock: int) -> _Batch:
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
                    item = answer.item if text is None else _item(json.dumps(answer.name), text)
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


_BATCHES = 4
"""Lists kept per pod shape: filter's candidates, prioritize's survivors, and two spare."""
KEPT_LISTS = 16
"""Lists kept in all: each costs ~1 MB at 5,000 nodes (index and JSON pieces); the pod shapes
asked most recently keep theirs."""


@dataclass(slots=True)
class _ShapeMemo:
    """Memo of one pod shape: verdict per node state id, answer per node name, recent lists."""

    states: dict[int, Verdict] = dataclasses.field(default_factory=dict)
    """The verdict per node state id: its NoFit `reason` names whichever node was evaluated
    first (only the `summary` is shared; full reasons are in `reasons`)."""
    nodes: dict[str, Answer] = dataclasses.field(default_factory=dict)
    reasons: dict[str, tuple[tuple[int, int] | None, str]] = dataclasses.field(default_factory=dict)
    """Full reasons of the nodes last shown in full, with the signature each was made for."""
    batches: list[_Batch] = dataclasses.field(default_factory=list)
    """Most recently used first."""

    def use(self, batch: _Batch) -> _Batch:
        """A kept batch, moved to the front."""
        if self.batches[0] is not batch:
            self.batches.remove(batch)
            self.batches.insert(0, batch)
        return batch

    def keep(self, batch: _Batch) -> list[_Batch]:
        """Keep a new batch; returns those it pushed out."""
        self.batches.insert(0, batch)
        dropped = self.batches[_BATCHES:]
        del self.batches[_BATCHES:]
        return dropped


@dataclass(frozen=True, slots=True)
class Hold:
    """A filter decision kept until bind: the pod as the scheduler sent it and its demand."""

    pod: Mapping[str, Any]
    demand: Demand
    expires: float


class ExtenderService:
    def __init__(
        self,
        cache: ClusterCache,
        scoring: ScoringConfig,
        *,
        binder: Binder,
        metrics: Metrics,
        ttl_seconds: float = 30.0,
        admission_wait_seconds: float = 1.5,
        refresh_seconds: float = 60.0,
        memo_size: int = 200_000,
        kept_lists: int = KEPT_LISTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.scoring = scoring
        self.binder = binder
        self.metrics = metrics
        self.ttl = ttl_seconds
        self.admission_wait = admission_wait_seconds
        self.refresh = refresh_seconds
        self.memo_size = memo_size
        self.clock = clock
        self._memo: dict[Demand, _ShapeMemo] = {}
        self.kept_lists = kept_lists
        self._recent: OrderedDict[_Batch, _ShapeMemo] = OrderedDict()
        """Every kept batch, least recently used first, with the memo that keeps it."""
        self._generation = cache.generation
        self._holds: dict[str, Hold] = {}
        self._holds_lock = threading.Lock()
        self._model: FragmentationModel = fragmentation_model(())
        self._mix: Counter[Shape] = Counter()
        self._model_at = -math.inf
        self._last_purge = -math.inf

    # -- shared machinery --

    def model(self, now: float) -> FragmentationModel:
        """The policy's model over the observed mix (CPU included), looked at every `refresh` seconds.

        The mix is kept by the cache; the model (and with it every memoised verdict) is
        replaced only when the typical pods it yields changed.
        """
        if now - self._model_at >= self.refresh:
            self._model_at = now
            mix = self.cache.observed_mix()
            if mix != self._mix:
                self._mix = mix
                model = fragmentation_model_of(mix)
                if model != self._model:
                    self._model = model
                    self._forget()  # verdicts depend on the model
        return self._model

    def _housekeeping(self, now: float) -> None:
        if now - self._last_purge < 1.0:
            return
        self._last_purge = now
        self.cache.expire(now)
        with self._holds_lock:
            for uid in [u for u, h in self._holds.items() if h.expires <= now]:
                del self._holds[uid]
        size = sum(len(m.states) + len(m.nodes) + len(m.reasons) for m in list(self._memo.values()))
        if size > self.memo_size:
            self._forget()

    def _forget(self) -> None:
        with self.cache.lock():  # bind's housekeeping runs on a worker thread
            self._memo = {}
            self._recent.clear()

    def _keep(self, memo: _ShapeMemo, batch: _Batch) -> None:
        for dropped in memo.keep(batch):
            self._recent.pop(dropped, None)
        self._recent[batch] = memo
        while len(self._recent) > self.kept_lists:
            oldest, owner = self._recent.popitem(last=False)
            owner.batches.remove(oldest)

    def _use(self, memo: _ShapeMemo, batch: _Batch) -> _Batch:
        self._recent.move_to_end(batch)
        return memo.use(batch)

    def _answers(
        self,
        names: Sequence[str],
        demand: Demand,
        given: Mapping[str, NodeView],
        now: float,
        *,
        survivors: bool = False,
        own: Mapping[str, NodeView] | None = None,
    ) -> tuple[_Batch, bool, _ShapeMemo]:
        """Answers per node name, memoised per node state and pod shape (see `_ShapeMemo`).

        Returns the batch, whether `names` are its passed nodes only (`survivors`: a
        prioritize list may be what filter let through), and the shape's memo. A repeated
        list is patched where the cache changed since (see `_Batch`); a new list costs a few
        dict lookups per node. A node is evaluated only when no node in the same state was
        evaluated for this pod shape since the model last changed. `own`: views of nodes where
        the pod holds a reservation (nominated), without it: answered afresh, never kept.
        """
        names = names if isinstance(names, list) else list(names)
        shape = dataclasses.replace(demand, pod="")
        with self.cache.lock():
            model = self.model(now)
            if self.cache.generation != self._generation:
                self._generation = self.cache.generation
                self._forget()
            memo = self._memo.get(shape)
            if memo is None:
                memo = self._memo[shape] = _ShapeMemo()
            sigs = self.cache.signatures()
            if not given and not own:
                found = self._kept(names, memo, sigs, demand, model, survivors=survivors)
                if found is not None:
                    return (*found, memo)
            nodes_memo = memo.nodes
            # The hot path runs in C (map, compress): memo answers, the cache's current
            # (version, state id) tuples, and the positions where the two do not match.
            out = list(map(nodes_memo.get, names, repeat(_MISSING)))
            stale = compress(
                range(len(names)),
                map(is_not, map(sigs.get, names), map(_SIG, out)),
            )
            for n in stale:
                name = names[n]
                if sigs.get(name) is None and name in given:
                    # Sent in full by the scheduler, unknown to the cache: not memoised.
                    verdict = evaluate(given[name], demand, config=self.scoring, model=model)
                    out[n] = _answer(name, None, verdict)
                else:
                    out[n] = self._answer(name, sigs, demand, memo, model)
            for n, name in enumerate(names):
                if own and name in own:  # the pod's own reservation does not block it
                    verdict = evaluate(own[name], demand, config=self.scoring, model=model)
                    out[n] = _answer(name, None, verdict)
            batch = _Batch.of(names, out, self.cache.clock)
            if not given and not own:
                batch.index = dict(zip(names, range(len(names)), strict=True))
                if len(batch.index) == len(names):  # a list naming a node twice is not kept
                    self._keep(memo, batch)
        return batch, False, memo

    def _kept(
        self,
        names: list[str],
        memo: _ShapeMemo,
        sigs: Mapping[str, tuple[int, int]],
        demand: Demand,
        model: FragmentationModel,
        *,
        survivors: bool,
    ) -> tuple[_Batch, bool] | None:
        """A kept batch for `names`, patched up to the cache's clock; None when none fits.

        kube-scheduler lists the feasible nodes in the order its parallel filter found them,
        which changes from pod to pod: a batch answers any list of the same nodes, and its
        reply keeps the batch's order (the scheduler reads replies by name, not position).
        """
        key: frozenset[str] | None = None
        for batch in list(memo.batches):
            changed = self.cache.changed_since(batch.clock)
            if changed is None:  # too far behind to patch
                memo.batches.remove(batch)
                self._recent.pop(batch, None)
                continue
            for name in changed:
                position = batch.index.get(name)
                if position is not None:
                    batch.patch(position, self._answer(name, sigs, demand, memo, model))
            batch.clock = self.cache.clock
            if batch.names == names:  # the same order: cheapest
                return self._use(memo, batch), False
            if key is None:
                key = frozenset(names)
                if len(key) != len(names):
                    return None  # a list naming a node twice is answered afresh
            if batch.index.keys() == key:
                return self._use(memo, batch), False
            if survivors and batch.passed() == key:
                return self._use(memo, batch), True
        return None

    def _answer(
        self,
        name: str,
        sigs: Mapping[str, tuple[int, int]],
        demand: Demand,
        memo: _ShapeMemo,
        model: FragmentationModel,
    ) -> Answer:
        """The node's memoised answer while its signature holds, else a fresh one (memoised)."""
        sig = sigs.get(name)
        answer = memo.nodes.get(name)
        if answer is None or answer.sig is not sig:
            answer = self._evaluate(name, sig, demand, memo, model)
            memo.nodes[name] = answer
        return answer

    def _evaluate(
        self,
        name: str,
        sig: tuple[int, int] | None,
        demand: Demand,
        memo: _ShapeMemo,
        model: FragmentationModel,
    ) -> Answer:
        """The memo miss: the verdict of the node's state (nodes in equal states share it)."""
        verdict = memo.states.get(sig[1]) if sig is not None else None
        if verdict is None:
            view = self.cache.view(name) if sig is not None else None
            if sig is None or view is None:
                return _answer(name, sig, None)
            verdict = memo.states[sig[1]] = evaluate(view, demand, config=self.scoring, model=model)
        return _answer(name, sig, verdict)

    def _reason(
        self,
        answer: Answer,
        demand: Demand,
        memo: _ShapeMemo,
        given: Mapping[str, NodeView],
        model: FragmentationModel,
    ) -> str:
        """The full reason of a failed node (see `DETAILED_NODES`), kept per node signature."""
        name = answer.name
        kept = memo.reasons.get(name)
        if kept is not None and kept[0] is answer.sig and answer.sig is not None:
            return kept[1]
        view = self.cache.view(name) if answer.sig is not None else given.get(name)
        if view is None:
            return _unknown_reason(name)
        verdict = evaluate(view, demand, config=self.scoring, model=model)
        # The cache may have moved since the answer was made: then the summary it carried.
        text = verdict.reason if isinstance(verdict, NoFit) else answer.summary
        if answer.sig is not None:
            memo.reasons[name] = (answer.sig, text)
        return text

    def _demand(self, pod: Mapping[str, Any]) -> Demand:
        return parse_demand(pod, group_label=self.scoring.group_label)

    # -- verbs --

    def filter(
        self,
        pod: Mapping[str, Any],
        names: Sequence[str],
        nodes: Iterable[Mapping[str, Any]] = (),
        *,
        lists: bool = True,
    ) -> FilterOutcome:
        """Which nodes can take the pod and why not; `lists=False`: only `encoded` is filled."""
        now = self.clock()
        self._housekeeping(now)
        try:
            demand = self._demand(pod)
        except GpupartError as error:
            self.metrics.decisions.labels("filter", "error").inc()
            return FilterOutcome([], {}, {}, explain(error))
        given = _views_from_objects(nodes)
        own = self._own_views(pod)
        batch, _, memo = self._answers(names, demand, given, now, own=own)
        given = {**given, **own}
        passed: list[str] = []
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        with self.cache.lock():  # kept batches change under this lock only
            reasons = {
                position: self._reason(batch.answers[position], demand, memo, given, self._model)
                for *_, position in batch.detailed()
            }
            if lists:
                for answer in batch.answers:
                    if answer.status == PASSED:
                        passed.append(answer.name)
                    else:
                        into = failed if answer.status == FAILED else unresolvable
                        into[answer.name] = answer.summary
                for position, text in reasons.items():
                    answer = batch.answers[position]
                    (failed if answer.status == FAILED else unresolvable)[answer.name] = text
            kinds = Counter(batch.kinds)
            encoded = batch.filter_json(reasons)
        for reason, count in kinds.items():
            if reason is not None and count > 0:
                self.metrics.filtered.labels(reason).inc(count)
        uid = _uid(pod)
        with self._holds_lock:
            self._holds[uid] = Hold(pod, demand, now + self.ttl)
        fits = kinds[None] > 0
        self.metrics.decisions.labels("filter", "ok" if fits else "unschedulable").inc()
        if not fits:
            log.info(
                "Filtered out every node",
                extra={
                    "kv": {"pod": demand.pod, "nodes": len(names), "e.g.": list(reasons.values())}
                },
            )
        return FilterOutcome(passed, failed, unresolvable, encoded=encoded)

    def prioritize(
        self, pod: Mapping[str, Any], names: Sequence[str], nodes: Iterable[Mapping[str, Any]] = ()
    ) -> list[tuple[str, int]]:
        batch, passed_only = self._prioritize(pod, names, nodes)
        with self.cache.lock():
            return [
                (a.name, a.score) for a in batch.answers if not passed_only or a.status == PASSED
            ]

    def prioritize_json(
        self, pod: Mapping[str, Any], names: Sequence[str], nodes: Iterable[Mapping[str, Any]] = ()
    ) -> str:
        """`prioritize` as the JSON HostPriorityList, joined from memoised pieces."""
        batch, passed_only = self._prioritize(pod, names, nodes)
        with self.cache.lock():
            return batch.hosts_json(passed_only=passed_only)

    def _prioritize(
        self, pod: Mapping[str, Any], names: Sequence[str], nodes: Iterable[Mapping[str, Any]]
    ) -> tuple[_Batch, bool]:
        now = self.clock()
        demand = self._demand(pod)  # InvalidInput goes to the caller: prioritize has no Error field
        batch, passed_only, _ = self._answers(
            names, demand, _views_from_objects(nodes), now, survivors=True, own=self._own_views(pod)
        )
        self.metrics.decisions.labels("prioritize", "ok").inc()
        return batch, passed_only

    def diagnose(self, pod: Mapping[str, Any], names: Sequence[str] = ()) -> Diagnosis:
        """Why the pod fits or not on each node (every watched node when `names` is empty),
        each reason in full: what a person asks when a filter reply gave only a few in full.

        Not on kube-scheduler's path and not memoised: every node is evaluated on its current
        view (0.06-1.5 s at 5,000 nodes: every node that fits is scored). InvalidInput (a pod we
        cannot read) goes to the caller.
        """
        demand = self._demand(pod)
        model = self.model(self.clock())
        scores: dict[str, int] = {}
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        for name in names or self.cache.node_names():
            view = self.cache.view(name)  # views are immutable: evaluated outside the lock
            if view is None:
                failed[name] = _unknown_reason(name)
                continue
            verdict = evaluate(view, demand, config=self.scoring, model=model)
            if isinstance(verdict, Fit):
                scores[name] = verdict.score
            else:
                (unresolvable if verdict.unresolvable else failed)[name] = verdict.reason
        unreadable = {f"{u.kind} {u.name}": u.problem for u in self.cache.unreadable()}
        return Diagnosis(demand.pod, scores, failed, unresolvable, unreadable)

    def preempt(
        self, pod: Mapping[str, Any], candidates: Mapping[str, NodeVictims]
    ) -> dict[str, NodeVictims]:
        """Per candidate node of kube-scheduler's preemption, the victims that let the pod fit
        there; nodes where none do are left out. InvalidInput (a pod we cannot read) goes to
        the caller.

        Shared-GPU pods: the cheapest set of lower-priority pods on one GPU (`choose_victims`),
        plus the victims kube-scheduler chose that hold no shared GPU (it needed them for what
        it counts in-tree); its victims on other GPUs are dropped, they free nothing for us.
        Where the GPU already fits, kube-scheduler's victims stand. MIG and whole-GPU pods:
        kube-scheduler's victims stand if their removal frees what the pod asks, else the node
        goes. The freed GPU is proposed to the cache: if the pod is nominated to that node, its
        reservation goes there.
        """
        now = self.clock()
        self._housekeeping(now)
        demand = self._demand(pod)
        self.metrics.preemptions.inc()
        uid = _uid(pod)
        budgets = self.cache.budgets()
        model = self.model(now)
        kept: dict[str, NodeVictims] = {}
        for node, offered in candidates.items():
            answer = self._victims_on(node, offered, demand, uid, budgets, model, now)
            if answer is None:
                self.metrics.dropped.inc()
            else:
                kept[node] = answer
                self.metrics.victims.inc(len(answer.uids))
        self.metrics.decisions.labels("preempt", "ok" if kept else "unschedulable").inc()
        log.info(
            "Answered preemption",
            extra={
                "kv": {
                    "pod": demand.pod,
                    "candidates": len(candidates),
                    "kept": {n: list(v.uids) for n, v in list(kept.items())[:3]},
                }
            },
        )
        return kept

    def _victims_on(
        self,
        node: str,
        offered: NodeVictims,
        demand: Demand,
        uid: str,
        budgets: Sequence[Budget],
        model: FragmentationModel,
        now: float,
    ) -> NodeVictims | None:
        request = demand.request
        if not (request.mig or request.whole_gpus or request.shared):
            return offered  # not a GPU pod: nothing of ours to check
        # Lower-priority pods nominated here lose their nomination when this pod preempts
        # (kube-scheduler clears it); the pod's own reservation is its own.
        gone = {
            e.uid
            for e in self.cache.nominated_on(node)
            if e.uid == uid or e.placed.tenant.priority < demand.priority
        }
        if request.mig or request.whole_gpus:
            after = self.cache.view_excluding(node, gone | set(offered.uids))
            if after is None:
                return None
            verdict = evaluate(after, demand, config=self.scoring, model=model)
            return offered if isinstance(verdict, Fit) else None
        view = self.cache.view_excluding(node, gone)
        if view is None:
            return None
        if isinstance(evaluate(view, demand, config=self.scoring, model=model), Fit):
            return offered  # the GPU has room: kube-scheduler's victims are for its own counts
        entries = {e.uid: e for e in self.cache.pods_on(node)}
        evictable = frozenset(
            e.key
            for e in entries.values()
            if e.placed.request.shared and e.placed.tenant.priority < demand.priority
        )
        chosen = choose_victims(
            view, demand, evictable=evictable, budgets=budgets, config=self.scoring
        )
        if chosen is None:
            return None
        by_key = {e.key: e for e in entries.values()}
        theirs = [
            u for u in offered.uids if not (u in entries and entries[u].placed.request.shared)
        ]
        known = [entries[u].placed.tenant for u in theirs if u in entries]
        ordered = order_victims([*chosen.pods, *known])
        uids = tuple(by_key[t.pod].uid for t in ordered) + tuple(
            u for u in theirs if u not in entries
        )
        self.cache.propose(uid, node, chosen.gpu, uids, expires=now + self.ttl)
        return NodeVictims(uids, violations(ordered, budgets))

    def _own_views(self, pod: Mapping[str, Any]) -> dict[str, NodeView]:
        """The node where the pod holds a reservation (nominated), viewed without it."""
        uid = _uid(pod)
        held = self.cache.nomination(uid)
        if held is None:
            return {}
        # Its victims there are on their way out: filter and prioritize count them gone, so a
        # watch that shows them deleted a little later than kube-scheduler's does not make it
        # preempt again elsewhere (bind still counts them until they are gone).
        gone = [uid, *self.cache.evicted_for(uid, held.node)]
        view = self.cache.view_excluding(held.node, gone)
        return {} if view is None else {held.node: view}

    def bind(self, namespace: str, name: str, uid: str, node: str) -> str:
        """Choose the GPU again on fresh state, reserve it, write the assignment, bind; "" = done."""
        now = self.clock()
        self._housekeeping(now)
        key = uid or f"{namespace}/{name}"
        with self._holds_lock:
            hold = self._holds.get(key)
        if hold is None or hold.demand.pod != f"{namespace}/{name}":
            self.metrics.decisions.labels("bind", "error").inc()
            return (
                f"no filter decision for pod {namespace}/{name} (uid {uid!r}) in the last "
                f"{self.ttl:g}s; the scheduler will retry"
            )
        demand = hold.demand
        with self.cache.lock():
            if demand.request.shared:
                waiting = self._await_admission(node, demand.pod)
                if waiting:
                    self.metrics.decisions.labels("bind", "error").inc()
                    return waiting
            # A pod nominated here after preemption is not kept out by its own reservation.
            # Its victims still count until they are gone: bind never over-commits a GPU (filter
            # passes without them, so a victim slow to go is a bind retry, not a new preemption).
            view = self.cache.view_excluding(node, [key])
            if view is None:
                self.metrics.decisions.labels("bind", "error").inc()
                return f"node {node} is not known to the gpupart extender"
            verdict = evaluate(view, demand, config=self.scoring, model=self.model(now))
            if isinstance(verdict, NoFit):
                self.metrics.decisions.labels("bind", "error").inc()
                return f"node changed since filter: {verdict.reason}"
            assignment = None
            if verdict.gpu is not None:
                gpu = next(g for g in view.gpus if g.index == verdict.gpu)
                assignment = PodAssignment(
                    node,
                    gpu.index,
                    gpu.uuid,
                    demand.request.memory_mib,
                    demand.request.compute_percent,
                )
            entry = PodEntry(
                key,
                demand.pod,
                node,
                PlacedPod(
                    tenant_of(hold.pod, demand.request),
                    demand.request,
                    assignment,
                    demand.cpu_milli,
                ),
                awaiting=assignment is not None,
            )
            # Reserved before the API calls, so a concurrent bind already sees this capacity gone.
            self.cache.assume(entry, expires=now + self.ttl)
        # MIG and whole-GPU pods have no assignment: a bare Binding.
        annotations = (
            {} if assignment is None else {ASSIGNMENT_ANNOTATION: encode_assignment(assignment)}
        )
        try:
            self.binder.bind(namespace, name, uid, node, annotations)
        except Exception as error:  # noqa: BLE001 - any API failure is reported, never raised
            self.cache.forget(key)
            self.metrics.decisions.labels("bind", "error").inc()
            log.warning(
                "Failed to bind pod",
                extra={"kv": {"pod": demand.pod, "node": node, "err": explain(error)}},
            )
            return f"binding {demand.pod} to {node} failed: {explain(error)}"
        with self._holds_lock:
            self._holds.pop(key, None)
        self.metrics.decisions.labels("bind", "ok").inc()
        log.info(
            "Bound pod",
            extra={
                "kv": {
                    "pod": demand.pod,
                    "node": node,
                    "gpu": "" if assignment is None else assignment.gpu,
                    "score": verdict.score,
                }
            },
        )
        return ""

    def _await_admission(self, node: str, pod: str) -> str:
        """Wait (under the cache lock) until no other shared-GPU pod awaits admission on `node`.

        The kubelet's Allocate names no pod, so a node whose device plugin pairs by the one
        awaiting pod (`serial_admission`) gets the next shared pod only once the plugin has
        recorded what it gave the last one (docs/adr-001-shared-gpu-admission.md). Returns ""
        when the node is free, else the reason, after at most `admission_wait` seconds (kept
        below kube-scheduler's httpTimeout, which then retries the pod).
        """
        deadline = time.monotonic() + self.admission_wait
        while self.cache.serial_admission(node):
            others = [p for p in self.cache.awaiting(node) if p != pod]
            if not others:
                return ""
            left = deadline - time.monotonic()
            if left <= 0:
                return (
                    f"node {node} is still admitting {others[0]}: the device plugin serves one "
                    "shared-GPU pod per node at a time, and has not recorded its allocation "
                    f"after {self.admission_wait:g}s; the scheduler will retry"
                )
            self.cache.wait_for_change(left)
        return ""


def _uid(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    uid = meta.get("uid")
    if uid:
        return str(uid)
    return f"{meta.get('namespace') or 'default'}/{meta.get('name') or '?'}"


def _views_from_objects(nodes: Iterable[Mapping[str, Any]]) -> dict[str, NodeView]:
    """Views of nodes the scheduler sent in full (nodeCacheCapable false) that the cache lacks.

    No pods are known for them, so they are trusted only as far as their inventory goes (and
    their allocatable CPU counts as all free).
    """
    views = {}
    for node in nodes:
        name = str((node.get("metadata") or {}).get("name") or "")
        if name:
            entry = read_node(node)
            views[name] = assemble_node(
                name, entry.inventory, (), cpu_milli=entry.cpu_milli, problem=entry.problem
            )
    return views
