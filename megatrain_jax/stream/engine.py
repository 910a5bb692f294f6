"""The streaming engine: host-resident state, one compiled layer template, prefetch and offload.

One training step, for a model of L layers split into `micro_batches` M:

    forward   embed ─► layer 0 ─► … ─► layer L-1 ─► head + loss     (schedule.py)
    backward  layer L-1 … 0: recompute, VJP, gradient D2H at once   (schedule.py)
    update    exact global norm ─► clip scale ─► per-part update of the state at home

The update has two homes. With a `HostAdamW` optimizer it runs on a host thread, in place on
the pinned buffers, part by part in streaming order (updates.py), while the GPU already runs
the next step: the next forward waits for a part's update only when it fetches that part.
With any other Optax transformation it runs as one compiled program per part that streams the
state through the device, at the end of the step. The first `resident_layers` layers live in
GPU memory (placement.py), and with `resident_embeddings` the embedding and the head, and are
updated there by donation, beside the host update. The last `keep_attention` layers' forward
keeps what their backward's recompute then takes instead of computing it again
(Templates.layer_keeping: the attention's output, on the GPU). The last `keep_layers` layers'
forward keeps its matmuls' outputs on the GPU: their backward fetches no weights and recomputes
only the rest of the layer (programs.layer_saving). The `keep_weights` streamed layers before
them keep the weights their forward fetched (over a mesh each device its shard), and their
backward takes those instead of fetching them again. `recompute_inputs` layers save no input:
the backward runs their forward again (schedule.py).

    engine = StreamEngine(templates, optimizer, clip_norm=1.0)
    state = engine.init_state(init_embed, init_layer, init_head, num_layers)
    state, metrics = engine.train_step(state, batch)          # tracer=Timeline() to watch

The engine updates host state in place (or donates it): after `train_step`, only the
returned state is valid, and its host update may still be running: `state.wait()` waits
for it (the next `train_step` waits by itself, part by part). Metrics are device scalars,
except the step's timings (`time_*`, seconds, floats); reading a scalar waits for the step.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from megatrain_jax.optim import HostAdamW
from megatrain_jax.stream.mesh import shard_templates
from megatrain_jax.stream.placement import DEVICE_KIND, Placement, from_parts, part_names, parts
from megatrain_jax.stream.programs import Templates, build_programs
from megatrain_jax.stream.schedule import Schedule
from megatrain_jax.stream.speculation import MODES, StepUpdate, policy
from megatrain_jax.stream.trace import Tracer
from megatrain_jax.stream.updates import wait_for_checkpoint


class StreamState:
    """Training state at home: parameters and Optax state, part by part.

    `params` and `opt_state` are {"embed": pytree, "layers": [pytree] * L, "head": pytree}.
    After a step with the host optimizer, their update may still be running: reading
    `params` or `opt_state` waits for it, so a reader never sees a half-updated model.
    """

    def __init__(self, params: dict, opt_state: dict, step: int = 0,
                 pending: StepUpdate | None = None, last_grad_norm: float | None = None):
        self._params, self._opt_state, self.step, self.pending = params, opt_state, step, pending
        # The last step's gradient norm (inf when it was skipped; None before any step):
        # what the speculation policy reads, and what a checkpoint keeps for it.
        self.last_grad_norm = last_grad_norm

    @property
    def params(self) -> dict:
        return self.wait()._params

    @property
    def opt_state(self) -> dict:
        return self.wait()._opt_state

    def wait(self) -> "StreamState":
        """Waits until the last step's update has written params and opt_state."""
        if self.pending is not None:
            self.pending.wait()
        return self

    def __repr__(self) -> str:
        return f"StreamState(step={self.step}, layers={len(self._params['layers'])})"


# Host weights are given new buffers every this many steps (Placement.renew says why).
RENEW_EVERY = 500


class StreamEngine:
    """Trains a model whose state lives at home (host memory, or the GPU for resident parts)
    by streaming it through the device one part at a time.

    It owns the step's compiled programs (programs.py), the placement of every part
    (placement.py) and the schedule that dispatches them (schedule.py); `train_step` runs one
    step and starts its update: on a host thread with a `HostAdamW` (updates.py, and during
    the backward where speculation.py allows), else on the device. It holds no training state.
    """

    def __init__(self, templates: Templates,
                 optimizer: optax.GradientTransformation | HostAdamW, *,
                 clip_norm: float = 1.0, prefetch_depth: int = 2,
                 saved_inputs: str = "device", micro_batches: int = 1,
                 learning_rate: Callable | None = None, device: jax.Device | None = None,
                 resident_layers: int = 0, speculate: str = "auto", speculate_share: float = 1.0,
                 mesh: Mesh | None = None, keep_attention: int = 0, keep_layers: int = 0,
                 keep_weights: int = 0, resident_embeddings: bool = False,
                 recompute_inputs: int = 0, plain_state: bool = True):
        if speculate not in MODES:
            raise ValueError(f"speculate must be one of {', '.join(MODES)}, got {speculate!r}")
        if not 0 < speculate_share <= 1:
            raise ValueError(f"speculate_share must be within (0, 1], got {speculate_share}")
        self.speculate_share = speculate_share
        # A HostAdamW updates in place on the host (the state only it reads in plain memory:
        # placement.py's plain_state); any other transformation on the device.
        self.host_optimizer = optimizer if isinstance(optimizer, HostAdamW) else None
        self.optimizer = optimizer.optax if self.host_optimizer else optimizer
        self.placement = Placement(resident_layers, device, saved_inputs, mesh, resident_embeddings,
                                   plain_state and self.host_optimizer is not None)
        if keep_attention and templates.layer_keeping is None:
            raise ValueError("keep_attention needs templates with layer_keeping and "
                             "layer_replaying; these have none: set keep_attention=0")
        if keep_attention and self.placement.mesh is not None:
            raise ValueError("keep_attention runs on one device; over a mesh set it to 0")
        if keep_layers < 0:
            raise ValueError(f"keep_layers must be >= 0, got {keep_layers}")
        if keep_layers and self.placement.mesh is not None:
            raise ValueError("keep_layers runs on one device; over a mesh set it to 0")
        if keep_weights < 0:
            raise ValueError(f"keep_weights must be >= 0, got {keep_weights}")
        if self.placement.mesh is not None:
            templates = shard_templates(templates, self.placement.mesh)
        self.templates = templates
        self.clip_norm, self.speculate = clip_norm, speculate
        if speculate == "on" and self.host_optimizer and not self.host_optimizer.can_undo:
            raise ValueError(f"speculate='on' needs an exact undo, which "
                             f"{self.host_optimizer.state_dtype} moments do not allow")
        self.micro_batches = micro_batches
        self.learning_rate = learning_rate
        self.programs = build_programs(templates, self.optimizer, clip_norm, self.placement)
        self.schedule = Schedule(self.programs, self.placement, prefetch_depth, keep_attention,
                                 keep_layers, keep_weights, recompute_inputs)

    # ----- state ---------------------------------------------------------------------------

    def init_state(self, init_embed: Callable, init_layer: Callable, init_head: Callable,
                   num_layers: int, on_part: Callable | None = None) -> StreamState:
        """Builds parameters part by part at home, then the optimizer state beside them.
        `on_part(what)`, if given, follows each part's weights and each part's optimizer
        state once they are home (a progress bar's tick)."""
        params = self.placement.init_params(init_embed, init_layer, init_head, num_layers,
                                            on_part)
        return StreamState(params, self.placement.init_opt_state(self.optimizer.init, params,
                                                                 on_part))

    def state_from_params(self, params: dict, copy: bool = True,
                          on_part: Callable | None = None) -> StreamState:
        """State from existing parameters (anywhere), e.g. an imported checkpoint. Parts
        already in pinned host memory are taken over as they are (and updated in place: the
        import's memory is the state's); with `copy`, parts already on the device are copied
        where they stay, so donating them leaves `params` whole. `on_part` as in init_state,
        for the optimizer state."""
        params = self.placement.place_params(params, copy)
        return StreamState(params, self.placement.init_opt_state(self.optimizer.init, params,
                                                                 on_part))

    def abstract_state(self, abstract_params: dict) -> dict:
        """{"params", "opt_state"} as ShapeDtypeStructs at home: a restore target."""
        return self.placement.abstract_state(abstract_params, self.optimizer.init)

    # ----- the step ------------------------------------------------------------------------

    def device_batch(self, batch: dict):
        """The batch on the device, split into micro-batches, and the loss's denominator."""
        if self.placement.mesh is not None:
            return self._mesh_batch(batch)
        batch = self.placement.to_device(batch)
        m = self.micro_batches
        for name, a in batch.items():
            if a.shape[0] % m:
                raise ValueError(
                    f"batch['{name}'] has {a.shape[0]} rows, not divisible into {m} micro-batches")
        normalizer = self.templates.normalizer or (lambda b: jnp.sum(b["mask"]))
        denom = jnp.maximum(normalizer(batch), 1.0)
        return {k: a.reshape(m, a.shape[0] // m, *a.shape[1:]) for k, a in batch.items()}, denom

    def _mesh_batch(self, batch: dict):
        """device_batch over a mesh: each micro-batch's rows split over the devices. Every
        process passes the whole batch and places the rows of its own devices."""
        m, n = self.micro_batches, self.placement.devices
        host = {name: np.asarray(a) for name, a in batch.items()}
        for name, a in host.items():
            if a.shape[0] % (m * n):
                raise ValueError(
                    f"batch['{name}'] has {a.shape[0]} rows, which do not split into {m} "
                    f"micro-batches over {n} devices: make the batch size a multiple of "
                    f"{m * n} (data.batch_size), or use fewer devices (mesh.data)")
        normalizer = self.templates.normalizer or (lambda b: jnp.sum(b["mask"]))
        # Left on the device it was computed on: placing it is a device-to-device copy, with
        # no wait for the work queued there (several processes read it back to place it).
        denom = jnp.maximum(normalizer(host), 1.0)
        micro = {k: a.reshape(m, a.shape[0] // m, *a.shape[1:]) for k, a in host.items()}
        return self.placement.place_batch(micro), self.placement.place(denom, DEVICE_KIND)

    def eval_loss(self, params: dict, batch: dict):
        """The loss of `batch` from a streamed forward pass alone: no gradient, no update."""
        return self.schedule.eval_loss(params, *self.device_batch(batch))

    def forward_backward(self, params: dict, batch: dict, pending: StepUpdate | None = None,
                         tracer: Tracer | None = None, on_gradient: Callable | None = None):
        """(loss, gradients, squared global norm, skip, scale) of one streamed step."""
        return self.schedule.forward_backward(params, *self.device_batch(batch), pending,
                                              tracer or Tracer(), on_gradient)

    def train_step(self, state: StreamState, batch: dict, *, tracer: Tracer | None = None,
                   before_write: Callable | None = None) -> tuple[StreamState, dict]:
        """One step. `before_write(part)` is called before the update may write a part's
        state (`before_write(None)`: all of it): a checkpoint still capturing it waits there."""
        tracer = tracer or Tracer()
        start = time.perf_counter()
        update, on_gradient = None, None
        if self.host_optimizer is not None and state.step and state.step % RENEW_EVERY == 0:
            state = self._renew(state, before_write)
        if self.host_optimizer is not None:
            speculating = self.host_optimizer.can_undo and policy(
                self.speculate, self.clip_norm, state.last_grad_norm)
            update = StepUpdate(self.host_optimizer, self.clip_norm, speculating, tracer,
                                before_write)
            on_gradient = self._speculator(state, update) if speculating else None
        loss, grads, sq, skip, scale = self.forward_backward(state._params, batch,
                                                             state.pending, tracer, on_gradient)
        state.wait()
        metrics = {"loss": loss, "grad_norm": jnp.sqrt(sq), "skipped": skip}
        if update is not None:  # whether this step's own update speculates (begins during
            metrics["speculating"] = float(update.speculate)  # its backward)
        if self.learning_rate is not None:
            metrics["lr"] = self.learning_rate(state.step)
        timings = {}
        if state.pending is not None:  # the update that overlapped this step's forward
            timings["update_s"] = state.pending.seconds
            metrics["speculated_parts"] = len(state.pending.speculated)
            metrics["undone_parts"] = state.pending.undone
            if state.pending.tracer is not tracer:
                for name, begin, end in state.pending.spans:
                    tracer.span("host update", f"{name} (last step's)", begin, end)
        # Reading `skip` waits for the end of the backward pass, which is also what makes
        # in-place writes safe: every transfer that read the old parameters has completed.
        skipped = bool(skip)
        timings["forward_backward_s"] = time.perf_counter() - start
        if update is not None:
            new_state = self._host_update(state, grads, skipped, scale, skip, update, tracer)
            new_state.last_grad_norm = math.inf if skipped else math.sqrt(float(sq))
        else:
            wait_for_checkpoint(before_write, tracer)
            new_state = self._device_update(state, grads, skip, scale, tracer, timings)
        timings.update({f"wait_{what}_s": s for what, s in tracer.waits.items()})
        metrics.update({f"time_{name}": s for name, s in timings.items()})
        return new_state, metrics

    def _renew(self, state: StreamState, before_write: Callable | None):
        """`state` with its host weights in new buffers, once its update is written and a
        checkpoint reading them is done. The in-place host update is the one path whose
        weight buffers live on from step to step (a device update makes new ones)."""
        state.wait()
        if before_write is not None:
            before_write()
        params = from_parts([part if self.placement.is_resident(k) else
                             self.placement.renew(part)
                             for k, part in enumerate(parts(state._params))])
        return StreamState(params, state._opt_state, state.step, None, state.last_grad_norm)

    def _speculator(self, state: StreamState, update: StepUpdate) -> Callable:
        """The schedule's on_gradient: hands the gradients of the host parts within the
        speculative share to the update."""
        names = part_names(len(state._params["layers"]))
        params, opt_state = parts(state._params), parts(state._opt_state)
        speculative = self.speculative_parts(params)

        def on_gradient(k, grads, seen_sq):
            if k in speculative:
                update.gradient_ready(names[k], params[k], grads, opt_state[k], seen_sq)

        return on_gradient

    def speculative_parts(self, params: list) -> set[int]:
        """Indices of the host parts a speculating step may update during the backward: from
        the head down, in the order their gradients arrive, while their parameters stay
        within `speculate_share` of the host's."""
        size = [sum(leaf.size for leaf in jax.tree.leaves(part)) for part in params]
        host = [k for k in range(len(params)) if not self.placement.is_resident(k)]
        room, speculative = self.speculate_share * sum(size[k] for k in host), set()
        for k in sorted(host, reverse=True):  # head, last layer, ..., embedding
            if size[k] > room * (1 + 1e-9):
                break
            room -= size[k]
            speculative.add(k)
        return speculative

    def _host_update(self, state, grads, skipped: bool, scale, skip, update: StepUpdate,
                     tracer) -> StreamState:
        """Settles the host update part by part in streaming order (the next forward's order)
        and dispatches the resident parts' on the device; a skipped step writes nothing."""
        params, opt_state = state._params, state._opt_state
        host_scale = float(scale)
        names = part_names(len(params["layers"]))
        for k, (p, g, s) in enumerate(zip(parts(params), parts(grads), parts(opt_state))):
            if not self.placement.is_resident(k):
                update.settle(names[k], p, g, s, skipped, host_scale)
        update.close()
        if not skipped:
            resident = [names[k] for k in range(len(names)) if self.placement.is_resident(k)]
            if resident:  # a save may still be capturing the state these updates donate
                wait_for_checkpoint(update.before_write, tracer, resident)
            params, opt_state = self._resident_updates(params, grads, opt_state, scale, skip,
                                                       tracer)
        new_state = StreamState(params, opt_state, state.step + 1, update)
        tracer.phase_end("update", lambda: new_state.wait()._params)
        return new_state

    def _resident_updates(self, params, grads, opt_state, scale, skip, tracer):
        """Dispatches the resident parts' updates (in place, by donation); new part dicts."""
        p, g, s = parts(params), parts(grads), parts(opt_state)
        names = part_names(len(params["layers"]))
        for k in range(len(p)):
            if self.placement.is_resident(k):
                p[k], s[k] = self.programs.update_device(p[k], g[k], s[k], scale, skip)
                tracer.issued("compute", f"update {names[k]}", p[k])
        return from_parts(p), from_parts(s)

    def _device_update(self, state, grads, skip, scale, tracer, timings) -> StreamState:
        """Every part through the GPU by compiled programs, at the end of the step."""
        updating = time.perf_counter()
        host_scale, host_skip = self.placement.to_host((scale, skip))
        params, opt_state = self._resident_updates(state.params, grads, state.opt_state,
                                                   scale, skip, tracer)
        p, g, s = parts(params), parts(grads), parts(opt_state)
        names = part_names(len(params["layers"]))
        for k in range(len(p)):
            if not self.placement.is_resident(k):
                p[k], s[k] = self.programs.update_host(p[k], g[k], s[k], host_scale, host_skip)
                tracer.issued("compute", f"update {names[k]}", p[k])
        params, opt_state = from_parts(p), from_parts(s)
        # Serial with the step anyway: waiting here costs nothing and times the update.
        jax.block_until_ready((params, opt_state))
        timings["update_s"] = time.perf_counter() - updating
        tracer.phase_end("update", lambda: params)
        return StreamState(params, opt_state, state.step + 1)
