"""The optimizer sees each part in the whole model's layout, and is probed once for it.

The engine updates the model part by part (the embedding, each layer, the head), each with
its own Optax state. An Optax chain written for the whole model expects the whole model's
tree: a weight-decay mask given as a pytree of it, a mask function that looks at its arrays
(a stacked bias is 2-D), labels for `optax.multi_transform`. `viewed(optimizer, view)` hands
the chain each part *inside* the model's tree: the part's leaves at their paths (a stacked
layer's with its leading layer axis, of length 1), None everywhere else, which Optax skips.
A mask or label tree of the whole model then lines up with every part, as on the model.

What no view can fix is a transformation whose result depends on other parts' gradients:
`optax.clip_by_global_norm` sees one part's norm. `probe` runs the chain on a miniature of
the model (every leaf's shape cut to at most 3 per axis, the layer axis kept) once whole and
once part by part, over three steps of gradients whose scales differ from part to part and
from step to step, and refuses the optimizer when the two differ, naming the first leaf. It
also picks the form of the model's tree the chain accepts (NNX: the `nnx.Optimizer` form,
`nnx.split`'s, or a pure dict; Linen: the params as given).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.streaming.errors import TemplateError

# The gradients' scale of part k at probe step s is PROBE_SCALES[s][k % 3]: every global
# clip threshold from 1e-2 to 1e5 clips at some step, and parts' norms differ at every step.
PROBE_SCALES = ((1.0, 1e4, 1e-3), (1e-3, 1.0, 1e5), (1e2, 1e-2, 1.0))
PROBE_TOLERANCE = 1e-4


def _key(entry):
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return str(entry)


def key_paths(tree) -> list[tuple]:
    """Each leaf's path as a tuple of plain keys (dict keys, list indices, attribute
    names), in flattening order."""
    return [tuple(_key(e) for e in path) for path, _ in
            jax.tree_util.tree_flatten_with_path(tree)[0]]


@dataclasses.dataclass(frozen=True)
class ModelView:
    """The whole model's tree in one form, and where each part's leaves sit in it.

    `embed` and `head`: the whole tree's leaf index of each of the part's leaves (in the
    part's flattening order); `layers[i]`: layer i's; every layer is viewed where layer 0
    sits. `stacked`: layer leaves carry a leading layer axis in the whole tree."""

    form: object  # the whole tree's PyTreeDef in this form
    parts: dict  # {"embed", "layer", "head"}: the engine part's PyTreeDef
    embed: tuple
    layers: tuple
    head: tuple
    stacked: bool
    signatures: dict  # {"embed", "layer", "head"}: what tells the kinds of part apart
    raw: bool = False  # the kinds look alike: each part goes to the optimizer as it is

    def kind(self, part) -> str:
        kinds = [k for k, sig in self.signatures.items() if sig == signature(part)]
        if len(kinds) != 1:
            raise TemplateError(f"a part of structure {jax.tree.structure(part)} matches "
                                f"{kinds or 'none'} of the model's embed, layer and head")
        return kinds[0]

    def indices(self, kind: str) -> tuple:
        return {"embed": self.embed, "layer": self.layers[0], "head": self.head}[kind]

    def to_view(self, kind: str, part):
        """The part inside the whole tree: its leaves at their paths, None elsewhere."""
        leaves = [None] * self.form.num_leaves
        for index, leaf in zip(self.indices(kind), jax.tree.leaves(part)):
            leaves[index] = jnp.expand_dims(leaf, 0) if kind == "layer" and self.stacked \
                else leaf
        return jax.tree.unflatten(self.form, leaves)

    def from_view(self, kind: str, tree):
        leaves = jax.tree.leaves(tree, is_leaf=lambda x: x is None)
        mine = [leaves[i] for i in self.indices(kind)]
        if kind == "layer" and self.stacked:
            mine = [leaf[0] for leaf in mine]
        return jax.tree.unflatten(self.parts[kind], mine)

    def cut(self, leaves: list) -> dict:
        """The whole tree's leaves (in this form's order) as the engine's parts."""
        def part(kind, indices, layer=None):
            chosen = [leaves[i] if layer is None else leaves[i][layer] for i in indices]
            return jax.tree.unflatten(self.parts[kind], chosen)

        layers = ([part("layer", self.layers[0], i) for i in range(len(self.layers))]
                  if self.stacked else [part("layer", idx) for idx in self.layers])
        return {"embed": part("embed", self.embed), "layers": layers,
                "head": part("head", self.head)}

    def joined(self, parts: dict) -> list:
        """The inverse of `cut`: the whole tree's leaves from the engine's parts (NumPy)."""
        leaves = [None] * self.form.num_leaves
        for indices, part in ((self.embed, parts["embed"]), (self.head, parts["head"])):
            for i, leaf in zip(indices, jax.tree.leaves(part)):
                leaves[i] = leaf
        layer_leaves = [jax.tree.leaves(layer) for layer in parts["layers"]]
        if self.stacked:
            for j, i in enumerate(self.layers[0]):
                leaves[i] = np.stack([np.asarray(ls[j]) for ls in layer_leaves])
        else:
            for indices, ls in zip(self.layers, layer_leaves):
                for i, leaf in zip(indices, ls):
                    leaves[i] = leaf
        return leaves


def signature(part) -> tuple:
    """A part's structure, shapes and dtypes: how the wrapper tells which part it is given."""
    return (jax.tree.structure(part),
            tuple((tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(part)))


def model_view(form_tree, whole_paths: list[tuple], part_paths: dict, example: dict,
               stacked: bool) -> ModelView | None:
    """The view of one form of the model's tree, or None when its leaves do not line up
    with `whole_paths` (the model's leaf paths as plain keys). `part_paths`: {"embed",
    "head": [whole path of each leaf], "layers": [[...] per layer]}; `example`: one part of
    each kind, {"embed", "layer", "head"}. When two kinds have one signature (an embed and
    a head alike, say), the view is `raw`: the parts go to the optimizer as they are."""
    form_paths = key_paths(form_tree)  # a Variable node adds a key at the end: `.value`
    if len(form_paths) != len(whole_paths) or any(
            f[:len(w)] != w or len(f) > len(w) + 1 for f, w in zip(form_paths, whole_paths)):
        return None
    where = {path: i for i, path in enumerate(whole_paths)}
    index = lambda paths: tuple(where[p] for p in paths)  # noqa: E731
    signatures = {k: signature(v) for k, v in example.items()}
    return ModelView(jax.tree.structure(form_tree),
                     {k: jax.tree.structure(v) for k, v in example.items()},
                     index(part_paths["embed"]), tuple(index(p) for p in part_paths["layers"]),
                     index(part_paths["head"]), stacked, signatures,
                     raw=len(set(signatures.values())) < len(signatures))


def viewed(optimizer: optax.GradientTransformation, view: ModelView, kind: str | None = None):
    """`optimizer` applied to each part inside the model's tree (module docstring): the part
    of `kind`, or of the kind its signature tells; as it is for a `raw` view."""
    if view.raw:
        return optimizer
    kind_of = (lambda part: kind) if kind else view.kind

    def init(params):
        return optimizer.init(view.to_view(kind_of(params), params))

    def update(updates, state, params=None):
        part = kind_of(updates)
        whole = None if params is None else view.to_view(part, params)
        new, state = optimizer.update(view.to_view(part, updates), state, whole)
        return view.from_view(part, new), state

    return optax.GradientTransformation(init, update)


def _miniature(shapes: list, stacked_leaves: set, seed: int) -> list:
    rng = np.random.default_rng(seed)
    leaves = []
    for i, (shape, dtype) in enumerate(shapes):
        small = tuple(d if (k == 0 and i in stacked_leaves) else min(d, 3)
                      for k, d in enumerate(shape))
        leaves.append((rng.normal(size=small) * 0.5).astype(dtype)
                      if jnp.issubdtype(dtype, jnp.floating) else np.zeros(small, dtype))
    return leaves


def probe(optimizer: optax.GradientTransformation, views: list, shapes: list,
          names: list, fix: str) -> ModelView:
    """The first of `views` whose form `optimizer` accepts, once its updates part by part
    are checked against its updates of the whole miniature model (module docstring).
    `shapes`: (shape, dtype) of each of the whole tree's leaves; `names`: their paths, for
    messages; `fix`: what to do about a global transformation, for the message."""
    views = [v for v in views if v is not None]
    stacked = set(views[0].layers[0]) if views and views[0].stacked else set()
    leaves, errors, init = _miniature(shapes, stacked, seed=0), [], jax.jit(optimizer.init)
    for view in views:
        try:
            state = init(jax.tree.unflatten(view.form, leaves))
        except Exception as error:  # noqa: BLE001 - a form the chain refuses: try the next
            errors.append(error)
            continue
        _compare(optimizer, view, leaves, state, names, fix)
        return view
    raise TemplateError(f"optimizer: it cannot be applied to the model's parameters "
                        f"({type(errors[0]).__name__}: {errors[0]})") from errors[0]


def _compare(optimizer, view: ModelView, leaves: list, state, names: list, fix: str) -> None:
    """Three steps of the whole and of each part (compiled: one program per kind of part),
    their updates compared part by part."""
    rng, whole_update = np.random.default_rng(1), jax.jit(optimizer.update)
    flat = _in_order(view.cut(leaves))
    kinds = ["embed"] + ["layer"] * (len(flat) - 2) + ["head"]
    txs = {k: viewed(optimizer, view, k) for k in set(kinds)}  # told the kind: miniature
    init, update = ({k: jax.jit(getattr(tx, f)) for k, tx in txs.items()}  # parts may look
                    for f in ("init", "update"))                           # alike
    states = [init[k](p) for k, p in zip(kinds, flat)]
    for scales in PROBE_SCALES:
        grads = [jax.tree.map(lambda a, s=scales[k % 3]: (rng.normal(size=a.shape) * s)
                              .astype(a.dtype), p) for k, p in enumerate(flat)]
        whole_grads = view.joined(_as_parts(grads))
        updates, state = whole_update(jax.tree.unflatten(view.form, whole_grads), state,
                                      jax.tree.unflatten(view.form, leaves))
        updates = [np.asarray(u) for u in jax.tree.leaves(updates)]
        expected = _in_order(view.cut(updates))
        for k, (p, g) in enumerate(zip(flat, grads)):
            got, states[k] = update[kinds[k]](g, states[k], p)
            _same(got, expected[k], k, len(flat), view, names, fix)
        leaves = [a + u for a, u in zip(leaves, updates)]
        flat = _in_order(view.cut(leaves))


def _in_order(parts: dict) -> list:
    return [parts["embed"], *parts["layers"], parts["head"]]


def _as_parts(flat: list) -> dict:
    return {"embed": flat[0], "layers": flat[1:-1], "head": flat[-1]}


def _same(got, expected, k: int, count: int, view: ModelView, names: list, fix: str) -> None:
    kind = "embed" if k == 0 else "head" if k == count - 1 else "layer"
    where = "the embedding" if k == 0 else "the head" if k == count - 1 else f"layer {k - 1}"
    indices = view.layers[k - 1] if kind == "layer" else view.indices(kind)
    for index, a, b in zip(indices, jax.tree.leaves(got), jax.tree.leaves(expected)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        error = np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(b), initial=0.0), 1e-30)
        if error > PROBE_TOLERANCE:
            raise TemplateError(
                f"optimizer: its update of '{names[index]}' ({where}) computed part by part "
                f"differs from its update of the whole model (by {error:.2g} relative): a "
                "transformation in it depends on other parameters' gradients "
                "(optax.clip_by_global_norm, or another global transform), or it treats one "
                "layer unlike another. The step updates the embedding, each layer and the "
                f"head apart. {fix}")
