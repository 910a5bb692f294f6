"""The streaming step from pure functions: the layer every other entry point builds on.

    step = streaming.from_functions(
        embed=lambda p, batch: p["table"][batch["inputs"]],      # -> x [B, S, D]
        layer=lambda p, x: x + jnp.tanh(x @ p["w"]),             # one layer template
        head_loss=lambda p, x, batch: jnp.sum((x @ p["out"] - batch["y"]) ** 2),
        params={"embed": ..., "layers": [...], "head": ...},
        optimizer=optax.adamw(1e-3),
    )
    state = step.init_state()
    state, metrics = step.train_step(state, batch)

`head_loss` returns the loss *summed* over the micro-batch; the step divides by the batch's
normalizer (the sum of `batch["mask"]` when there is one, else the number of rows), so the
loss is a mean over the whole batch and micro-batches add up exactly.

All layers must share one structure and shapes (that is what lets one compiled template
serve every layer); a layer that differs, or a template that closes over arrays (which would
be baked into the compiled function instead of trained), is refused with a message that
says which.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from megatrain_jax.stream import StreamEngine, StreamState, Templates
from megatrain_jax.stream.mesh import make_mesh


class TemplateError(ValueError):
    """The layers or templates given cannot be streamed as they are; the message says why."""


def check_layers(layers: Sequence) -> None:
    """All layers must have the first layer's pytree structure, shapes and dtypes."""
    if not layers:
        raise TemplateError("no layers given: streaming needs at least one layer")
    first = jax.tree.structure(layers[0])
    spec = [(a.shape, a.dtype) for a in jax.tree.leaves(layers[0])]
    for i, layer in enumerate(layers[1:], start=1):
        if jax.tree.structure(layer) != first:
            raise TemplateError(
                f"layer {i} differs in structure from layer 0: {jax.tree.structure(layer)} vs "
                f"{first}. Every layer must be the same template."
            )
        paths = jax.tree_util.tree_flatten_with_path(layer)[0]
        for (path, a), (shape, dtype) in zip(paths, spec):
            if (a.shape, a.dtype) != (shape, dtype):
                raise TemplateError(
                    f"layer {i} parameter {jax.tree_util.keystr(path)} is {a.dtype}{list(a.shape)}"
                    f" but layer 0 has {dtype}{list(shape)}. Every layer must have equal shapes."
                )


def check_no_captured_arrays(fn: Callable, *example_args, name: str = "template") -> None:
    """Refuses a template whose trace captures floating-point arrays from its closure."""
    consts = jax.make_jaxpr(fn)(*example_args).consts
    captured = [
        c for c in consts
        if hasattr(c, "shape") and c.size > 1 and jnp.issubdtype(c.dtype, jnp.floating)
    ]
    if captured:
        shapes = ", ".join(f"{c.dtype}{list(c.shape)}" for c in captured[:4])
        raise TemplateError(
            f"the {name} closes over arrays ({shapes}): they would be baked into the compiled "
            "function and never trained. Pass them in through the parameters instead."
        )


@dataclasses.dataclass
class StreamingStep:
    """A streaming engine together with the parameters it starts from."""

    engine: StreamEngine
    params: dict

    def init_state(self) -> StreamState:
        """Host-resident parameters and optimizer state (pinned_host; resident layers on
        the GPU)."""
        return self.engine.state_from_params(self.params)

    def train_step(self, state: StreamState, batch: dict) -> tuple[StreamState, dict]:
        return self.engine.train_step(state, batch)


def _normalizer(batch: dict):
    if "mask" in batch:
        return jnp.sum(batch["mask"])
    return jnp.asarray(jax.tree.leaves(batch)[0].shape[0], jnp.float32)


def from_functions(embed: Callable, layer: Callable, head_loss: Callable, params: dict,
                   optimizer: optax.GradientTransformation, **options) -> StreamingStep:
    """A streaming step from pure functions.

    embed(embed_params, batch) -> x; layer(layer_params, x) -> x (or
    layer(layer_params, x, batch) when it needs the batch, e.g. positions);
    head_loss(head_params, x, batch) -> summed loss. `params` is
    {"embed": ..., "layers": [one pytree per layer], "head": ...}. `options` are
    `build_engine`'s: clip_norm, prefetch_depth, saved_inputs, micro_batches,
    resident_layers, resident_embeddings, keep_layers, keep_weights, mesh, example_batch.
    """
    check_layers(params["layers"])
    example = {"embed": params["embed"], "layer": params["layers"][0], "head": params["head"]}
    return StreamingStep(build_engine(embed, layer, head_loss, optimizer, example, **options),
                         params)


def build_engine(embed: Callable, layer: Callable, head_loss: Callable,
                 optimizer: optax.GradientTransformation, example: dict, *,
                 clip_norm: float = 0.0, prefetch_depth: int = 2,
                 saved_inputs: str = "device", micro_batches: int = 1,
                 resident_layers: int = 0, resident_embeddings: bool = False,
                 keep_layers: int = 0, keep_weights: int = 0,
                 mesh: Mesh | int | None = None,
                 example_batch: dict | None = None) -> StreamEngine:
    """The engine around three pure functions (as `from_functions` takes them).

    `example` holds one part of each kind, {"embed", "layer", "head"} (arrays or
    ShapeDtypeStructs): with `example_batch`, the templates are traced with them once up front
    to refuse captured arrays. `clip_norm` > 0 clips the gradients' exact global norm. With
    `resident_layers=K`, the first K layers' parameters and optimizer state stay in GPU memory
    and update there, where the GPU has room for them; with `resident_embeddings=True`, the
    embed and head parts' too (the host then holds and updates the layers only). With
    `keep_layers=K`, the last K layers' forward keeps its matmuls' outputs on the GPU and
    their backward recomputes only the rest (one device; docs/guide.md). With
    `keep_weights=K`, the last K streamed layers before those keep the weights their forward
    fetched (over a mesh each device its shard) and their backward takes them instead of
    fetching them again. `mesh` (a `make_mesh(n)`,
    or n): data parallel over n devices, each batch's rows split over them and the host state
    sharded (stream/mesh.py); None or 1: one device.
    """
    if isinstance(mesh, int):
        mesh = make_mesh(mesh)
    layer3 = _with_batch(layer)

    def scaled_head(p, _embed_params, x, batch, denom):
        return head_loss(p, x, batch) / denom

    templates = Templates(embed, layer3, scaled_head, tied=False, normalizer=_normalizer)
    if example_batch is not None:
        x = jax.eval_shape(embed, example["embed"], example_batch)
        check_no_captured_arrays(layer3, example["layer"], x, example_batch, name="layer")
        check_no_captured_arrays(embed, example["embed"], example_batch, name="embed function")
        check_no_captured_arrays(head_loss, example["head"], x, example_batch, name="head loss")
    return StreamEngine(templates, optimizer, clip_norm=clip_norm,
                        prefetch_depth=prefetch_depth, saved_inputs=saved_inputs,
                        micro_batches=micro_batches, resident_layers=resident_layers, mesh=mesh,
                        keep_layers=keep_layers, keep_weights=keep_weights,
                        resident_embeddings=resident_embeddings)


def _with_batch(layer: Callable) -> Callable:
    """Accepts layer(p, x) or layer(p, x, batch); the engine always passes the batch."""
    try:
        takes_batch = len(inspect.signature(layer).parameters) >= 3
    except (TypeError, ValueError):
        takes_batch = False
    return layer if takes_batch else (lambda p, x, batch: layer(p, x))
