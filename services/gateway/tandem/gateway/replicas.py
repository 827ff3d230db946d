"""The decoder replicas the gateway balances its callers over, and which of them serve: each watched once.

NOTE: why the gateway watches for its callers. Each HTTP caller reaches the decoder over a channel of
its own (`callers.py`). With gRPC's client-side health checking each of those channels held a health
Watch stream on every replica, all from the gateway's one address: 576 at its defaults, more with
--max-connections, past the share of Watch streams a server gives one address
(`tandem.common.health`). So the gateway watches each replica once here, and each caller's channel is
opened over the replicas that serve now (round_robin, watching nothing itself); when that set
changes, channels over an older one take no new calls (`callers.py`).

What the watch is for: a replica that listens but does not serve, loading or with its engine failed,
answers every Generate UNAVAILABLE at once. Without it, each caller's channel would send its share
of first attempts there, each retried on the next replica after a backoff, until the channel's retry
throttling or a Generate over gRPC's 256 KiB retry buffer (a picture's rows) failed the caller. What
gRPC still does in each caller's channel: a replica killed or draining closes its connections and
its listener (a drain sends GOAWAY), so round_robin skips it as soon as the connection fails, and a
Generate no server took is retried on the next replica (`tandem.client.channel`).

What the gateway serves is one model: each replica is asked its model (`model_of`) as it turns SERVING,
and one serving another model than most replicas do (ties: the model served so far) gets no calls,
logged and named in /health, as though it did not serve. Each watched replica counts for the model it
said last, serving or not (see the NOTE on restarts below). Another model is another name, or the same
name over another checkpoint (its token table or weight samples differ: `replica_model.py`). Each
replica left out is logged at ERROR as it is left out, naming it and both models, whether it came with
another model or most replicas moved to another (those left behind), and again only where it is
left out with another model than it was logged with (a flapping replica was logged at every flap); a
gauge counts them (`replica_metrics.py`), and /health names them beside the counts serving and watched.
Mixed replicas silently answered one model's name with two models' tokens; after a rolling upgrade to
another model, the gateway kept the first model's name until it restarted.

NOTE: a replica whose model cannot be asked (its GetModelInfo refused or unanswered) is asked again
every MIN_RETRY_S, doubling up to MAX_RETRY_S, for as long as it serves: asked once, one failed ask
after a restart left the replica counting for the model it said before the restart, for good (a
2-replica upgrade X -> Y whose second replica's ask failed once stayed on X, the first replica, on Y,
left out, and calls went to the second, on Y, under X's name). Until it answers, a replica that never
said a model gets calls (an older or refusing decoder: not checked, as before), and one that said a
model before gets none (it may serve another since its restart) but still counts for the model it said
last: counted for nothing, a failed ask of the gateway's model's replica in a 1-vs-1 pair would hand
the gateway the other's model, the restart case below. That wait is bounded: a refusal that is the
deployment's configuration (UNAUTHENTICATED, PERMISSION_DENIED, UNIMPLEMENTED: a token rotated past the
gateway's, an older decoder), or asks failing for UNCHECKED_AFTER_S, make the replica not checked again,
logged at ERROR: it gets calls, and /health lists it (`model_unknown`), but still counts for the model
it said last (forgetting it handed a 1-vs-1 pair's gateway to the left-out replica's model for good).
Held back for good, every replica of a token rotation served its model and the gateway answered 503 for
good, where before the recheck they had served unchecked.

Where no replica serves the gateway's model (all loading or restarting), the gateway answers 503
itself (`targets` is empty: `callers.py`), as a vLLM/SGLang router answers for a model with no worker
up. Balanced over the replicas not left out, callers reached a replica back on another model whose
model was still being asked, or whose watch was in its backoff (for ~0.5 s of each rolling upgrade's
restart). Before any replica said a model (at start, or replicas not asked), callers are balanced over
every watched replica. The gateway's decoder calls wait for one to serve: while none does, each is the
gateway's own 503 at once (`Gateway._check_serving`, saying `none_serving`: a `dns:` name that does not
resolve yet is said so), where a blackhole held a completion 5.4 s. The encoder's calls go to its
replicas, which answer themselves (loading: UNAVAILABLE, a 503); before its `dns:` name resolves, to the
name itself, as gRPC resolves it.

NOTE: why a replica restarting keeps counting for its model. Counted only while it served, the one
replica of the gateway's model of a 1-vs-1 pair handed the gateway the other's model as it restarted
(the other was the majority for those seconds, and ties then kept it): every call went to the replica
that had been left out, its model's tokens under its name, and the restarted replica was left out in
turn, for good. A router in front of vLLM or SGLang sends a request for a model to the workers of that
model only, and answers 503 while none is up: a restart never hands one model's traffic to another.
So a replica that stops serving still counts for the model it said last, until it says another (asked
as it serves again) or is no longer watched (a `dns:` name that no longer resolves to it); one whose
model could not be asked keeps counting for the one it said before. The gateway's model moves only
when most replicas say another: a rolling upgrade moves it as the replica that makes the new model the
majority serves it. The cost: with 2 replicas, while the second of an upgrade restarts (the first
serving the new model, left out on the tie), no replica serves the gateway's model and callers get
503s, as they would from a router; and a replica of the gateway's model stopped for good (or several:
two of three replicas restarted on a bad release that then crashed hold the gateway on the release's
model, the third, serving the old one, left out) keeps it until the gateway restarts or the address
list (a `dns:` name's answer) leaves the replica out. Not counting replicas down for some seconds would
end that, and hand a 1-vs-1 pair's model to the other side during any restart longer than them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import grpc

from tandem.gateway.replica_addresses import name_of, resolve_name, static_replicas
from tandem.gateway.replica_differences import how_moved, unlike
from tandem.gateway.replica_health import MAX_RETRY_S, MIN_RETRY_S, watch_health
from tandem.gateway.replica_model import ReplicaModel, choose_model

log = logging.getLogger(__name__)

RESOLVE_INTERVAL_S = 5.0  # a dns: name is looked up again this often: replicas come and go
# Asks of a replica's model failing this long (a replica that said one before) make it not checked (NOTE):
# past a restart's load and a busy replica's answer, well within a deployer's patience for a 503.
UNCHECKED_AFTER_S = 15.0
# GetModelInfo refusals that no retry changes: the deployment's (a token not taken, an older service).
CONFIGURATION_REFUSALS = frozenset(
    {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED}
)


class Replicas:
    """The decoder's replicas (`address`: one, several, or a `dns:` name) and which of them serve for
    `service`, each watched once over a channel of its own; event-loop thread only. The encoder's too
    (`encoders.py`, over several or a `dns:` name), as `kind` says. Raises ValueError for an address
    it cannot use (`static_replicas`, `name_of`)."""

    def __init__(
        self,
        address: str,
        open_channel: Callable[[str], grpc.aio.Channel],
        service: str,
        on_change: Callable[[], None] = lambda: None,
        model_of: Callable[[grpc.aio.Channel], Awaitable[ReplicaModel]] | None = None,
        kind: str = "decoder",
    ) -> None:
        self.address = address
        self.kind = kind  # what the replicas are ("decoder", "encoder"), as the log lines name them
        self._open_channel = open_channel  # a plain channel to one replica ("ip:port")
        self.service = service
        self.on_change = on_change  # called when `targets` changes
        self._static = static_replicas(address)
        self._name = None if self._static is not None else name_of(address)
        self._is_serving: dict[str, bool] = {}  # by replica, in the order found; False until known
        self._model_of = model_of  # a replica's model, asked over its channel; None: not asked
        self._channels: dict[str, grpc.aio.Channel] = {}  # each watched replica's own channel
        self._asking: dict[str, asyncio.Task[None]] = {}  # a model asked of a replica turned SERVING
        # Each serving replica's model as it said (None: unknown).
        self._models: dict[str, ReplicaModel | None] = {}
        # The model each watched replica said last, serving or not: what it counts for (see the NOTE).
        self._said: dict[str, ReplicaModel] = {}
        # Serving replicas whose asks were given up on (not checked: they get calls), each still
        # counting for the model it said last: forgotten, a refused ask of the gateway's model's replica
        # in a 1-vs-1 pair handed the gateway the left-out one's model, for good (its vote a tie after).
        self._unchecked: set[str] = set()
        self._model: ReplicaModel | None = None  # the one most replicas said (ties: the one so far)
        # The serving replicas of another model at the last `_update`.
        # Replaced whole, never changed: the metrics' export thread reads its length.
        self._left_out: frozenset[str] = frozenset()
        # Each replica logged as left out, with the model it was logged with: logged again only for
        # another model (a flapping replica leaves `_left_out` and comes back at each flap).
        self._logged: dict[str, ReplicaModel] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._resolver: asyncio.Task[None] | None = None
        self._resolve_error: str | None = None  # why a `dns:` name's last look-up failed (None: it did not)
        # What each caller's channel balances over now; empty: none serves the gateway's model (503).
        self.targets: tuple[str, ...] = (address,)

    def start(self) -> None:
        """Starts finding and watching the replicas (on the running event loop)."""
        if self._static is not None:
            self._found(self._static)
        else:
            self._resolver = self._task(self._resolve_forever())

    @property
    def serving(self) -> tuple[str, ...]:
        """The replicas that serve the gateway's model (`model`), or whose model is not known and was
        never said or is not checked (see the NOTE on asking again)."""
        return tuple(
            replica for replica, is_serving in self._is_serving.items() if is_serving and self._fits(replica)
        )

    @property
    def called(self) -> tuple[str, ...]:
        """The replicas that serve and get calls (`targets` that serve): what /health counts. Before any
        replica said a model, those are every serving one, their model still being asked."""
        return tuple(replica for replica in self.targets if self._is_serving.get(replica))

    @property
    def model_unknown(self) -> tuple[str, ...]:
        """The serving replicas whose model is not known: being asked, or not answering (not checked,
        or held back a while where it said one before: see the NOTE on asking again)."""
        if self._model_of is None:
            return ()
        serving = [replica for replica, is_serving in self._is_serving.items() if is_serving]
        return tuple(replica for replica in serving if self._models.get(replica) is None)

    def none_serving(self) -> str:
        """What the gateway's 503 says where no replica serves: none said a model yet (a `dns:` name not
        resolving is said so), or none serves the gateway's model (`targets` empty)."""
        if self._name is not None and not self._is_serving:
            why = f": {self._resolve_error}" if self._resolve_error is not None else ""
            return f"no {self.kind} replica serves now: {self.address} does not resolve (yet){why}; retry"
        if self._model is None:
            return (
                f"no {self.kind} replica serves now: none of the {self.num_watched} watched ({self.address}) "
                "says it serves (loading, stopped, or not answering); retry"
            )
        unknown = self.model_unknown
        if unknown:
            return (
                f"no {self.kind} replica serves model {self.model!r} now: {len(unknown)} serve, but their "
                "model could not be checked yet (asked again); retry"
            )
        return f"no {self.kind} replica serves model {self.model!r} now; retry"

    @property
    def model(self) -> str | None:
        """The name of the model the gateway serves: the one most replicas said (serving or not)."""
        return self._model.name if self._model is not None else None

    @property
    def mismatched(self) -> dict[str, str]:
        """Replicas that serve, another model than `model` (another name, or another checkpoint under
        its name): the name each one serves its model under."""
        return {
            replica: model.name
            for replica, model in self._models.items()
            if model is not None and not self._is_ours(model) and self._is_serving.get(replica)
        }

    @property
    def differences(self) -> dict[str, str]:
        """`mismatched`'s replicas: what tells each one's model from the gateway's
        (`ReplicaModel.difference`: "model", "token_table_sample" or "weight_samples")."""
        ours = self._model
        return {
            replica: difference
            for replica in self.mismatched
            if ours is not None
            and (model := self._models.get(replica)) is not None
            and (difference := model.difference(ours)) is not None
        }

    @property
    def num_left_out(self) -> int:
        """How many serving replicas get no calls for their model (read from any thread)."""
        return len(self._left_out)

    @property
    def num_watched(self) -> int:
        """How many replicas are watched: found, serving or not."""
        return len(self._is_serving)

    def _is_ours(self, model: ReplicaModel) -> bool:
        return self._model is not None and model.is_same(self._model)

    def _fits(self, replica: str) -> bool:
        if self._model_of is None:
            return True
        if replica not in self._models:  # turned SERVING, its model being asked: a moment
            return False
        model = self._models[replica]
        if model is None:  # not answered (asked again): calls where it never said a model or is not checked
            return replica not in self._said or replica in self._unchecked
        return self._is_ours(model)

    async def close(self) -> None:
        tasks = [
            *self._watchers.values(),
            *self._asking.values(),
            *([self._resolver] if self._resolver is not None else []),
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._watchers.clear()

    def _task(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """`coroutine` run as a task whose failure is logged: nobody awaits it until `close`, and a
        resolver or watcher that died unseen left the callers balanced over replicas nobody watched."""
        task = asyncio.ensure_future(coroutine)
        task.add_done_callback(self._log_failure)
        return task

    def _log_failure(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("watching the %s replicas of %s failed", self.kind, self.address, exc_info=error)

    async def _resolve_forever(self) -> None:
        assert self._name is not None  # set wherever the address is not a list
        while True:
            try:
                found = await resolve_name(self._name)
            except (OSError, ValueError) as error:  # the last replicas found stay
                self._resolve_error = str(error)
                log.warning("%s address %s does not resolve: %s", self.kind, self.address, error)
            else:
                self._resolve_error = None
                if found:
                    self._found(found)
            await asyncio.sleep(RESOLVE_INTERVAL_S)

    def _found(self, replicas: tuple[str, ...]) -> None:
        for gone in set(self._watchers) - set(replicas):
            self._watchers.pop(gone).cancel()
            del self._is_serving[gone]
            self._forget_model(gone)
            self._said.pop(gone, None)
            self._logged.pop(gone, None)
        for replica in replicas:
            if replica not in self._watchers:
                self._is_serving[replica] = False
                self._watchers[replica] = self._task(self._watch(replica))
        self._update()

    def _set(self, replica: str, is_serving: bool) -> None:
        if self._is_serving.get(replica, is_serving) != is_serving:
            self._is_serving[replica] = is_serving
            # Said once a change: a replica stopped, draining or back is what an operator looks for.
            log.info("%s replica %s %s", self.kind, replica, "serves" if is_serving else "does not serve")
            if is_serving and self._model_of is not None and replica in self._channels:
                self._asking[replica] = self._task(self._ask_model(replica, self._channels[replica]))
            elif not is_serving:  # asked again when it serves: a replica restarted may serve another
                self._forget_model(replica)
            self._update()

    def _forget_model(self, replica: str) -> None:
        if (asking := self._asking.pop(replica, None)) is not None:
            asking.cancel()
        self._models.pop(replica, None)
        self._unchecked.discard(replica)

    async def _ask_model(self, replica: str, channel: grpc.aio.Channel) -> None:
        """`replica`'s model, asked until it answers (cancelled when it stops serving: `_set`)."""
        assert self._model_of is not None  # asked only then
        retry_s = MIN_RETRY_S
        failing_since: float | None = None
        while True:
            try:
                model = await self._model_of(channel)
                break
            except grpc.aio.AioRpcError as error:
                failing_since = time.monotonic() if failing_since is None else failing_since
                self._ask_failed(replica, error, time.monotonic() - failing_since)
            await asyncio.sleep(retry_s)
            retry_s = min(2 * retry_s, MAX_RETRY_S)
        self._asking.pop(replica, None)
        self._models[replica] = model
        self._said[replica] = model
        self._unchecked.discard(replica)
        self._update()

    def _ask_failed(self, replica: str, error: grpc.aio.AioRpcError, failing_s: float) -> None:
        """`replica`'s model ask failed, its asks failing for `failing_s`: said once per run of failures,
        and once more, at ERROR, where it makes the replica not checked (see the NOTE on asking again)."""
        gives_up = error.code() in CONFIGURATION_REFUSALS or failing_s >= UNCHECKED_AFTER_S
        if (
            gives_up
            and replica not in self._unchecked
            and (replica in self._said or replica not in self._models)
        ):
            self._unchecked.add(replica)
            counted = self._said.get(replica)
            why = "refused" if error.code() in CONFIGURATION_REFUSALS else f"failing for {failing_s:.0f} s"
            log.error(
                "%s replica %s: its model could not be asked (%s, %s): it gets calls, not checked%s; "
                "asked again until it answers (every %g s at most)",
                self.kind,
                replica,
                error.code(),
                why,
                f" (it still counts for the model it said before, {counted.name!r})" if counted else "",
                MAX_RETRY_S,
            )
        elif replica not in self._models:  # said once per run of failures
            how = (
                "gets calls, not checked"
                if self._fits(replica) or replica not in self._said
                else "gets no calls"
            )
            log.warning(
                "%s replica %s: its model could not be asked (%s): asked again; meanwhile it %s",
                self.kind,
                replica,
                error.code(),
                how,
            )
        else:
            return
        self._models[replica] = None
        self._update()

    def _unlike_ours(self, replica: str, model: ReplicaModel) -> str:
        """How `replica`'s `model` differs from the gateway's, naming a replica that serves the latter."""
        assert self._model is not None  # `model` is not ours, so there is one
        ours = [r for r, m in self._models.items() if r != replica and m is not None and self._is_ours(m)]
        return unlike(model, self._model, ours)

    def _choose_model(self) -> None:
        """`model`: the one most watched replicas said last; on a tie the one served so far stays."""
        said = [self._said[replica] for replica in self._is_serving if replica in self._said]
        chosen = choose_model(said, self._model)
        if self._model is not None and chosen is not None and not chosen.is_same(self._model):
            log.warning(  # each replica left behind is logged at ERROR by `_update`
                "the %s replicas now serve model %r%s, not %r",
                self.kind,
                chosen.name,
                how_moved(chosen, self._model),
                self._model.name,
            )
        self._model = chosen

    def _update(self) -> None:
        self._choose_model()
        mismatched = self.mismatched
        for replica in mismatched:
            model = self._models.get(replica)
            logged = self._logged.get(replica)
            if model is not None and (logged is None or not logged.is_same(model)):
                log.error(
                    "%s replica %s %s: it gets no calls",
                    self.kind,
                    replica,
                    self._unlike_ours(replica, model),
                )
                self._logged[replica] = model
        for replica in [r for r, m in self._logged.items() if self._is_ours(m)]:
            del self._logged[replica]  # its model is the gateway's now: another move is news
        self._left_out = frozenset(mismatched)
        # None serving the gateway's model: none (the gateway answers 503), once any replica said one.
        targets = self.serving
        if not targets and not self._said:
            targets = tuple(self._is_serving) or (self.address,)
        if targets != self.targets:
            self.targets = targets
            self.on_change()

    async def _watch(self, replica: str) -> None:
        channel = self._open_channel(replica)
        self._channels[replica] = channel
        try:
            await watch_health(
                channel,
                self.service,
                on_status=lambda is_serving: self._set(replica, is_serving),
                late=lambda: self._late_check(replica),
                spawn=self._task,
            )
        finally:
            if self._channels.get(replica) is channel:
                del self._channels[replica]
            await channel.close()

    def _late_check(self, replica: str) -> bool | None:
        """What a Check of `replica` unanswered in CHECK_TIMEOUT_S, its Watch open, counts for: not
        serving where another replica serves, else not known (its last status kept).

        NOTE: why a late Check leaves the only serving replica in. A late answer is a process stopped
        or a loop held (a decoder busy loading a LoRA, a long prefill on few cores): the Check cannot
        tell them apart. Where another replica serves, calls go there instead of hanging. Where none
        does, taking it out only turned calls that would have been answered late into 503s (a decoder
        frozen 3.5 s of every 4.5 s: 70 of 70 completions answered before the watch, 20 after, 50 of
        them 503). A stopped one is told from a held one by ping: its Watch's connection, pinged every
        2 s (`replica_channel.py`), closes within 5 s, while gRPC's threads answer a held loop's pings.
        Definite states take it out at once: NOT_SERVING, a Watch that ends or fails (a killed or
        stopped process, a drain's GOAWAY), a connection that fails or never sends SETTINGS
        (`watch_health`)."""
        others = (other for other, is_serving in self._is_serving.items() if is_serving and other != replica)
        return False if any(self._fits(other) for other in others) else None
