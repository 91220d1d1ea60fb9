"""Answers per node for a pod shape, reused only for the node signature and model they were made for.

A `Memo` belongs to one fragmentation model (a new model starts a new memo: verdicts depend on
it). Inside it, per pod shape (the demand without the pod's name):
- the verdict per node state id: nodes in equal states share it, and state ids are never
  reused (`cache`), so a kept verdict is right for every node that has that id;
- the answer per node name, with the signature it was made for: reused while the snapshot
  holds that very signature tuple for the node;
- recent lists of node names (`answers.Batch`), patched where the snapshot changed since.
Nothing is ever invalidated otherwise: a memo only grows until `size` passes the service's
bound, and then the service starts a new one (as it does for a new model).

Not thread-safe: the service calls it under its memo lock, which only request paths take.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import is_not

from gpupart.core.scheduling.demand import PodDemand
from gpupart.core.scheduling.evaluate import NoFit, Verdict, evaluate
from gpupart.core.scheduling.scoring import FragmentationModel
from gpupart.core.scheduling.terms import ScoringConfig
from gpupart.core.scheduling.views import NodeView

from .answers import MISSING, SIG, Answer, Batch, answer_of
from .snapshot import Signature, Snapshot
from .texts import unknown_reason

_BATCHES = 4
"""Lists kept per pod shape: filter's candidates, prioritize's survivors, and two spare."""
KEPT_LISTS = 16
"""Lists kept in all: each costs ~1 MB at 5,000 nodes (index and JSON pieces); the pod shapes
asked most recently keep theirs."""


@dataclass(slots=True)
class ShapeMemo:
    """Memo of one pod shape: verdict per node state id, answer per node name, recent lists."""

    states: dict[int, Verdict] = dataclasses.field(default_factory=dict)
    """The verdict per node state id: its NoFit `reason` names whichever node was evaluated
    first (only the `summary` is shared; full reasons are in `reasons`)."""
    nodes: dict[str, Answer] = dataclasses.field(default_factory=dict)
    reasons: dict[str, tuple[Signature | None, str]] = dataclasses.field(default_factory=dict)
    """Full reasons of the nodes last shown in full, with the signature each was made for."""
    batches: list[Batch] = dataclasses.field(default_factory=list)
    """Most recently used first."""


class Memo:
    """Everything kept for one fragmentation model, with a bound on the name lists kept."""

    def __init__(self, model: FragmentationModel, scoring: ScoringConfig, kept_lists: int) -> None:
        self.model = model
        self.scoring = scoring
        self.kept_lists = kept_lists
        self.shapes: dict[PodDemand, ShapeMemo] = {}
        self._recent: OrderedDict[Batch, ShapeMemo] = OrderedDict()
        """Every kept batch, least recently used first, with the shape memo that keeps it."""

    def size(self) -> int:
        """Entries kept (verdicts, answers and reasons), for the service's bound."""
        return sum(len(m.states) + len(m.nodes) + len(m.reasons) for m in self.shapes.values())

    def shape(self, demand: PodDemand) -> ShapeMemo:
        shape = dataclasses.replace(demand, pod="")
        memo = self.shapes.get(shape)
        if memo is None:
            memo = self.shapes[shape] = ShapeMemo()
        return memo

    def answers(
        self,
        snap: Snapshot,
        names: Sequence[str],
        demand: PodDemand,
        given: Mapping[str, NodeView],
        *,
        survivors: bool = False,
        own: Mapping[str, NodeView] | None = None,
    ) -> tuple[Batch, bool, ShapeMemo]:
        """Answers per node name on `snap`, memoised per node state and pod shape.

        Returns the batch, whether `names` are its passed nodes only (`survivors`: a
        prioritize list may be what filter let through), and the shape's memo. A repeated
        list is patched where the snapshot changed since (see `Batch`); a new list costs a few
        dict lookups per node. A node is evaluated only when no node in the same state was
        evaluated for this pod shape under this model. `given`: views of nodes the scheduler
        sent in full; `own`: views of nodes where the pod holds a reservation (nominated, or
        a MIG instance of a plan), as it sees them. Both are answered afresh, never kept.
        """
        names = names if isinstance(names, list) else list(names)
        memo = self.shape(demand)
        sigs = snap.signatures
        if not given and not own:
            found = self._kept(snap, names, memo, demand, survivors=survivors)
            if found is not None:
                return (*found, memo)
        # The hot path runs in C (map, compress): memo answers, the snapshot's signatures,
        # and the positions where the two do not match.
        out = list(map(memo.nodes.get, names, repeat(MISSING)))
        stale = compress(range(len(names)), map(is_not, map(sigs.get, names), map(SIG, out)))
        for n in stale:
            name = names[n]
            if own and name in own:
                # Answered below for this pod alone: its verdict there is not its shape's
                # (a MIG instance reserved for it is free for it only), so it must not be kept.
                continue
            if sigs.get(name) is None and name in given:
                # Sent in full by the scheduler, unknown to the cluster state: not memoised.
                out[n] = answer_of(name, None, self._evaluate(given[name], demand))
            else:
                out[n] = self._answer(snap, name, demand, memo)
        for n, name in enumerate(names):
            if own and name in own:  # the pod's own reservation does not block it
                out[n] = answer_of(name, None, self._evaluate(own[name], demand))
        batch = Batch.of(names, out, snap.clock)
        if not given and not own:
            batch.index = dict(zip(names, range(len(names)), strict=True))
            if len(batch.index) == len(names):  # a list naming a node twice is not kept
                self._keep(memo, batch)
        return batch, False, memo

    def _kept(
        self,
        snap: Snapshot,
        names: list[str],
        memo: ShapeMemo,
        demand: PodDemand,
        *,
        survivors: bool,
    ) -> tuple[Batch, bool] | None:
        """A kept batch for `names`, patched up to the snapshot's clock; None when none fits.

        kube-scheduler lists the feasible nodes in the order its parallel filter found them,
        which changes from pod to pod: a batch answers any list of the same nodes, and its
        reply keeps the batch's order (the scheduler reads replies by name, not position).
        """
        key: frozenset[str] | None = None
        for batch in list(memo.batches):
            changed = snap.changed_since(batch.clock)
            if changed is None:  # too far behind to patch
                memo.batches.remove(batch)
                self._recent.pop(batch, None)
                continue
            for name in changed:
                position = batch.index.get(name)
                if position is not None:
                    batch.patch(position, self._answer(snap, name, demand, memo))
            batch.clock = snap.clock
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

    def _keep(self, memo: ShapeMemo, batch: Batch) -> None:
        memo.batches.insert(0, batch)
        for dropped in memo.batches[_BATCHES:]:
            self._recent.pop(dropped, None)
        del memo.batches[_BATCHES:]
        self._recent[batch] = memo
        while len(self._recent) > self.kept_lists:
            oldest, owner = self._recent.popitem(last=False)
            owner.batches.remove(oldest)

    def _use(self, memo: ShapeMemo, batch: Batch) -> Batch:
        self._recent.move_to_end(batch)
        if memo.batches[0] is not batch:
            memo.batches.remove(batch)
            memo.batches.insert(0, batch)
        return batch

    def _answer(self, snap: Snapshot, name: str, demand: PodDemand, memo: ShapeMemo) -> Answer:
        """The node's memoised answer while its signature holds, else a fresh one (memoised)."""
        sig = snap.signatures.get(name)
        answer = memo.nodes.get(name)
        if answer is None or answer.sig is not sig:
            answer = memo.nodes[name] = self._miss(snap, name, sig, demand, memo)
        return answer

    def _miss(
        self, snap: Snapshot, name: str, sig: Signature | None, demand: PodDemand, memo: ShapeMemo
    ) -> Answer:
        """The verdict of the node's state (nodes in equal states share it)."""
        if sig is None:
            return answer_of(name, None, None)
        verdict = memo.states.get(sig[1])
        if verdict is None:
            view = snap.view(name)
            if view is None:
                return answer_of(name, sig, None)
            verdict = memo.states[sig[1]] = self._evaluate(view, demand)
        return answer_of(name, sig, verdict)

    def _evaluate(self, view: NodeView, demand: PodDemand) -> Verdict:
        return evaluate(view, demand, config=self.scoring, model=self.model)

    def reason(
        self,
        snap: Snapshot,
        answer: Answer,
        demand: PodDemand,
        memo: ShapeMemo,
        given: Mapping[str, NodeView],
    ) -> str:
        """The full reason of a failed node (see `answers.DETAILED_NODES`), kept per signature."""
        name = answer.name
        kept = memo.reasons.get(name)
        if kept is not None and kept[0] is answer.sig and answer.sig is not None:
            return kept[1]
        view = snap.view(name) if answer.sig is not None else given.get(name)
        if view is None:
            return unknown_reason(name)
        verdict = self._evaluate(view, demand)
        # An answer from a kept batch may be older than the view: then the summary it carried.
        text = verdict.reason if isinstance(verdict, NoFit) else answer.summary
        if answer.sig is not None:
            memo.reasons[name] = (answer.sig, text)
        return text
