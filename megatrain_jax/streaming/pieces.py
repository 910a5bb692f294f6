"""A whole model's pieces, the step's templates made of them, and their check against the
model's own forward.

A piece is one module (or one method of a module) the step applies: the embedding pieces in
order, one block per layer, the head pieces in order, then the head loss. Its parameters sit
in one part of the engine: a head piece that is a method of a module inside an embedding
piece (`head=("norm", "wte.attend")`) takes the embedding's own parameters, which makes the
head tied to the embedding (the engine sums the gradient of both uses).

    embed, layer, head = model_templates(embed_pieces, block, head_pieces, head_loss, L, seed)
    check_against_model(stages, model_forward, inputs)     # refuses the first piece that
                                                           # differs from the model's own
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from megatrain_jax.streaming.errors import TemplateError
from megatrain_jax.streaming.randomness import piece_key, without_rng_rows


@dataclasses.dataclass(frozen=True)
class Piece:
    """One module (or method) the step applies. `part` holds its parameters ("embed",
    "layer", "head"), under `key` (None: the whole layer part), then `subpath` (where a
    tied method's module sits inside an embedding piece). apply(params, x, key) -> x, where
    key is the piece's random key or None; `method`: the module's method it calls (None:
    `__call__`)."""

    name: str
    part: str
    key: str | None
    subpath: tuple
    apply: Callable
    method: str | None = None

    def params(self, part_params):
        node = part_params if self.key is None else part_params[self.key]
        for k in self.subpath:
            node = node[k]
        return node


def model_templates(embed_pieces: list, block: Piece, head_pieces: list, head_loss: Callable,
                    num_layers: int, seed: int | None):
    """(embed, layer, head) for build_engine: embed(p, batch), layer(p, x, batch, index)
    (index: the layer's, from the engine, for its key; without `seed`, layer(p, x, batch)),
    head(head_p, embed_p, x, batch) -> head_loss(outputs, batch) when the head is tied,
    else head(head_p, x, batch)."""

    def embed(p, batch):
        x = batch["inputs"]
        for j, piece in enumerate(embed_pieces):
            x = piece.apply(piece.params(p), x, piece_key(seed, batch, 0, j))
        return x

    def layer(p, x, batch, index=None):
        return block.apply(p, x, None if index is None else piece_key(seed, batch, index + 1))

    def head(p, embed_p, x, batch):
        for j, piece in enumerate(head_pieces):
            source = embed_p if piece.part == "embed" else p
            x = piece.apply(piece.params(source), x, piece_key(seed, batch, num_layers + 1, j))
        return head_loss(x, without_rng_rows(batch))

    return (embed, layer if seed is not None else lambda p, x, batch: layer(p, x, batch),
            head if tied(head_pieces) else lambda p, x, batch: head(p, None, x, batch))


def tied(head_pieces: list) -> bool:
    return any(piece.part == "embed" for piece in head_pieces)


def concrete(*values) -> bool:
    """Whether every array in `values` has a value (not a tracer of a transform)."""
    try:
        jax.tree.map(np.asarray, values)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return False
    return True


def _tolerance(a) -> float:
    return 1e-4 if np.dtype(a.dtype).itemsize >= 4 else 3e-2


def _difference(a, b) -> float | None:
    """max|a - b| / max|b|, or None when their shapes or kinds differ."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or (a.dtype.kind == "f") != (b.dtype.kind == "f"):
        return None
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(b), initial=0.0), 1e-6))


def _close(a, b) -> bool:
    error = _difference(a, b)
    return error is not None and error <= _tolerance(np.asarray(b))


def _describe(a) -> str:
    a = np.asarray(a)
    return f"{a.dtype}{list(a.shape)}"


FIX = ("The step applies the pieces in order, each to the previous one's output: name the "
       "pieces the model's __call__ applies, in order; wrap modules it combines otherwise "
       "(token and position embeddings added together) in one module; build (path, module) "
       "pairs with the model's own settings. check_model=False skips this check.")


def _agree_compiled(stages: list, compiled_forward: Callable, inputs) -> bool:
    """Whether the stages, compiled as one program, give the compiled forward's outputs
    (a failure of either: no, and the step by step run will say why)."""
    fns = [fn for _, fn, _ in stages]

    def composed(params, x):
        for fn, p in zip(fns, params):
            x = fn(p, x)
        return x

    try:
        return _close(jax.jit(composed)([p for *_, p in stages], inputs), compiled_forward())
    except Exception:  # noqa: BLE001 - diagnosed by the run step by step
        return False


def check_against_model(stages: list, model_forward: Callable, inputs,
                        compiled_forward: Callable | None = None) -> None:
    """Refuses pieces whose composition differs from the model's own forward.

    `stages`: [(name, fn(params, x) -> x, params)], the step's forward from `inputs` (the
    blocks one stage); `model_forward(inputs) -> (outputs, calls)`, the model's own, with
    `calls[name] = (input, output)` of the pieces it was seen to call (outside a transform,
    where values are concrete). `compiled_forward() -> outputs`, when given, is compared
    first with the stages compiled as one program: only when they differ are the model and
    the stages run step by step, and the first stage whose input, failure or output tells
    it apart is named."""
    if compiled_forward is not None and _agree_compiled(stages, compiled_forward, inputs):
        return
    try:
        outputs, calls = model_forward(inputs)
    except Exception as error:  # noqa: BLE001 - any failure of the user's forward is reported
        raise TemplateError(f"the model's own forward on one row of batch['inputs'] failed "
                            f"({type(error).__name__}: {error}). check_model=False skips this "
                            "check.") from error
    x, previous = inputs, "batch['inputs']"
    for name, fn, params in stages:
        seen = calls.get(name)
        if seen is not None and not _close(x, seen[0]):
            raise TemplateError(f"the model applies '{name}' to {_describe(seen[0])}, not to "
                                f"the output of {previous} ({_describe(x)}). {FIX}")
        try:
            y = fn(params, x)
        except Exception as error:  # noqa: BLE001 - the piece's own failure names it
            raise TemplateError(f"'{name}' fails on the output of {previous} "
                                f"({type(error).__name__}: {error}). {FIX}") from error
        if seen is not None and not _close(y, seen[1]):
            raise TemplateError(f"'{name}' computes another function than the model's own "
                                f"'{name}' (relative difference {_difference(y, seen[1])}). "
                                f"{FIX}")
        x, previous = y, f"'{name}'"
    if not _close(x, outputs):
        raise TemplateError(
            f"the model's own forward differs from its pieces applied in order, "
            f"{' -> '.join(n for n, *_ in stages)} ({_describe(outputs)} vs {_describe(x)}, "
            f"relative difference {_difference(x, outputs)}): its __call__ computes more "
            f"than that. {FIX}")


def slices(stack, num_layers: int, stacked: bool) -> list:
    """Each layer's parameters: the stack's slices, or the list's items."""
    if stacked:
        return [jax.tree.map(lambda a, i=i: a[i], stack) for i in range(num_layers)]
    return [stack[i] if i in stack else stack[str(i)] for i in range(num_layers)]
