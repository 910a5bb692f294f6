"""The schedule of one step: the forward and backward loops over the model's parts.

    forward   embed ─► layer 0 ─► … ─► layer L-1 ─► head + loss (value and gradient)
              while layer i computes, the next `depth` parts are already travelling H2D
    backward  layer L-1 … 0: recompute from the saved input, VJP, gradient D2H at once

The last `keep_layers` layers' forward keeps what their backward needs (programs.layer_saving):
their backward fetches nothing and recomputes only the cheap part of the layer. The
`keep_attention` layers before them keep what their backward's recompute then takes instead
of computing it again (their attention's output: programs.Templates), and the `keep_weights`
layers before them keep the weights their forward fetched, which their backward takes
instead of fetching them again (over a mesh, each device its shard): `KeptOnDevice` holds
the three ranges of layers. The `recompute_inputs` layers spread over those before the ranges
(`recomputed_inputs`) save no input: the backward, reaching the last layer of a run of them,
runs the forward again from the last input saved before it, and the inputs it makes wait on
the device for their own backward. One more forward a layer buys a saved input's bytes.

Parts are indexed in streaming order (0 embed, 1..L layers, L+1 head) and named as
`placement.part_names` names them. The loops only dispatch: programs compute, the placement
moves, the tracer watches, and the previous step's update queue says when a part's new
weights are written.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp

from megatrain_jax.stream.placement import Placement, from_parts, part_names, parts
from megatrain_jax.stream.programs import Programs
from megatrain_jax.stream.trace import Tracer


@dataclasses.dataclass(frozen=True)
class KeptOnDevice:
    """The layers whose forward keeps something on the device for their backward, by index.

    `residuals`: the last `keep_layers` layers keep their matmuls' outputs and weights
    (programs.layer_saving); their backward fetches nothing and recomputes only the rest.
    `attention`: the `keep_attention` layers before them keep their attention's output and
    statistics (Templates.layer_keeping); their backward does not attend again.
    `weights`: the `keep_weights` layers before the residuals' keep the weights their forward
    fetched (over a mesh, each device its shard); their backward fetches no weights.
    `recomputed`: layers before `attention` whose forward saves no input (recomputed_inputs).
    """

    residuals: range
    attention: range
    weights: range
    recomputed: frozenset = frozenset()

    @classmethod
    def of(cls, layers: int, keep_layers: int, keep_attention: int,
           keep_weights: int, recompute_inputs: int = 0) -> "KeptOnDevice":
        residuals = range(layers - min(keep_layers, layers), layers)
        first = residuals.start
        attention = range(max(0, first - keep_attention), first)
        return cls(residuals, attention, range(max(0, first - keep_weights), first),
                   recomputed_inputs(attention.start, recompute_inputs))


def recomputed_inputs(plain: int, count: int) -> frozenset:
    """The `count` layers among the first `plain` whose input the forward does not save, the
    backward recomputing it. The P - count that save theirs start runs as even as can be (run
    m at layer m·P // (P - count)), so that a backward holds the fewest recomputed inputs at
    once (the longest run's, less one); layer 0 always saves. planning/recompute.py counts
    the same layers in closed form."""
    if count <= 0:
        return frozenset()
    if count >= plain:
        raise ValueError(f"recompute_inputs ({count}) must leave a saved input among the "
                         f"{plain} layers before those that keep anything on the device: "
                         f"at most {max(plain - 1, 0)}")
    saving = plain - count
    return frozenset(range(plain)) - {m * plain // saving for m in range(saving)}


# A layer's place in the forward's saved inputs when it saves none (recomputed_inputs).
RECOMPUTE = "recompute"


class _Pass:
    """One step's streaming state: the parts' weights at home, the previous step's update
    that a fetch waits for, and what each layer's forward leaves for its backward."""

    def __init__(self, params: dict, pending, tracer: Tracer, placement: Placement,
                 kept_on_device: KeptOnDevice):
        self.weights, self.names = parts(params), part_names(len(params["layers"]))
        self.layers = len(self.weights) - 2
        self.pending, self.tracer, self.place = pending, tracer, placement
        self.on_device = kept_on_device
        self.saved = []                    # each layer's input (None: it keeps its residuals)
        self.kept = [None] * self.layers   # what its forward kept for its backward's recompute
        self.fetched = [None] * self.layers  # the weights of `on_device.weights` layers

    def written(self, k: int) -> bool:
        """Whether part k's update from the previous step is written."""
        return self.pending is None or self.pending.done(self.names[k])

    def fetch(self, k: int):
        """Part k's weights on the device, once its update is written."""
        if self.place.is_resident(k):
            return self.weights[k]
        if not self.written(k):
            start = time.perf_counter()
            self.pending.wait(self.names[k])
            self.tracer.waited("update", start)
        return self.tracer.issued("h2d", self.names[k], self.place.to_device(self.weights[k]))

    def fetch_again(self, i: int):
        """Layer i's weights for a recompute of its forward: those the forward kept, else
        fetched again."""
        return self.fetched[i] if self.fetched[i] is not None else self.fetch(i + 1)

    def fetch_back(self, i: int):
        """Layer i's weights and saved input on the device for its backward (None, None for
        a layer that kept its residuals: it needs neither)."""
        if i in self.on_device.residuals:
            return None, None
        if self.fetched[i] is not None:  # the forward's: only a host-saved input travels
            w, x, self.fetched[i] = self.fetched[i], self.saved[i], None
            if self.place.in_host_memory(x):
                x = self.tracer.issued("h2d", f"input {i}", self.place.to_device(x))
            return w, x
        return self.tracer.issued("h2d", self.names[i + 1],
                                  self.place.to_device((self.weights[i + 1], self.saved[i])))


class Schedule:
    """The order of one step's work: which transfer and which program run when.

    `forward_backward` streams the parts through the device, issuing each transfer before
    the compute it should overlap, and returns the step's gradients; it only dispatches
    (programs compute, the placement moves, the tracer watches). `prefetch_depth` parts
    travel ahead of the one computing; `keep_*` say which layers keep what on the device for
    their backward (KeptOnDevice).
    """

    def __init__(self, programs: Programs, placement: Placement, prefetch_depth: int = 2,
                 keep_attention: int = 0, keep_layers: int = 0, keep_weights: int = 0,
                 recompute_inputs: int = 0):
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
        if recompute_inputs < 0:
            raise ValueError(f"recompute_inputs must be >= 0, got {recompute_inputs}")
        self.programs, self.placement = programs, placement
        self.depth, self.keep_attention = prefetch_depth, keep_attention
        self.keep_layers, self.keep_weights = keep_layers, keep_weights
        self.recompute_inputs = recompute_inputs

    def forward_backward(self, params: dict, batch: dict, denom, pending, tracer: Tracer,
                         on_gradient: Callable | None = None):
        """Streams one step. `batch` is on the device, split into micro-batches; `pending`
        is the previous step's update (done(name), wait(name)), still running. Returns
        (loss, gradients in the parts layout, squared global norm, skip, clip scale); host
        parts' gradients are on the host, resident parts' on the device. During the
        backward, on_gradient(k, host_gradient, seen_sq) is called for each host part k but
        the embedding (the last) once its gradient's copy is issued, with the sum of squares
        of the step's gradients so far, k's included; that sum's copy to the host follows
        the gradient's, so reading it waits for that part's transfers only, not for the
        copies queued after them."""
        layers = len(params["layers"])
        on_device = KeptOnDevice.of(layers, self.keep_layers, self.keep_attention,
                                    self.keep_weights, self.recompute_inputs)
        step = _Pass(params, pending, tracer, self.placement, on_device)
        embed = step.fetch(0)
        loss, dxs, dhead, dembed_head, sq = self._forward(step, embed, batch, denom)
        tracer.phase_end("forward", lambda: dxs)
        grads = [None] * (layers + 2)
        grads[-1] = self._gradient_out(step, layers + 1, dhead, sq, on_gradient, "head grad")
        dxs, sq = self._backward(step, dxs, batch, sq, grads, on_gradient)
        dembed, sq, skip, scale = self.programs.embed_backward(embed, batch, dxs, dembed_head,
                                                               sq)
        tracer.issued("compute", "embed backward", sq)
        grads[0] = self._gradient_out(step, 0, dembed, sq, None, "embed grad")
        tracer.phase_end("backward", lambda: grads)
        return loss, from_parts(grads), sq, skip, scale

    def _forward(self, step: _Pass, embed, batch: dict, denom):
        """The embedding, every layer and the head + loss: (loss, dL/dx of the last layer's
        output, the head's gradient, the tied embedding's from the head, sum of squares)."""
        xs = step.tracer.issued("compute", "embed", self.programs.embed_forward(embed, batch))
        offloads = _InFlight(self.depth, step.tracer)  # inputs saved on the host
        computing = _InFlight(self.depth, step.tracer, "compute")  # weights fetched ahead
        stream = _prefetched(range(1, step.layers + 2), step.fetch, self.depth, step.written)
        for i, w in zip(range(step.layers), stream):
            step.tracer.visit("forward", i)
            xs = self._forward_layer(step, i, w, xs, batch, offloads)
            computing.add(step.tracer.issued("compute", f"forward {i}", xs))
            if i in step.on_device.weights:
                step.fetched[i] = w
            del w
        head = self.programs.head(next(stream), embed, xs, batch, denom)
        step.tracer.issued("compute", "head", head[1])
        return head

    def _forward_layer(self, step: _Pass, i: int, w, xs, batch: dict, offloads: "_InFlight"):
        """Layer i's forward, leaving for its backward its saved input and what it keeps."""
        run, place = self.programs, self.placement
        if i in step.on_device.residuals:  # what its backward needs stays: no input saved
            step.saved.append(None)
            xs, step.kept[i] = run.layer_saving(w, xs, batch, *self.index(i))
            return xs
        if i in step.on_device.recomputed:
            step.saved.append(RECOMPUTE)
        elif place.input_on_host(i):
            to_host = step.tracer.issued("d2h", f"input {i}", place.to_host(xs))
            step.saved.append(offloads.add(to_host))
        else:
            step.saved.append(xs)
        if i in step.on_device.attention:
            xs, step.kept[i] = run.layer_keeping(w, xs, batch)
            return xs
        return run.layer_forward(w, xs, batch, *self.index(i))

    def _backward(self, step: _Pass, dxs, batch: dict, sq, grads: list,
                  on_gradient: Callable | None):
        """The layers from last to first, each gradient sent out as soon as it is computed;
        fills grads[1..L] and returns dL/dx of the embedding's output and the sum of squares."""
        order = range(step.layers - 1, -1, -1)
        offloads = _InFlight(self.depth, step.tracer)
        back = _prefetched(order, lambda i: self._fetch_back(step, batch, i), self.depth)
        for i, (w, x_in) in zip(order, back):
            step.tracer.visit("backward", i)
            step.saved[i] = None  # the device copy in x_in is the last one
            if i in step.on_device.residuals:
                dxs, dw, sq = self.programs.layer_backward_saved(step.kept[i], dxs, sq)
            else:
                dxs, dw, sq = self.programs.layer_backward(w, x_in, dxs, batch, sq, step.kept[i],
                                                           *self.index(i))
            step.kept[i] = None
            step.tracer.issued("compute", f"backward {i}", sq)  # dxs is donated to the next
            grads[i + 1] = self._gradient_out(step, i + 1, dw, sq, on_gradient,
                                              f"layer {i} grad", offloads)
            del w, x_in, dw
        return dxs, sq

    def _fetch_back(self, step: _Pass, batch: dict, i: int):
        """step.fetch_back(i), once layer i's input is on the device where its forward saved
        none: the first such layer the backward meets, the last of its run, recomputes the
        run's."""
        if step.saved[i] is RECOMPUTE:
            self._recompute(step, batch, i)
        return step.fetch_back(i)

    def _recompute(self, step: _Pass, batch: dict, i: int):
        """The inputs of layer i and of the layers before it back to the last that saved
        its input, by their forward run again from that input, left on the device for their
        own backward. The weights travel again but where the layer kept its forward's."""
        start = max(k for k in range(i) if step.saved[k] is not RECOMPUTE)
        xs = step.saved[start]
        if self.placement.in_host_memory(xs):  # its own backward takes this copy
            xs = step.tracer.issued("h2d", f"input {start}", self.placement.to_device(xs))
        step.saved[start] = xs
        computing = _InFlight(self.depth, step.tracer, "compute")  # bounds weights in flight
        weights = _prefetched(range(start, i), step.fetch_again, self.depth)
        for k, w in zip(range(start, i), weights):
            xs = self.programs.layer_forward(w, xs, batch, *self.index(k))
            step.saved[k + 1] = computing.add(step.tracer.issued("compute", f"recompute {k}",
                                                                 xs))
            del w

    def _gradient_out(self, step: _Pass, k: int, grad, sq, on_gradient: Callable | None,
                      label: str, offloads: "_InFlight | None" = None):
        """Part k's gradient where its update runs: a resident part's stays on the device, a
        host part's copy to the host is issued (and handed to on_gradient with the sum of
        squares so far)."""
        if self.placement.is_resident(k):
            return grad
        host = step.tracer.issued("d2h", label, self.placement.to_host(grad))
        if offloads is not None:
            host = offloads.add(host)
        if on_gradient is not None:
            on_gradient(k, host, self.placement.to_host(sq))
        return host

    def eval_loss(self, params: dict, batch: dict, denom):
        """The loss from a streamed forward pass alone: no gradient, no update."""
        place, run = self.placement, self.programs
        embed = place.to_device(params["embed"])
        xs = run.embed_forward(embed, batch)
        rest = parts(params)[1:]
        for i, w in enumerate(_prefetched(rest, place.to_device, self.depth)):
            if i == len(rest) - 1:
                return run.head_eval(w, embed, xs, batch, denom)
            xs = run.layer_forward(w, xs, batch, *self.index(i))

    def index(self, i: int) -> tuple:
        """The layer programs' extra argument: (layer i's index,) for templates that take it
        (Templates.layer_index), else nothing."""
        return (jnp.asarray(i, jnp.int32),) if self.programs.layer_index else ()


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


class _InFlight:
    """Bounds work in flight: waits on the item added `limit` items earlier.

    For device -> host copies (a device buffer lives until its copy is done) and for the
    forward's layer outputs (each fetched layer's weights live on the device until the compute
    that reads them is done). Without a bound, a loop that nothing else paces dispatches a
    whole pass ahead of the GPU and the buffers of every part pile up; waiting `limit` items
    back keeps GPU memory flat and costs nothing (the GPU still has `limit` items queued).
    """

    def __init__(self, limit: int, tracer: Tracer, what: str = "d2h"):
        self.limit, self.tracer, self.what = limit, tracer, what
        self.pending = collections.deque()

    def add(self, tree):
        self.pending.append(tree)
        if len(self.pending) > self.limit:
            start = time.perf_counter()
            jax.block_until_ready(self.pending.popleft())
            self.tracer.waited(self.what, start)
        return tree
