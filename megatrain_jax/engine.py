"""The streaming engine: host-resident state, one compiled layer template, prefetch and offload.

One training step, for a model of L layers split into `micro_batches` M:

    forward   embed ─► layer 0 ─► … ─► layer L-1 ─► head + loss (value and gradient)
              while layer i computes, layers i+1 … i+depth are already travelling H2D
    backward  layer L-1 … 0: recompute from the saved input, VJP, gradient D2H at once
    update    exact global norm ─► clip scale ─► per-part optimizer update of host state

The update has two homes. With a `HostAdamW` optimizer it runs on a host thread, in place on
the pinned buffers, part by part in streaming order, while the GPU already runs the next
step: the next forward waits for a part's update only when it fetches that part. With any
other Optax transformation it runs as one compiled program per part that streams the state
through the device, at the end of the step.

Every layer visit applies one weight load to all M micro-batches (a scan inside the
compiled template), so weight traffic is per step, not per micro-batch. The templates are
compiled once whatever L is: layers differ only in the arrays passed in.

    engine = StreamEngine(templates, optimizer, clip_norm=1.0)
    state = engine.init_state(init_embed, init_layer, init_head, num_layers)
    state, metrics = engine.train_step(state, batch)

With `resident_layers=K`, the first K layers' parameters and optimizer state live in GPU
memory instead, for the whole run: they are never fetched, their gradients never leave the
GPU, and they are updated there (any Optax transformation, in place by donation) right after
the backward, while the host updates the rest. It trades GPU memory (16 bytes per parameter
with AdamW, with the gradient) for host traffic, where the GPU has memory to spare.

The engine updates host state in place (or donates it): after `train_step`, only the
returned state is valid, and its host update may still be running: `state.wait()` waits
for it (the next `train_step` waits by itself). Metrics are device scalars; reading them
waits for the step.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import optax

from megatrain_jax import host_store, optim
from megatrain_jax.host_optim import HostAdamW
from megatrain_jax.host_store import Placement


@dataclasses.dataclass(frozen=True)
class Templates:
    """What the engine streams: pure functions over per-part pytrees.

    embed(embed_params, batch) -> x
    layer(layer_params, x, batch) -> x           (x keeps its shape and dtype)
    head_loss(head_params, embed_params_or_None, x, batch, denom) -> scalar loss
    `batch` is one micro-batch (a dict of [b, S, ...] arrays). With `tied`, the head also
    receives the embedding parameters and the gradient of both reaches the embedding.
    `normalizer(batch) -> denom` sees the whole batch; the default is the sum of its mask.
    """

    embed: Callable
    layer: Callable
    head_loss: Callable
    tied: bool = False
    normalizer: Callable | None = None


class StreamState:
    """Host-resident training state: parameters and Optax state, part by part.

    `params` and `opt_state` are {"embed": pytree, "layers": [pytree] * L, "head": pytree}.
    After a step with the host optimizer, their update may still be running: reading
    `params` or `opt_state` waits for it, so a reader never sees a half-updated model.
    """

    def __init__(self, params: dict, opt_state: dict, step: int = 0,
                 pending: "_PendingUpdate | None" = None):
        self._params, self._opt_state, self.step, self.pending = params, opt_state, step, pending

    @property
    def params(self) -> dict:
        return self.wait()._params

    @property
    def opt_state(self) -> dict:
        return self.wait()._opt_state

    def wait(self) -> "StreamState":
        """Waits until the last step's host update has written params and opt_state."""
        if self.pending is not None:
            self.pending.wait()
        return self

    def __repr__(self) -> str:
        return f"StreamState(step={self.step}, layers={len(self._params['layers'])})"


class _PendingUpdate:
    """A step's host-side update, running part by part (streaming order) on a thread."""

    def __init__(self, work: list[Callable[[], None]], names: list[str], timeline=None):
        self.done = [threading.Event() for _ in work]
        self.error: BaseException | None = None
        self.names, self.timeline = names, timeline
        self.started = self.finished = time.perf_counter()
        self.spans: list[tuple[str, float, float]] = []  # (part, start, end) as they ran
        self.thread = threading.Thread(target=self._run, args=(work,), daemon=True,
                                       name="megatrain-host-update")
        self.thread.start()

    def _run(self, work) -> None:
        self.started = time.perf_counter()
        for k, (fn, done) in enumerate(zip(work, self.done)):
            start = time.perf_counter()
            try:
                if self.error is None:
                    fn()
            except BaseException as e:  # surfaced in the caller's thread by wait()
                self.error = e
            finally:
                self.finished = time.perf_counter()
                self.spans.append((self.names[k], start, self.finished))
                if self.timeline is not None:
                    self.timeline.span("host update", self.names[k], start, self.finished)
                done.set()

    @property
    def seconds(self) -> float:
        return self.finished - self.started

    def written(self, part: int) -> bool:
        """Whether part `part` (0 embed, 1..L layers, L+1 head) is written, without waiting."""
        return self.done[part].is_set()

    def wait(self, part: int = -1) -> None:
        """Waits for part `part` (0 embed, 1..L layers, L+1 head; -1 all)."""
        self.done[part].wait()
        if self.error is not None:
            raise RuntimeError("the host optimizer update failed") from self.error


def _prefetched(items: Iterable, fetch: Callable, depth: int,
                available: Callable[[object], bool] | None = None) -> Iterator:
    """Yields fetch(item) in order, having issued the next `depth` fetches before each yield.

    The caller's compute on the yielded value is dispatched after the later transfers are
    queued, which is the order in which transfers and compute overlap fully. When
    `available(item)` is false, fetching the item would block (its host update still runs):
    the fetches already issued are yielded first, so their compute is queued before the wait.
    """
    pending = collections.deque()
    for item in items:
        if available is not None and not available(item):
            while pending:
                yield pending.popleft()
        pending.append(fetch(item))
        if len(pending) > depth:
            yield pending.popleft()
    while pending:
        yield pending.popleft()


class StreamEngine:
    def __init__(self, templates: Templates,
                 optimizer: optax.GradientTransformation | HostAdamW, *,
                 clip_norm: float = 1.0, prefetch_depth: int = 2,
                 saved_inputs: str = "device", micro_batches: int = 1,
                 learning_rate: Callable | None = None, device: jax.Device | None = None,
                 resident_layers: int = 0):
        if saved_inputs not in ("device", "pinned_host"):
            raise ValueError(
                f"saved_inputs must be 'device' or 'pinned_host', got {saved_inputs!r}"
            )
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
        if resident_layers < 0:
            raise ValueError(f"resident_layers must be >= 0, got {resident_layers}")
        self.t = templates
        # A HostAdamW updates in place on the host; any other transformation on the device.
        self.host_opt = optimizer if isinstance(optimizer, HostAdamW) else None
        self.opt = optimizer.optax if self.host_opt else optimizer
        self.clip_norm = clip_norm
        self.depth = prefetch_depth
        self.offload_inputs = saved_inputs == "pinned_host"
        self.micro_batches = micro_batches
        self.learning_rate = learning_rate
        self.resident_layers = resident_layers
        self.place = Placement(device)
        # Called as observer(phase, layer_index) at every layer visit; tests use it to
        # measure what is resident on the device.
        self.observer: Callable[[str, int], None] | None = None
        # With measure_phases, a step waits at the end of each phase and records its seconds
        # in phase_seconds (forward, backward, update). This serializes the phases, so it is
        # for the benchmarks' time split, not for training.
        self.measure_phases = False
        self.phase_seconds: dict[str, float] = {}
        # Seconds of the last step, measured without extra synchronization: the main
        # thread's waits on the host update and on device->host copies, the forward and
        # backward up to the end of the backward pass, and the update's own duration.
        self.timings: dict[str, float] = {}
        # A megatrain_jax.timeline.Timeline to record the next steps' work per layer.
        self.timeline = None
        # Called before an update may write host state (in place or by donation): a
        # checkpoint still being written from that state makes it wait.
        self.before_update: Callable[[], None] | None = None

        self._embed_fwd = jax.jit(self._embed_fwd_impl)
        self._layer_fwd = jax.jit(self._layer_fwd_impl)
        self._head = jax.jit(self._head_impl)
        self._head_eval = jax.jit(self._head_eval_impl)
        self._layer_bwd = jax.jit(self._layer_bwd_impl, donate_argnums=2)
        self._embed_bwd = jax.jit(self._embed_bwd_impl)
        self._update = self.place.host_jit(self._update_impl, donate_argnums=(0, 2))
        self._update_resident = jax.jit(self._update_impl, donate_argnums=(0, 2))

    # ----- templates (compiled once each) -------------------------------------------------

    def _embed_fwd_impl(self, embed_params, batch):
        return jax.lax.map(lambda mb: self.t.embed(embed_params, mb), batch)  # M b S D

    def _layer_fwd_impl(self, params, xs, batch):
        return jax.lax.map(lambda args: self.t.layer(params, *args), (xs, batch))

    def _head_impl(self, head_params, embed_params, xs, batch, denom):
        """Loss, dL/dx for every micro-batch, and the head's (and tied embedding's) grads."""
        tied = embed_params if self.t.tied else None

        def one(acc, args):
            x, mb = args
            loss_fn = lambda h, e, x_: self.t.head_loss(h, e, x_, mb, denom)  # noqa: E731
            loss, (dh, de, dx) = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(
                head_params, tied, x
            )
            total, dh_acc, de_acc = acc
            return (total + loss, _add(dh_acc, dh), _add(de_acc, de)), dx

        zeros = (jnp.zeros((), jnp.float32), _zeros_like(head_params), _zeros_like(tied))
        (loss, dhead, dembed), dxs = jax.lax.scan(one, zeros, (xs, batch))
        return loss, dxs, dhead, dembed, optim.sum_of_squares(dhead)

    def _head_eval_impl(self, head_params, embed_params, xs, batch, denom):
        tied = embed_params if self.t.tied else None
        losses = jax.lax.map(lambda args: self.t.head_loss(head_params, tied, *args, denom),
                             (xs, batch))
        return jnp.sum(losses)

    def _layer_bwd_impl(self, params, xs, dxs, batch, sq):
        """Recomputes the layer from its saved inputs; returns dL/dx_in, dL/dw, running sq."""

        def one(dw_acc, args):
            x, dx, mb = args
            _, vjp = jax.vjp(lambda w, x_: self.t.layer(w, x_, mb), params, x)
            dw, dx_in = vjp(dx)
            return _add(dw_acc, dw), dx_in

        dw, dxs_in = jax.lax.scan(one, _zeros_like(params), (xs, dxs, batch))
        return dxs_in, dw, sq + optim.sum_of_squares(dw)

    def _embed_bwd_impl(self, embed_params, batch, dxs, dembed_from_head, sq):
        def one(acc, args):
            mb, dx = args
            _, vjp = jax.vjp(lambda e: self.t.embed(e, mb), embed_params)
            return _add(acc, vjp(dx)[0]), None

        start = dembed_from_head if self.t.tied else _zeros_like(embed_params)
        dembed, _ = jax.lax.scan(one, start, (batch, dxs))
        sq = sq + optim.sum_of_squares(dembed)
        skip = ~jnp.isfinite(sq)
        return dembed, sq, skip, optim.clip_scale(sq, self.clip_norm)

    def _update_impl(self, params, grads, opt_state, scale, skip):
        return optim.apply_update(self.opt, params, grads, opt_state, scale, skip)

    # ----- state ---------------------------------------------------------------------------

    def init_state(self, init_embed: Callable, init_layer: Callable, init_head: Callable,
                   num_layers: int) -> StreamState:
        """Builds parameters part by part into host memory (the resident layers into GPU
        memory), then the optimizer state beside them."""
        self._check_resident(num_layers)
        params = host_store.init_host_params(
            self.place, init_embed, init_layer, init_head, num_layers, self.resident_layers
        )
        opt_state = host_store.init_host_opt_state(self.place, self.opt, params)
        return StreamState(params, opt_state, 0)

    def state_from_params(self, params: dict, copy: bool = True) -> StreamState:
        """Host state from existing parameters (anywhere), e.g. an imported checkpoint; the
        resident layers' on the GPU. Parts already in pinned host memory are taken over as
        they are (and updated in place: the import's memory is the state's); with `copy`,
        parts already on the device are copied, so donating them leaves `params` whole."""
        self._check_resident(len(params["layers"]))
        k, place = self.resident_layers, self.place
        params = {"embed": place.to_host(params["embed"]),
                  "layers": [place.to_device(layer, copy) if i < k else place.to_host(layer)
                             for i, layer in enumerate(params["layers"])],
                  "head": place.to_host(params["head"])}
        opt_state = host_store.init_host_opt_state(self.place, self.opt, params)
        return StreamState(params, opt_state, 0)

    def abstract_state(self, abstract_params: dict) -> dict:
        """{"params", "opt_state"} as ShapeDtypeStructs where the state lives (pinned_host,
        the resident layers on the GPU): a restore target."""
        self._check_resident(len(abstract_params["layers"]))
        opt_state = host_store.map_parts(lambda p: jax.eval_shape(self.opt.init, p),
                                         abstract_params)
        tree = host_store.placed_shapes({"params": abstract_params, "opt_state": opt_state},
                                        self.place.host)
        for part in tree.values():
            for i in range(self.resident_layers):
                part["layers"][i] = host_store.placed_shapes(part["layers"][i],
                                                             self.place.on_device)
        return tree

    def _check_resident(self, num_layers: int) -> None:
        if self.resident_layers > num_layers:
            raise ValueError(f"resident_layers ({self.resident_layers}) exceeds the model's "
                             f"{num_layers} layers")

    # ----- the step ------------------------------------------------------------------------

    def _split(self, batch: dict) -> dict:
        m = self.micro_batches
        for name, a in batch.items():
            if a.shape[0] % m:
                raise ValueError(
                    f"batch['{name}'] has {a.shape[0]} rows, not divisible into {m} micro-batches"
                )
        return {k: a.reshape(m, a.shape[0] // m, *a.shape[1:]) for k, a in batch.items()}

    def _track(self, lane: str, name: str, tree):
        if self.timeline is not None:
            self.timeline.track(lane, name, tree)
        return tree

    def _waited(self, what: str, start: float) -> None:
        end = time.perf_counter()
        self.timings[f"wait_{what}_s"] = self.timings.get(f"wait_{what}_s", 0.0) + end - start
        if self.timeline is not None and end - start > 1e-4:
            self.timeline.span("waits", what, start, end)

    def _observe(self, phase: str, index: int) -> None:
        if self.observer is not None:
            self.observer(phase, index)

    def _phase_done(self, phase: str, outputs) -> None:
        if self.measure_phases:
            jax.block_until_ready(outputs)
            now = time.perf_counter()
            self.phase_seconds[phase] = now - self._phase_start
            self._phase_start = now

    def _on_device(self, batch: dict):
        """The batch on the device, split into micro-batches, and the loss's denominator."""
        batch = self.place.to_device(batch)
        normalizer = self.t.normalizer or (lambda b: jnp.sum(b["mask"]))
        return self._split(batch), jnp.maximum(normalizer(batch), 1.0)

    def eval_loss(self, params: dict, batch: dict):
        """The loss of `batch` from a streamed forward pass alone: no gradient, no update."""
        batch, denom = self._on_device(batch)
        embed_params = self.place.to_device(params["embed"])
        xs = self._embed_fwd(embed_params, batch)
        parts = [*params["layers"], params["head"]]
        for i, weights in enumerate(_prefetched(parts, self.place.to_device, self.depth)):
            if i == len(parts) - 1:
                return self._head_eval(weights, embed_params, xs, batch, denom)
            xs = self._layer_fwd(weights, xs, batch)

    def forward_backward(self, params: dict, batch: dict,
                         pending: _PendingUpdate | None = None):
        """Streams one step's forward and backward.

        `pending` is the previous step's host update, still running: the forward waits for
        each part's update just before fetching it, and queues the compute it already can
        before each such wait. Returns (loss, host gradients in the parts layout, squared
        global norm, skip, scale).
        """
        place, num_layers = self.place, len(params["layers"])
        names = _part_names(num_layers)
        self.timings = {"wait_update_s": 0.0, "wait_d2h_s": 0.0}

        def fetch_part(k_tree):
            k, tree = k_tree
            if host_store.on_device(tree):  # updated on the device, in stream order: no wait
                return tree
            if pending is not None:
                start = time.perf_counter()
                pending.wait(k)
                self._waited("update", start)
            return self._track("h2d", names[k], place.to_device(tree))

        def available(k_tree):
            return pending is None or pending.written(k_tree[0])

        self._phase_start = time.perf_counter()
        batch, denom = self._on_device(batch)
        embed_params = fetch_part((0, params["embed"]))

        # Forward: layers 0 … L-1, then the head, each prefetched `depth` ahead.
        stream = enumerate(list(params["layers"]) + [params["head"]], start=1)
        xs = self._track("compute", "embed", self._embed_fwd(embed_params, batch))
        saved = []
        offloads = _InFlight(self.depth, self)
        for i, weights in enumerate(_prefetched(stream, fetch_part, self.depth, available)):
            if i == num_layers:
                head_params = weights
                break
            self._observe("forward", i)
            if self.offload_inputs:
                saved.append(offloads.add(self._track("d2h", f"input {i}",
                                                      place.to_host(xs))))
            else:
                saved.append(xs)
            xs = self._track("compute", f"forward {i}", self._layer_fwd(weights, xs, batch))
            del weights

        loss, dxs, dhead, dembed_head, sq = self._head(head_params, embed_params, xs, batch,
                                                       denom)
        self._track("compute", "head", dxs)
        self._phase_done("forward", dxs)
        del head_params, xs
        grads = {"head": self._track("d2h", "head grad", place.to_host(dhead)),
                 "layers": [None] * num_layers}

        # Backward: layers L-1 … 0, weights and (offloaded) saved inputs prefetched.
        def fetch(i):
            return self._track("h2d", f"layer {i}",
                               place.to_device((params["layers"][i], saved[i])))

        order = range(num_layers - 1, -1, -1)
        offloads = _InFlight(self.depth, self)
        for i, (weights, x_in) in zip(order, _prefetched(order, fetch, self.depth)):
            self._observe("backward", i)
            saved[i] = None  # the device copy now held in x_in is the last one
            dxs, dw, sq = self._layer_bwd(weights, x_in, dxs, batch, sq)
            self._track("compute", f"backward {i}", sq)  # dxs is donated to the next call
            if host_store.on_device(params["layers"][i]):  # updated there: the gradient stays
                grads["layers"][i] = dw
            else:
                grads["layers"][i] = offloads.add(
                    self._track("d2h", f"layer {i} grad", place.to_host(dw)))
            del weights, x_in, dw

        dembed, sq, skip, scale = self._embed_bwd(embed_params, batch, dxs, dembed_head, sq)
        self._track("compute", "embed backward", sq)
        grads["embed"] = self._track("d2h", "embed grad", place.to_host(dembed))
        self._phase_done("backward", grads)
        return loss, grads, sq, skip, scale

    def train_step(self, state: StreamState, batch: dict) -> tuple[StreamState, dict]:
        start = time.perf_counter()
        # The forward waits for each part's pending update just before fetching it.
        loss, grads, sq, skip, scale = self.forward_backward(state._params, batch,
                                                             state.pending)
        state.wait()
        if state.pending is not None:  # the update that overlapped this step's forward
            self.timings["update_s"] = state.pending.seconds
            if self.timeline is not None and state.pending.timeline is None:
                for name, begin, end in state.pending.spans:
                    self.timeline.span("host update", f"{name} (last step's)", begin, end)
        metrics = {"loss": loss, "grad_norm": jnp.sqrt(sq), "skipped": skip}
        if self.learning_rate is not None:
            metrics["lr"] = self.learning_rate(state.step)
        # Reading `skip` waits for the end of the backward pass, which is also what makes
        # in-place writes safe: every transfer that read the old parameters has completed.
        skipped = bool(skip)
        self.timings["forward_backward_s"] = time.perf_counter() - start
        if self.before_update is not None:
            waiting = time.perf_counter()
            self.before_update()
            self._waited("checkpoint", waiting)
        if self.host_opt is not None:
            new_state = self._host_update(state, grads, skipped, scale, skip)
        else:
            new_state = self._device_update(state, grads, skip, scale)
        return new_state, metrics

    def _host_update(self, state, grads, skipped: bool, scale, skip) -> StreamState:
        """Starts the in-place host update on a thread and the resident layers' on the
        device; a skipped step starts nothing."""
        pending, params, opt_state = None, state._params, state._opt_state
        if not skipped:
            host_scale = float(scale)

            def work(p, g, s):  # a resident part's entry keeps the part's index
                if host_store.on_device(p):
                    return lambda: None
                return lambda: self.host_opt.update(p, g, s, host_scale)

            pending = _PendingUpdate(
                [work(p, g, s) for (_, p), (_, g), (_, s) in zip(host_store.parts(params),
                                                                 host_store.parts(grads),
                                                                 host_store.parts(opt_state))],
                _part_names(len(grads["layers"])), self.timeline)
            params, opt_state = self._resident_updates(params, grads, opt_state, scale, skip)
        new_state = StreamState(params, opt_state, state.step + 1, pending)
        if self.measure_phases:
            new_state.wait()
            self._phase_done("update", (params, opt_state))
        return new_state

    def _resident_updates(self, params, grads, opt_state, scale, skip):
        """Dispatches the resident layers' updates (in place, by donation); new part dicts."""
        k = self.resident_layers
        if not k:
            return params, opt_state
        layers, states = list(params["layers"]), list(opt_state["layers"])
        for i in range(k):
            layers[i], states[i] = self._update_resident(layers[i], grads["layers"][i],
                                                         states[i], scale, skip)
            self._track("compute", f"update layer {i}", layers[i])
        return {**params, "layers": layers}, {**opt_state, "layers": states}

    def _device_update(self, state, grads, skip, scale) -> StreamState:
        updating = time.perf_counter()
        host_scale, host_skip = self.place.to_host((scale, skip))
        params, opt_state = self._resident_updates(state.params, grads, state.opt_state,
                                                   scale, skip)

        def update(p, g, s):
            if host_store.on_device(p):  # updated by _resident_updates
                return p, s
            return self._update(p, g, s, host_scale, host_skip)

        pairs = host_store.map_parts(update, params, grads, opt_state)
        params = host_store.map_parts(lambda pair: pair[0], pairs)
        opt_state = host_store.map_parts(lambda pair: pair[1], pairs)
        names = _part_names(len(params["layers"]))
        for name, (_, part) in zip(names, host_store.parts(params)):
            if not host_store.on_device(part):  # the resident layers' bars are already there
                self._track("compute", f"update {name}", part)
        # Serial with the step anyway: waiting here costs nothing and times the update.
        jax.block_until_ready((params, opt_state))
        self.timings["update_s"] = time.perf_counter() - updating
        self._phase_done("update", (params, opt_state))
        return StreamState(params, opt_state, state.step + 1)


class _InFlight:
    """Bounds device -> host copies in flight: a device buffer lives until its copy is done.

    Without a bound, the copies of a whole pass can queue behind each other while their
    device buffers pile up; waiting on the copy issued `limit` items earlier keeps GPU memory
    flat and, while the link keeps pace, costs nothing (the GPU still has queued work).
    """

    def __init__(self, limit: int, engine: "StreamEngine | None" = None):
        self.limit, self.engine = limit, engine
        self.pending = collections.deque()

    def add(self, host_tree):
        self.pending.append(host_tree)
        if len(self.pending) > self.limit:
            start = time.perf_counter()
            jax.block_until_ready(self.pending.popleft())
            if self.engine is not None:
                self.engine._waited("d2h", start)
        return host_tree


def _part_names(num_layers: int) -> list[str]:
    """The parts in streaming order, as every timeline lane names them."""
    return ["embed", *(f"layer {i}" for i in range(num_layers)), "head"]


def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


def _zeros_like(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def llama_templates(config) -> Templates:
    """The built-in Llama-family model as engine templates, from a full `Config`."""
    from megatrain_jax import model

    cfg, chunk = config.model, config.stream.loss_chunk

    def embed(p, batch):
        return model.embed(p, batch["inputs"], cfg)

    def layer(p, x, batch):
        return model.layer(p, x, cfg, batch.get("positions"), batch.get("segment_ids"))

    def head_loss(p, embed_params, x, batch, denom):
        return model.head_loss(p, embed_params, x, batch["targets"], batch["mask"], cfg,
                               denom, chunk)

    return Templates(embed, layer, head_loss, tied=cfg.tie_embeddings)

