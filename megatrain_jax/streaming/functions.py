"""The streaming step from pure functions: the layer every other entry point builds on.

    step = streaming.from_functions(
        embed=lambda p, batch: p["table"][batch["inputs"]],      # -> x [B, S, D]
        layer=lambda p, x: x + jnp.tanh(x @ p["w"]),             # one layer template
        head_loss=lambda p, x, batch: jnp.sum((x @ p["out"] - batch["y"]) ** 2),
        params={"embed": ..., "layers": [...], "head": ...},
        optimizer=optax.adamw(1e-3), mask_key=None,              # no mask: divide by rows
    )
    state = step.init_state()
    state, metrics = step.train_step(state, batch)

The loss contract (contract.py): `head_loss` returns the loss *summed* over the micro-batch
(or its mean, with reduction="mean"); the step divides by the batch's denominator, the sum of
`batch[mask_key]` (default "mask") or `normalizer(batch)`, or its rows with mask_key=None, so
the loss is a mean over the whole batch and micro-batches add up exactly. It is checked on
one row of `example_batch` at construction, or of the first batch before the first step.

All layers must share one structure and shapes (that is what lets one compiled template
serve every layer); a layer that differs, or a template that closes over arrays (which would
be baked into the compiled function instead of trained), is refused with a message that
says which. The optimizer sees each part inside `params` (optimizer_view.py): a mask over
the whole of `params` applies, and a transformation that needs the whole model's gradients
(clip_by_global_norm: use clip_norm=) is refused.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from megatrain_jax.stream import StreamEngine, StreamState, Templates
from megatrain_jax.stream.mesh import make_mesh
from megatrain_jax.streaming.contract import LossContract, check_loss, counted_row, doubled
from megatrain_jax.streaming.errors import TemplateError, entry_point, named
from megatrain_jax.streaming.optimizer_view import key_paths, model_view, probe, viewed


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
                f"{first}. Every layer must be the same template.")
        paths = jax.tree_util.tree_flatten_with_path(layer)[0]
        for (path, a), (shape, dtype) in zip(paths, spec):
            if (a.shape, a.dtype) != (shape, dtype):
                raise TemplateError(
                    f"layer {i} parameter {jax.tree_util.keystr(path)} is {a.dtype}{list(a.shape)}"
                    f" but layer 0 has {dtype}{list(shape)}. Every layer must have equal shapes.")


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
            "function and never trained. Pass them in through the parameters instead.")


@dataclasses.dataclass
class StreamingStep:
    """A streaming engine together with the parameters it starts from. `checks`, when
    the entry point had no example batch, run once on the first batch, before any work."""

    engine: StreamEngine
    params: dict
    checks: list = dataclasses.field(default_factory=list)
    entry: str = "from_functions"

    def init_state(self) -> StreamState:
        """Host-resident parameters and optimizer state (pinned_host; resident layers on
        the GPU)."""
        return self.engine.state_from_params(self.params)

    def train_step(self, state: StreamState, batch: dict) -> tuple[StreamState, dict]:
        run_checks(self, batch)
        return self.engine.train_step(state, batch)


def run_checks(step, batch: dict) -> None:
    """Runs and clears the step's pending checks on `batch`, naming its entry point."""
    try:
        for check in step.checks:
            check(batch)
    except TemplateError as error:
        raise named(error, step.entry) from None
    step.checks = []


ENGINE_OPTIONS = ("clip_norm", "prefetch_depth", "saved_inputs", "micro_batches",
                  "resident_layers", "resident_embeddings", "keep_layers", "keep_weights",
                  "mesh", "example_batch", "mask_key", "normalizer", "reduction")


def clip_fix(entry: str) -> str:
    """What to do about a global transformation in the chain, for the probe's message."""
    return (f"Take global clipping out of the chain and pass {entry}(..., clip_norm=<max "
            "norm>): the step clips by the exact norm of the whole model's gradients.")


@entry_point(options=ENGINE_OPTIONS)
def from_functions(embed: Callable, layer: Callable, head_loss: Callable, params: dict,
                   optimizer: optax.GradientTransformation, **options) -> StreamingStep:
    """A streaming step from pure functions.

    embed(embed_params, batch) -> x; layer(layer_params, x) -> x (or
    layer(layer_params, x, batch) when it needs the batch, e.g. positions);
    head_loss(head_params, x, batch) -> summed loss. `params` is
    {"embed": ..., "layers": [one pytree per layer], "head": ...}. `options` are
    `build_engine`'s (ENGINE_OPTIONS).
    """
    check_layers(params["layers"])
    example = {"embed": params["embed"], "layer": params["layers"][0], "head": params["head"]}
    checks = pending_checks([template_checks(embed, _with_batch(layer), head_loss, example,
                                             contract_of(options))],
                            options.pop("example_batch", None))
    optimizer = params_view(optimizer, params, "from_functions")
    engine = build_engine(embed, layer, head_loss, optimizer, example, **options)
    return StreamingStep(engine, params, checks, "from_functions")


def pending_checks(checks: list, example_batch: dict | None) -> list:
    """The checks left for the first batch: none once they ran on `example_batch` (first
    of all, before the optimizer's probe and the engine)."""
    if example_batch is None:
        return checks
    for check in checks:
        check(example_batch)
    return []


def params_view(optimizer, params: dict, entry: str):
    """The optimizer seeing each part inside `params` ({"embed", "layers", "head"}), probed;
    a HostAdamW (megatrain's own in-place update) as it is."""
    if not isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    paths = key_paths(params)
    split = lambda prefix: [p for p in paths if p[:len(prefix)] == prefix]  # noqa: E731
    part_paths = {"embed": split(("embed",)), "head": split(("head",)),
                  "layers": [split(("layers", i)) for i in range(len(params["layers"]))]}
    example = {"embed": params["embed"], "layer": params["layers"][0], "head": params["head"]}
    view = model_view(params, paths, part_paths, example, stacked=False)
    shapes = [(a.shape, a.dtype) for a in jax.tree.leaves(params)]
    names = [".".join(map(str, p)) for p in paths]
    return viewed(optimizer, probe(optimizer, [view], shapes, names, clip_fix(entry)))


def contract_of(options: dict) -> LossContract:
    return LossContract(options.get("mask_key", "mask"), options.get("normalizer"),
                        options.get("reduction", "sum"))


def build_engine(embed: Callable, layer: Callable, head_loss: Callable,
                 optimizer: optax.GradientTransformation, example: dict, *,
                 clip_norm: float = 0.0, prefetch_depth: int = 2,
                 saved_inputs: str = "device", micro_batches: int = 1,
                 resident_layers: int = 0, resident_embeddings: bool = False,
                 keep_layers: int = 0, keep_weights: int = 0,
                 mesh: Mesh | int | None = None, example_batch: dict | None = None,
                 mask_key: str | None = "mask", normalizer: Callable | None = None,
                 reduction: str = "sum", tied: bool = False,
                 layer_index: bool = False) -> StreamEngine:
    """The engine around three pure functions (as `from_functions` takes them).

    `example` holds one part of each kind, {"embed", "layer", "head"} (arrays or
    ShapeDtypeStructs): with `example_batch`, the templates are checked on one row of it up
    front (captured arrays, the loss contract). `mask_key`, `normalizer`, `reduction`: the
    loss contract (contract.py). `tied`: head_loss(head_params, embed_params, x, batch), the
    embedding's gradient the sum of both uses. `layer_index`: layer(p, x, batch, index).
    `clip_norm` > 0 clips the gradients' exact global norm. With
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
    contract = LossContract(mask_key, normalizer, reduction)
    layer3 = layer if layer_index else _with_batch(layer)
    head4 = head_loss if tied else _untied(head_loss)

    def scaled_head(p, embed_params, x, batch, denom):
        return contract.scaled(head4(p, embed_params, x, batch), batch, denom)

    templates = Templates(embed, layer3, scaled_head, tied=tied,
                          normalizer=contract.denominator, layer_index=layer_index)
    if example_batch is not None:
        template_checks(embed, layer3, head_loss, example, contract, tied,
                        layer_index)(example_batch)
    return StreamEngine(templates, optimizer, clip_norm=clip_norm,
                        prefetch_depth=prefetch_depth, saved_inputs=saved_inputs,
                        micro_batches=micro_batches, resident_layers=resident_layers, mesh=mesh,
                        keep_layers=keep_layers, keep_weights=keep_weights,
                        resident_embeddings=resident_embeddings)


def template_checks(embed: Callable, layer: Callable, head_loss: Callable, example: dict,
                    contract: LossContract, tied: bool = False, layer_index: bool = False,
                    layer_inputs: Callable | None = None) -> Callable:
    """check(batch): the templates on one row of `batch`: no captured arrays, and a head
    loss that keeps the contract. `layer(p, x, batch[, index])`, head_loss as build_engine
    takes it; run on random head weights, no real ones needed. With `layer_inputs(batch)`,
    the layer is checked as layer(p, x, batch, layer_inputs(batch)[, index]): what that
    function closes over is an input (a block's constant table), not a parameter."""
    index = (jnp.int32(0),) if layer_index else ()
    head = head_loss if tied else _untied(head_loss)

    def check(batch: dict) -> None:
        row = counted_row(batch, contract)  # one whose loss counts (its mask is not all 0)
        x = jax.eval_shape(embed, example["embed"], row)
        check_no_captured_arrays(embed, example["embed"], row, name="embed function")
        layer_fn, inputs = ((layer, ()) if layer_inputs is None else
                            _given(layer, layer_inputs(row)))
        check_no_captured_arrays(layer_fn, example["layer"], x, row, *inputs, *index,
                                 name="layer")
        check_no_captured_arrays(head, example["head"], example["embed"], x, row,
                                 name="head loss")

        @jax.jit
        def once_and_twice(row, rows):  # one program; the weights made on the device
            head_p, embed_p, x1 = (_varied_like(t, seed) for seed, t in
                                   enumerate((example["head"], example["embed"], x)))
            return (head(head_p, embed_p, x1, row),
                    head(head_p, embed_p, jnp.concatenate([x1, x1]), rows))

        check_loss(*once_and_twice(row, doubled(row)), row, contract)

    return check


def _given(layer: Callable, inputs) -> tuple[Callable, tuple]:
    """(fn(p, x, batch, arrays, *index), (arrays,)): `layer(p, x, batch, inputs, *index)`
    with the arrays among `inputs` passed as arguments, its other values (flags) as they are."""
    leaves, treedef = jax.tree.flatten(inputs)
    is_array = [hasattr(a, "shape") for a in leaves]

    def fn(p, x, batch, arrays, *index):
        given = iter(arrays)
        values = [next(given) if array else a for a, array in zip(leaves, is_array)]
        return layer(p, x, batch, jax.tree.unflatten(treedef, values), *index)

    return fn, ([a for a, array in zip(leaves, is_array) if array],)


def _varied_like(tree, seed: int):
    """Small arrays shaped like `tree` whose entries differ (floats, within ±0.5; zeros for
    other dtypes). A sine of the entry's index, not random numbers: the check's program
    then compiles in a fraction of the time a random-number generator takes."""
    def fill(a, leaf: int):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            return jnp.zeros(a.shape, a.dtype)
        index = jnp.arange(math.prod(a.shape), dtype=jnp.float32)
        phase = 0.5 * seed + 0.25 * leaf
        return (0.5 * jnp.sin(index * 0.7548776662 + phase)).reshape(a.shape).astype(a.dtype)

    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [fill(a, i) for i, a in enumerate(leaves)])


def _untied(head_loss: Callable) -> Callable:
    return lambda p, _embed_params, x, batch: head_loss(p, x, batch)


def _with_batch(layer: Callable) -> Callable:
    """Accepts layer(p, x) or layer(p, x, batch); the engine always passes the batch."""
    try:
        takes_batch = len(inspect.signature(layer).parameters) >= 3
    except (TypeError, ValueError):
        takes_batch = False
    return layer if takes_batch else (lambda p, x, batch: layer(p, x))
