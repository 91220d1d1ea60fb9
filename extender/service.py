"""Filter, prioritize, preempt, bind and diagnose on domain types: each request reads one snapshot.

HTTP-free: `app.py` parses the wire models and calls these methods. A request reads the cluster
state's current `Snapshot` once and answers from it, without the writer lock (a burst of watch
events never holds up filter); only bind takes that lock, to evaluate on fresh state and
reserve as one step. Reservations (filter's holds, bound pods not yet watched, preemption
proposals) live in one store, `cache.reservations`, swept in one pass.

Over 400 lines for a reason: the five verbs, each short, and their logging; the memo, the JSON
pieces, preemption's choice and the reading of objects live in modules of their own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from gpupart import logs
from gpupart.core.api.pods import node_constraint
from gpupart.core.api.provenance import Signer, sign
from gpupart.core.api.wire import ASSIGNMENT_ANNOTATION, PodAssignment, encode_assignment
from gpupart.core.dra.reasons import DraAsk
from gpupart.core.errors import GpupartError, InvalidInput
from gpupart.core.scheduling.demand import (
    PodDemand,
    parse_demand,
    tenant_of,
)
from gpupart.core.scheduling.evaluate import Fit, NoFit, evaluate
from gpupart.core.scheduling.pending import (
    DesiredDynamicGpu,
    Making,
    mig_outlook,
    pending_message,
)
from gpupart.core.scheduling.scoring import FragmentationModel
from gpupart.core.scheduling.shares import fragmentation_model, fragmentation_model_of
from gpupart.core.scheduling.terms import ScoringConfig
from gpupart.core.scheduling.views import NodeView, PlacedPod, assemble_node

from .answers import FAILED, PASSED, Batch
from .cache import ClusterCache
from .drapods import dra_ask, node_reasons, pending_text
from .memo import KEPT_LISTS, Memo
from .metrics import Metrics
from .objects import PodEntry, SignerSource, read_node
from .preemption import NodeVictims, victims_on
from .reservations import Hold
from .snapshot import DraPicture, Snapshot
from .texts import NOT_SELECTED, explain, unknown_reason

log = logging.getLogger(__name__)

_Reply = TypeVar("_Reply")


class Binder(Protocol):
    """The API calls of a bind: read the live pod, then one write, a Binding that also carries
    the pod's new annotations (the API server copies a Binding's annotations onto the pod in
    the same update as its nodeName). `kube.ApiBinder` does it for real, tests pass a fake."""

    def pod(self, namespace: str, name: str) -> Mapping[str, Any]:
        """The pod as the API server has it now; raises when it cannot be read."""
        ...

    def bind(
        self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str]
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class FilterOutcome:
    passed: list[str]
    failed: dict[str, str]
    unresolvable: dict[str, str]
    error: str = ""
    encoded: tuple[str, str, str] | None = None
    """`passed`, `failed` and `unresolvable` as JSON text, joined from memoised pieces."""


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """Every asked node's verdict for one pod, reasons in full (see `ExtenderService.diagnose`)."""

    pod: str
    scores: dict[str, int]
    failed: dict[str, str]
    unresolvable: dict[str, str]
    unreadable: dict[str, str]
    """Objects the watch cache could not read ("Pod ns/name", "Node name") and why."""


@dataclass(frozen=True, slots=True)
class _Model:
    """The fragmentation model, the mix it was made from, and when the mix was last looked at."""

    model: FragmentationModel
    mix: Mapping[Any, int]
    at: float


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
        keys: SignerSource | None = None,
        scheduler_names: Sequence[str] = ("gpupart-scheduler",),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.keys = keys
        """The extender's private key: signs every shared-GPU assignment at bind (None:
        shared-GPU binds are refused)."""
        self.scheduler_names = tuple(scheduler_names)
        """Bind only pods whose spec.schedulerName is one of these."""
        self.scoring = scoring
        self.binder = binder
        self.metrics = metrics
        self.ttl = ttl_seconds
        self.admission_wait = admission_wait_seconds
        self.refresh = refresh_seconds
        self.memo_size = memo_size
        self.kept_lists = kept_lists
        self.clock = clock
        self._model = _Model(fragmentation_model(()), {}, -float("inf"))
        self._memo = Memo(self._model.model, scoring, kept_lists)
        self._memo_lock = threading.Lock()
        """Taken by request paths only (the event loop's, mostly): never by the watch threads."""
        self._last_sweep = -float("inf")
        metrics.observe(lambda: cache.snapshot, cache.wall)

    # -- shared machinery --

    def model(self, now: float) -> FragmentationModel:
        """The policy's model over the observed mix (CPU included), looked at every `refresh`
        seconds; replaced only when the typical pods it yields changed (a new model starts a
        new memo, see `_memo_for`)."""
        held = self._model
        if now - held.at < self.refresh:
            return held.model
        mix = self.cache.snapshot.mix
        model = held.model
        if mix != held.mix:
            fresh = fragmentation_model_of(mix)
            if fresh != model:
                model = fresh
        self._model = _Model(model, mix, now)  # one reference: bind threads read it too
        return model

    def _memo_for(self, model: FragmentationModel) -> Memo:
        """The memo of `model`, under the memo lock; a new one when the model changed or the
        memo outgrew `memo_size` (the only ways anything kept is let go)."""
        memo = self._memo
        if memo.model is not model or memo.size() > self.memo_size:
            memo = self._memo = Memo(model, self.scoring, self.kept_lists)
        return memo

    def _sweep(self, now: float, *, wait: bool) -> None:
        """Expire reservations, at most once a second (`wait=False` on the event loop: skipped
        while a writer holds the cluster state, the next request sweeps)."""
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        self.cache.expire(now, wait=wait)
        self.cache.recheck_assignments(wait=wait)

    def _demand(self, pod: Mapping[str, Any]) -> PodDemand:
        """The pod's demand, its anti-affinity terms' namespaceSelectors resolved against the
        Namespaces the watch cache holds now (a relabel makes another demand: the memo keys on it)."""
        return parse_demand(
            pod,
            anti_affinity_label=self.scoring.anti_affinity_label,
            namespace_labels=self.cache.snapshot.namespaces,
        )

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
        self._sweep(now, wait=False)
        try:
            demand = self._demand(pod)
        except GpupartError as error:
            self.metrics.decisions.labels("filter", "error").inc()
            return FilterOutcome([], {}, {}, explain(error))
        given = _views_from_objects(nodes, self.cache.wall())
        passed: list[str] = []
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        self.cache.expire_mig_reservations(wait=False)
        with self._memo_lock:
            # Read under the memo lock: kept batches only ever move forward to newer snapshots.
            snap = self.cache.snapshot
            own = _own_views(snap, pod, demand)
            memo = self._memo_for(self.model(now))
            batch, _, shape = memo.answers(snap, names, demand, given, own=own)
            given = {**given, **own}
            reasons = {
                position: memo.reason(snap, batch.answers[position], demand, shape, given)
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
        self.cache.reservations.hold(_uid(pod), Hold(pod, demand, now + self.ttl))
        fits = kinds[None] > 0
        self.metrics.decisions.labels("filter", "ok" if fits else "unschedulable").inc()
        if not fits:
            log.info(
                "Filtered out every node",
                extra=logs.kv(pod=demand.pod, nodes=len(names), examples=list(reasons.values())),
            )
        return FilterOutcome(passed, failed, unresolvable, encoded=encoded)

    def prioritize(
        self, pod: Mapping[str, Any], names: Sequence[str], nodes: Iterable[Mapping[str, Any]] = ()
    ) -> list[tuple[str, int]]:
        return self._prioritize(
            pod,
            names,
            nodes,
            lambda batch, passed_only: [
                (a.name, a.score) for a in batch.answers if not passed_only or a.status == PASSED
            ],
        )

    def prioritize_json(
        self, pod: Mapping[str, Any], names: Sequence[str], nodes: Iterable[Mapping[str, Any]] = ()
    ) -> str:
        """`prioritize` as the JSON HostPriorityList, joined from memoised pieces."""
        return self._prioritize(
            pod, names, nodes, lambda batch, passed_only: batch.hosts_json(passed_only=passed_only)
        )

    def _prioritize(
        self,
        pod: Mapping[str, Any],
        names: Sequence[str],
        nodes: Iterable[Mapping[str, Any]],
        reply: Callable[[Batch, bool], _Reply],
    ) -> _Reply:
        now = self.clock()
        demand = self._demand(pod)  # InvalidInput goes to the caller: prioritize has no Error field
        given = _views_from_objects(nodes, self.cache.wall())
        self.cache.expire_mig_reservations(wait=False)
        with self._memo_lock:
            snap = self.cache.snapshot
            own = _own_views(snap, pod, demand)
            memo = self._memo_for(self.model(now))
            batch, passed_only, _ = memo.answers(
                snap, names, demand, given, survivors=True, own=own
            )
            answer = reply(batch, passed_only)
        self.metrics.decisions.labels("prioritize", "ok").inc()
        return answer

    def pending_reason(self, pod: Mapping[str, Any]) -> str:
        """Why `pod`, which kube-scheduler left Unschedulable, fits on no node, over every node
        of the current snapshot, as the text of an Event (docs/adr-019-pending-reasons.md).

        The memoised path filter takes, without its side effects: no hold (the pod was not
        asked by kube-scheduler), no decision counted, no log line. A pod waiting on DRA
        claims gets each node's DRA reason instead (`drapods`).
        """
        dra = self.cache.dra()
        ask = dra_ask(pod, dra)
        if ask is not None:
            return pending_text(pod, ask, self.cache.snapshot, dra)
        try:
            demand = self._demand(pod)
            allowed = node_constraint(pod)
        except GpupartError as error:
            return f"gpupart cannot read this pod: {explain(error)}."
        now = self.clock()
        self.cache.expire_mig_reservations(wait=False)
        fits: list[str] = []
        reasons: Counter[str] = Counter()
        with self._memo_lock:
            snap = self.cache.snapshot
            names = snap.node_names()
            own = _own_views(snap, pod, demand)
            memo = self._memo_for(self.model(now))
            batch, _, shape = memo.answers(snap, names, demand, {}, own=own)
            detailed = {
                position: memo.reason(snap, batch.answers[position], demand, shape, own)
                for *_, position in batch.detailed()
            }
            for position, answer in enumerate(batch.answers):
                state = snap.nodes.get(answer.name)
                if state is not None and not allowed.allows(dict(state.entry.labels), answer.name):
                    # kube-scheduler's own words for them; the GPUs there do not matter.
                    reasons[NOT_SELECTED] += 1
                elif answer.status == PASSED:
                    fits.append(answer.name)
                else:
                    reasons[detailed.get(position, answer.summary)] += 1
        lead = ""
        if demand.request.mig:
            lead = mig_outlook(demand, **_mig_facts(snap, demand.pod, self.cache.wall()))
        return pending_message(lead=lead, nodes=len(names), fits=fits, reasons=reasons)

    def diagnose(self, pod: Mapping[str, Any], names: Sequence[str] = ()) -> Diagnosis:
        """Why the pod fits or not on each node (every watched node when `names` is empty),
        each reason in full: what a person asks when a filter reply gave only a few in full.

        Not on kube-scheduler's path and not memoised: every node of one snapshot is evaluated
        (0.06-1.5 s at 5,000 nodes: every node that fits is scored). InvalidInput (a pod we
        cannot read) goes to the caller. A pod waiting on DRA claims gets each node's DRA
        reason (`drapods`): the nodes where the allocator model finds room are its `Scores`,
        at 0 (the extender does not rank DRA nodes).
        """
        dra = self.cache.dra()
        ask = dra_ask(pod, dra)
        if ask is not None:
            return self._diagnose_dra(pod, ask, self.cache.snapshot, dra, names)
        demand = self._demand(pod)
        model = self.model(self.clock())
        self.cache.expire_mig_reservations(wait=False)
        snap = self.cache.snapshot
        scores: dict[str, int] = {}
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        for name in names or snap.node_names():
            view = snap.view(name)
            if view is None:
                failed[name] = unknown_reason(name)
                continue
            verdict = evaluate(view, demand, config=self.scoring, model=model)
            if isinstance(verdict, Fit):
                scores[name] = verdict.score
            else:
                (unresolvable if verdict.unresolvable else failed)[name] = verdict.reason
        unreadable = {f"{u.kind} {u.name}": u.problem for u in snap.unreadable}
        return Diagnosis(demand.pod, scores, failed, unresolvable, unreadable)

    def _diagnose_dra(
        self,
        pod: Mapping[str, Any],
        ask: DraAsk,
        snap: Snapshot,
        dra: DraPicture,
        names: Sequence[str],
    ) -> Diagnosis:
        if ask.problem:
            raise InvalidInput(ask.pod, ask.problem)
        reasons, _ = node_reasons(pod, ask, snap, dra)
        found = {r.node: r for r in reasons}
        scores: dict[str, int] = {}
        failed: dict[str, str] = {}
        waiting = not ask.wanted and not ask.pinned and "; ".join(ask.notes)
        for name in names or snap.node_names():
            if name not in snap.nodes:
                failed[name] = unknown_reason(name)
            elif waiting:
                failed[name] = f"{name}: {waiting}"  # nothing to allocate yet
            elif name not in found:
                failed[name] = f"{name}: {NOT_SELECTED.removeprefix('node(s) ')}"
            elif found[name].fits:
                scores[name] = 0
            else:
                failed[name] = found[name].text
        unreadable = {f"{u.kind} {u.name}": u.problem for u in snap.unreadable}
        return Diagnosis(ask.pod, scores, failed, {}, unreadable)

    def preempt(
        self, pod: Mapping[str, Any], candidates: Mapping[str, NodeVictims]
    ) -> dict[str, NodeVictims]:
        """Per candidate node of kube-scheduler's preemption, the victims that let the pod fit
        there (`preemption.victims_on`); nodes where none do are left out. The freed GPU is
        proposed to the cluster state: if the pod is nominated to that node, its reservation
        goes there. InvalidInput (a pod we cannot read) goes to the caller.
        """
        now = self.clock()
        self._sweep(now, wait=True)
        demand = self._demand(pod)
        self.metrics.preemptions.inc()
        uid = _uid(pod)
        self.cache.expire_mig_reservations(wait=True)
        snap = self.cache.snapshot
        model = self.model(now)
        kept: dict[str, NodeVictims] = {}
        for node, offered in candidates.items():
            answer, freed = victims_on(
                snap, node, offered, demand, uid, snap.budgets, self.scoring, model
            )
            if freed is not None:
                self.cache.propose(uid, node, freed.gpu, freed.victims, expires=now + self.ttl)
            if answer is None:
                self.metrics.dropped.inc()
            else:
                kept[node] = answer
                self.metrics.victims.inc(len(answer.uids))
        self.metrics.decisions.labels("preempt", "ok" if kept else "unschedulable").inc()
        log.info(
            "Answered preemption",
            extra=logs.kv(
                pod=demand.pod,
                candidates=len(candidates),
                kept={n: list(v.uids) for n, v in list(kept.items())[:3]},
            ),
        )
        return kept

    def bind(self, namespace: str, name: str, uid: str, node: str) -> str:
        """Check the live pod, choose the GPU again on fresh state, reserve it, write the
        signed assignment, bind; "" = done, else why not (a sentence the scheduler logs).

        Nothing in the request is trusted beyond the names it asks about: the pod is read
        from the API server, must be the one filter saw (same UID, same demand), ours
        (`scheduler_names`), unbound and not being deleted; its amounts come from its spec.
        """
        now = self.clock()
        self._sweep(now, wait=True)
        pod_name = f"{namespace}/{name}"
        if not uid:
            return self._refused(pod_name, f"the bind request for pod {pod_name} names no pod UID")
        key = uid
        hold = self.cache.reservations.held(key)
        if hold is None or hold.demand.pod != pod_name:
            return self._refused(
                pod_name,
                f"no filter decision for pod {pod_name} (uid {uid!r}) in the last "
                f"{self.ttl:g}s; the scheduler will retry",
            )
        try:
            live = self.binder.pod(namespace, name)
        except Exception as error:  # noqa: BLE001 - any API failure is reported, never raised
            return self._refused(
                pod_name,
                f"cannot read pod {pod_name} to check it before binding: {explain(error)}; "
                "the scheduler will retry",
            )
        problem = self._unbindable(live, pod_name, uid)
        if problem:
            return self._refused(pod_name, problem)
        try:
            demand = self._demand(live)
        except GpupartError as error:
            return self._refused(pod_name, f"pod {pod_name} cannot be read: {explain(error)}")
        if _amounts(demand) != _amounts(hold.demand):
            return self._refused(
                pod_name,
                f"pod {pod_name} asks for {_amounts_text(demand)}, but the filter call was "
                f"for {_amounts_text(hold.demand)}; not bound, the scheduler will retry",
            )
        keys = None
        if demand.request.shared:
            keys, problem = self._signing_keys(pod_name)
            if problem:
                return self._refused(pod_name, problem)
        model = self.model(now)
        with self.cache.lock():  # no change lands between this evaluation and the reservation
            if demand.request.shared:
                waiting = self._await_admission(node, demand.pod)
                if waiting:
                    self.metrics.decisions.labels("bind", "error").inc()
                    return waiting
            # A pod nominated here after preemption is not kept out by its own reservation.
            # Its victims still count until they are gone: bind never over-commits a GPU (filter
            # passes without them, so a victim slow to go is a bind retry, not a new preemption).
            # MIG reservations count as in filter (`evaluate` frees the pod's own only), on
            # the freshest state: a bind for one pod cannot take an instance held for another.
            self.cache.expire_mig_reservations(wait=True)
            view = self.cache.snapshot.view_excluding(node, [key])
            if view is None:
                self.metrics.decisions.labels("bind", "error").inc()
                return f"node {node} is not known to the gpupart extender"
            verdict = evaluate(view, demand, config=self.scoring, model=model)
            if isinstance(verdict, NoFit):
                self.metrics.decisions.labels("bind", "error").inc()
                return f"node changed since filter: {verdict.reason}"
            assignment = None
            if verdict.gpu is not None:
                assert keys is not None  # a GPU is chosen for shared-GPU pods only
                gpu = next(g for g in view.gpus if g.index == verdict.gpu)
                assignment = sign(
                    PodAssignment(
                        node,
                        gpu.index,
                        gpu.uuid,
                        demand.request.memory_mib,
                        demand.request.compute_percent,
                        pod_uid=uid,
                    ),
                    keys,
                )
            placed = PlacedPod(
                tenant_of(live, demand.request), demand.request, assignment, demand.cpu_milli
            )
            entry = PodEntry(key, demand.pod, node, placed, awaiting=assignment is not None)
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
                extra=logs.kv(pod=demand.pod, node=node, err=explain(error)),
            )
            return f"binding {demand.pod} to {node} failed: {explain(error)}"
        self.cache.reservations.release_hold(key)
        self.metrics.decisions.labels("bind", "ok").inc()
        log.info(
            "Bound pod",
            extra=logs.kv(
                pod=demand.pod,
                node=node,
                gpu="" if assignment is None else assignment.gpu,
                score=verdict.score,
            ),
        )
        return ""

    def _refused(self, pod: str, reason: str) -> str:
        self.metrics.decisions.labels("bind", "error").inc()
        log.info("Refused to bind pod", extra=logs.kv(pod=pod, reason=reason))
        return reason

    def _unbindable(self, live: Mapping[str, Any], pod: str, uid: str) -> str:
        """Why the live pod must not be bound by this extender ("" when it may)."""
        meta = live.get("metadata")
        spec = live.get("spec")
        status = live.get("status")
        if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
            return f"pod {pod} as read from the API server has no metadata or spec; not bound"
        live_uid = meta.get("uid")
        if live_uid != uid:
            return (
                f"pod {pod} now has UID {live_uid!r}, not {uid!r} as in the bind request (it was "
                "replaced under the same name); not bound"
            )
        scheduler = spec.get("schedulerName") or "default-scheduler"
        if scheduler not in self.scheduler_names:
            return (
                f"pod {pod} is for scheduler {scheduler!r}; this extender binds only pods of "
                f"{', '.join(repr(n) for n in self.scheduler_names)} (setting scheduler_names)"
            )
        if spec.get("nodeName"):
            return f"pod {pod} is already bound to node {spec.get('nodeName')!r}; not bound again"
        if meta.get("deletionTimestamp") is not None:
            return f"pod {pod} is being deleted; not bound"
        phase = status.get("phase") if isinstance(status, Mapping) else None
        if phase not in (None, "", "Pending"):
            return f"pod {pod} is {phase}, not Pending; not bound"
        return ""

    def _signing_keys(self, pod: str) -> tuple[Signer | None, str]:
        """The private key that signs the pod's assignment, or why there is none (then no
        bind: the node agent serves only signed assignments)."""
        if self.keys is None:
            return None, (
                f"shared-GPU pod {pod} not bound: no assignment key is configured (setting "
                "assignment_key_file, GPUPART_EXTENDER_ASSIGNMENT_KEY_FILE), and node agents "
                "serve only assignments signed with it"
            )
        try:
            return self.keys(), ""
        except InvalidInput as error:
            return None, (
                f"shared-GPU pod {pod} not bound: {error} (setting assignment_key_file); node "
                "agents serve only assignments signed with it"
            )

    def _await_admission(self, node: str, pod: str) -> str:
        """Wait (under the writer lock) until no other shared-GPU pod awaits admission on `node`.

        The kubelet's Allocate names no pod, so a node whose device plugin pairs by the one
        awaiting pod (`serial_admission`) gets the next shared pod only once the plugin has
        recorded what it gave the last one (docs/adr-001-shared-gpu-admission.md). Returns ""
        when the node is free, else the reason, after at most `admission_wait` seconds (kept
        below kube-scheduler's httpTimeout, which then retries the pod). The wait releases
        the lock: the watch publishes the record meanwhile.
        """
        deadline = time.monotonic() + self.admission_wait
        while (snap := self.cache.snapshot).serial_admission(node):
            others = [p for p in snap.awaiting(node) if p != pod]
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


def _amounts(demand: PodDemand) -> tuple[object, ...]:
    """What a pod asks a node for: its GPU request, CPU and priority (all from its spec)."""
    return (demand.request, demand.cpu_milli, demand.priority)


def _amounts_text(demand: PodDemand) -> str:
    r = demand.request
    parts = []
    if r.shared:
        parts.append(f"{r.shared} shared-GPU slot(s), {r.memory_mib} MiB, {r.compute_percent} %")
    if r.whole_gpus:
        parts.append(f"{r.whole_gpus} whole GPU(s)")
    parts.extend(f"{count} {profile} slice(s)" for profile, count in r.mig)
    parts.append(f"{demand.cpu_milli}m CPU, priority {demand.priority}")
    return "; ".join(parts)


def _uid(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    uid = meta.get("uid")
    if uid:
        return str(uid)
    return f"{meta.get('namespace') or 'default'}/{meta.get('name') or '?'}"


def _own_views(snap: Snapshot, pod: Mapping[str, Any], demand: PodDemand) -> dict[str, NodeView]:
    """The nodes where the pod holds a reservation, viewed as it sees them: the node it is
    nominated to without its nomination, and those whose MIG plan reserves it an instance (their
    verdict for it is its own: `evaluate` frees its reserved instances, for it only)."""
    own = {}
    for node in snap.reserved_for(demand.pod):
        view = snap.view(node)
        if view is not None:
            own[node] = view
    uid = _uid(pod)
    held = snap.nomination(uid)
    if held is None:
        return own
    # Its victims there are on their way out: filter and prioritize count them gone, so a
    # watch that shows them deleted a little later than kube-scheduler's does not make it
    # preempt again elsewhere (bind still counts them until they are gone).
    view = snap.view_excluding(held.node, [uid, *snap.evicted_for(uid, held.node)])
    if view is not None:
        own[held.node] = view
    return own


def _mig_facts(snap: Snapshot, pod: str, now: float) -> dict[str, Any]:
    """What `mig_outlook` needs from the Nodes: the profiles some node offers, the instances
    planned for `pod` not made yet (live reservations only), and the dynamic-MIG GPUs."""
    offered: set[str] = set()
    making: list[Making] = []
    dynamic: list[DesiredDynamicGpu] = []
    for name in snap.node_names():
        state = snap.nodes[name]
        inventory = state.entry.inventory or ()
        for gpu in state.view.gpus:
            offered.update(gpu.mig_profiles)
        made = {(g.index, d.instance) for g in inventory for d in g.mig_devices}
        for r in state.entry.reservations:
            if r.pod == pod and r.expires > now and (r.gpu, r.instance) not in made:
                making.append(Making(name, r.gpu, r.instance))
        products = {g.index: g.product for g in inventory}
        for index, partition in state.entry.dynamic:
            dynamic.append(DesiredDynamicGpu(name, index, products.get(index, ""), partition))
    return {"offered": offered, "making": making, "dynamic": dynamic}


def _views_from_objects(nodes: Iterable[Mapping[str, Any]], now: float) -> dict[str, NodeView]:
    """Views of nodes the scheduler sent in full (nodeCacheCapable false) that the cache lacks.

    No pods are known for them, so they are trusted only as far as their inventory goes (and
    their allocatable CPU counts as all free); their MIG plan's reservations count until
    `now` passes their expiry.
    """
    views = {}
    for node in nodes:
        name = str((node.get("metadata") or {}).get("name") or "")
        if name:
            entry = read_node(node)
            views[name] = assemble_node(
                name,
                entry.inventory,
                (),
                cpu_milli=entry.cpu_milli,
                problem=entry.problem,
                reservations=[r for r in entry.reservations if r.expires > now],
                plan_problem=entry.plan_problem,
            )
    return views
