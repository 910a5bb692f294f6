"""The schedule of one step: the forward and backward loops over the model's parts.

    forward   embed ─► layer 0 ─► … ─► layer L-1 ─► head + loss (value and gradient)
              while layer i computes, the next `depth` parts are already travelling H2D
    backward  layer L-1 … 0: recompute from the saved input, VJP, gradient D2H at once

The last `keep_layers` layers' forward keeps what their backward needs (programs.layer_saving):
their backward fetches nothing and recomputes only the cheap part of the layer. The
`keep_attention` layers before them keep what their backward's recompute then takes instead
of computing it again (their attention's output: programs.Templates), and the `keep_weights`
layers before them keep the weights their forward fetched, which their backward takes
instead of fetching them again (over a mesh, each device its shard).

Parts are indexed in streaming order (0 embed, 1..L layers, L+1 head) and named as
`placement.part_names` names them. The loops only dispatch: programs compute, the placement
moves, the tracer watches, and the previous step's update queue says when a part's new
weights are written.
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp

from megatrain_jax.stream.placement import Placement, from_parts, part_names, parts
from megatrain_jax.stream.programs import Programs
from megatrain_jax.stream.trace import Tracer


class Schedule:
    def __init__(self, programs: Programs, placement: Placement, prefetch_depth: int = 2,
                 keep_attention: int = 0, keep_layers: int = 0, keep_weights: int = 0):
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
        self.programs, self.placement = programs, placement
        self.depth, self.keep_attention = prefetch_depth, keep_attention
        self.keep_layers, self.keep_weights = keep_layers, keep_weights

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
        place, run, depth = self.placement, self.programs, self.depth
        weights, names = parts(params), part_names(len(params["layers"]))
        layers = len(weights) - 2

        def written(k):
            return pending is None or pending.done(names[k])

        def fetch(k):  # part k's weights on the device, once its update is written
            if place.is_resident(k):
                return weights[k]
            if not written(k):
                start = time.perf_counter()
                pending.wait(names[k])
                tracer.waited("update", start)
            return tracer.issued("h2d", names[k], place.to_device(weights[k]))

        embed = fetch(0)
        xs = tracer.issued("compute", "embed", run.embed_forward(embed, batch))
        saved, kept, offloads = [], [None] * layers, _InFlight(depth, tracer)
        saving = range(layers - min(self.keep_layers, layers), layers)
        keeping = range(max(0, saving.start - self.keep_attention), saving.start)
        weighing = range(max(0, saving.start - self.keep_weights), saving.start)
        fetched = [None] * layers  # the weights of `weighing` layers, kept for the backward
        computing = _InFlight(depth, tracer, "compute")  # the weights fetched ahead of it
        stream = _prefetched(range(1, layers + 2), fetch, depth, written)
        for i, w in zip(range(layers), stream):
            tracer.visit("forward", i)
            if i in saving:  # what its backward needs stays on the device: no input saved
                saved.append(None)
                xs, kept[i] = run.layer_saving(w, xs, batch, *self.index(i))
            else:
                saved.append(offloads.add(tracer.issued("d2h", f"input {i}", place.to_host(xs)))
                             if place.input_on_host(i) else xs)
                if i in keeping:
                    xs, kept[i] = run.layer_keeping(w, xs, batch)
                else:
                    xs = run.layer_forward(w, xs, batch, *self.index(i))
            computing.add(tracer.issued("compute", f"forward {i}", xs))
            if i in weighing:
                fetched[i] = w
            del w
        loss, dxs, dhead, dembed_head, sq = run.head(next(stream), embed, xs, batch, denom)
        tracer.issued("compute", "head", dxs)
        tracer.phase_end("forward", lambda: dxs)
        del xs
        grads = [None] * (layers + 2)
        if place.is_resident(layers + 1):
            grads[-1] = dhead
        else:
            grads[-1] = tracer.issued("d2h", "head grad", place.to_host(dhead))
            if on_gradient is not None:  # the head's is the first
                on_gradient(layers + 1, grads[-1], place.to_host(sq))

        def fetch_back(i):  # layer i's weights and saved input on the device (none: saving)
            if i in saving:
                return None, None
            if fetched[i] is not None:  # the forward's: only a host-saved input travels
                w, x, fetched[i] = fetched[i], saved[i], None
                if place.in_host_memory(x):
                    x = tracer.issued("h2d", f"input {i}", place.to_device(x))
                return w, x
            return tracer.issued("h2d", names[i + 1], place.to_device((weights[i + 1], saved[i])))

        order = range(layers - 1, -1, -1)
        offloads = _InFlight(depth, tracer)
        for i, (w, x_in) in zip(order, _prefetched(order, fetch_back, depth)):
            tracer.visit("backward", i)
            saved[i] = None  # the device copy in x_in is the last one
            if i in saving:
                dxs, dw, sq = run.layer_backward_saved(kept[i], dxs, sq)
            else:
                dxs, dw, sq = run.layer_backward(w, x_in, dxs, batch, sq, kept[i],
                                                 *self.index(i))
            kept[i] = None
            tracer.issued("compute", f"backward {i}", sq)  # dxs is donated to the next call
            if place.is_resident(i + 1):
                grads[i + 1] = dw
            else:
                grads[i + 1] = offloads.add(
                    tracer.issued("d2h", f"layer {i} grad", place.to_host(dw)))
                if on_gradient is not None:
                    on_gradient(i + 1, grads[i + 1], place.to_host(sq))
            del w, x_in, dw
        dembed, sq, skip, scale = run.embed_backward(embed, batch, dxs, dembed_head, sq)
        tracer.issued("compute", "embed backward", sq)
        grads[0] = dembed if place.is_resident(0) else tracer.issued(
            "d2h", "embed grad", place.to_host(dembed))
        tracer.phase_end("backward", lambda: grads)
        return loss, from_parts(grads), sq, skip, scale

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
