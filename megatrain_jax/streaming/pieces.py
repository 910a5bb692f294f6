"""A whole model's pieces, the step's templates made of them, and their check against the
model's own forward.

A piece is one module (or one method of a module) the step applies: the embedding pieces in
order, one block per layer, the head pieces in order, then the head loss. Its parameters sit
in one part of the engine: a head piece that is a method of a module inside an embedding
piece (`head=("norm", "wte.attend")`) takes the embedding's own parameters, which makes the
head tied to the embedding (the engine sums the gradient of both uses).

    embed, layer, head, checked = model_templates(embed_pieces, block, head_pieces,
                                                  head_loss, L, seed, block_args)
    check_against_model(stages, model_forward, inputs)     # refuses the first piece that
                                                           # differs from the model's own
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from megatrain_jax.streaming.block_args import call_args
from megatrain_jax.streaming.errors import TemplateError
from megatrain_jax.streaming.randomness import piece_key, without_rng_rows


@dataclasses.dataclass(frozen=True)
class Piece:
    """One module (or method) the step applies. `part` holds its parameters ("embed",
    "layer", "head"), under `key` (None: the whole layer part), then `subpath` (where a
    tied method's module sits inside an embedding piece). apply(params, x, key) -> x, where
    key is the piece's random key or None (a block's: apply(params, x, key, args, kwargs),
    its arguments after x); `method`: the module's method it calls (None: `__call__`)."""

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
                    num_layers: int, seed: int | None, block_args: Callable | None = None):
    """(embed, layer, head, checked) for build_engine: embed(p, batch), layer(p, x, batch,
    index) (index: the layer's, from the engine, for its key; without `seed`, layer(p, x,
    batch)), head(head_p, embed_p, x, batch) -> head_loss(outputs, batch) when the head is
    tied, else head(head_p, x, batch). The block is called with block_args(micro-batch)
    after x (block_args.py). `checked` is (layer(p, x, batch, call, index), call(batch)): the
    layer with its arguments given, for the check of captured arrays (a table block_args
    closes over is a constant input, not a parameter)."""

    def embed(p, batch):
        x = batch["inputs"]
        for j, piece in enumerate(embed_pieces):
            x = piece.apply(piece.params(p), x, piece_key(seed, batch, 0, j))
        return x

    def called(p, x, batch, call, index=None):
        key = None if index is None else piece_key(seed, batch, index + 1)
        return block.apply(p, x, key, *call)

    def layer(p, x, batch, index=None):
        return called(p, x, batch, call_args(block_args, batch), index)

    def head(p, embed_p, x, batch):
        for j, piece in enumerate(head_pieces):
            source = embed_p if piece.part == "embed" else p
            x = piece.apply(piece.params(source), x, piece_key(seed, batch, num_layers + 1, j))
        return head_loss(x, without_rng_rows(batch))

    checked = (called if seed is not None else lambda p, x, batch, call: called(p, x, batch,
                                                                                 call),
               lambda batch: call_args(block_args, batch))
    return (embed, layer if seed is not None else lambda p, x, batch: layer(p, x, batch),
            head if tied(head_pieces) else lambda p, x, batch: head(p, None, x, batch), checked)


def tied_hint(missing: str, head: list[str], tables: dict[str, int]) -> str:
    """What to name for a head piece `missing` that the model lacks, when the model has
    embedding tables ({module path: rows}): the head tied to the largest, by its method."""
    if not tables:
        return ""
    table = max(tables, key=tables.get)
    named = tuple(f"{table}.attend" if h == missing else h for h in head)
    return (f". If the model's head is its embedding table (tied: its __call__ ends in "
            f"self.{table}.attend(x)), name that method: head={named!r}")


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
                        compiled_forward: Callable | None = None,
                        blocks: str | None = None) -> None:
    """Refuses pieces whose composition differs from the model's own forward.

    `stages`: [(name, fn(params, x) -> x, params)], the step's forward from `inputs` (the
    blocks one stage, named `blocks`); `model_forward(inputs) -> (outputs, calls)`, the
    model's own, with `calls[name] = (input, output)` of the pieces it was seen to call
    (outside a transform, where values are concrete). `compiled_forward() -> outputs`, when
    given, is compared first with the stages compiled as one program: only when they differ
    are the model and the stages run step by step, and the first stage whose input, failure
    or output tells it apart is named, with the rows where it differs."""
    if compiled_forward is not None and _agree_compiled(stages, compiled_forward, inputs):
        return
    try:
        outputs, calls = model_forward(inputs)
    except Exception as error:  # noqa: BLE001 - any failure of the user's forward is reported
        raise TemplateError(f"the model's own forward on batch['inputs'] failed "
                            f"({type(error).__name__}: {error}). check_model=False skips this "
                            "check.") from error
    x, previous = inputs, None
    for name, fn, params in stages:
        seen = calls.get(name)
        if seen is not None and not _close(x, seen[0]):
            _refuse_input(name, previous, x, seen[0], blocks)
        try:
            y = fn(params, x)
        except Exception as error:  # noqa: BLE001 - the piece's own failure names it
            raise TemplateError(f"'{name}' fails on the output of "
                                f"{_named(previous)} ({type(error).__name__}: {error}). "
                                f"{FIX}") from error
        if seen is not None and not _close(y, seen[1]):
            raise TemplateError(f"'{name}' computes another function than the model's own "
                                f"'{name}' ({_where(y, seen[1])}). "
                                f"{_hint(name, blocks)}{FIX}")
        x, previous = y, name
    if not _close(x, outputs):
        raise TemplateError(
            f"the model's own forward differs from its pieces applied in order, "
            f"{' -> '.join(n for n, *_ in stages)} ({_describe(outputs)} vs {_describe(x)}, "
            f"{_where(x, outputs)}): its __call__ computes more than that, or otherwise. "
            f"{_hint(blocks, blocks)}{FIX}")


def _named(stage: str | None) -> str:
    return "batch['inputs']" if stage is None else f"'{stage}'"


def _where(a, b) -> str:
    """'relative difference 0.012, in rows 1, 3 of 4': how much and in which rows of the
    batch `a` differs from `b` (the rows past the tolerance)."""
    difference = _difference(a, b)
    if difference is None:
        return "of another shape or kind"
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    text = f"relative difference {difference:.3g}"
    if a64.ndim < 2 or len(a64) < 2:
        return text
    scale = max(float(np.max(np.abs(b64))), 1e-6)
    per_row = np.max(np.abs(a64 - b64).reshape(len(a64), -1), axis=1) / scale
    rows = np.flatnonzero(per_row > _tolerance(np.asarray(b)))
    listed = ", ".join(map(str, rows[:8])) + (", ..." if len(rows) > 8 else "")
    return f"{text}, in row{'s' if len(rows) > 1 else ''} {listed} of {len(a64)}"


def _hint(stage: str | None, blocks: str | None) -> str:
    if stage is None or stage != blocks:
        return ""
    return (f"For '{blocks}': a (path, module) pair must be built with the model's own "
            "settings (dtype, param_dtype, ...), and the arguments the model passes its "
            "blocks besides x must be what block_args=fn(batch) gives them. ")


def _refuse_input(name: str, previous: str | None, x, model_input, blocks: str | None):
    """Raises for a piece the model applies to something else than the previous piece's
    output: of another shape or dtype (not a chain), or of other values."""
    if _difference(x, model_input) is None or _describe(x) != _describe(model_input):
        raise TemplateError(f"the model applies '{name}' to {_describe(model_input)}, not to "
                            f"the output of {_named(previous)} ({_describe(x)}). {FIX}")
    raise TemplateError(
        f"the output of {_named(previous)} differs from what the model gives '{name}' "
        f"({_describe(x)}, {_where(x, model_input)}): the step's {_named(previous)} computes "
        f"another function than the model's. {_hint(previous, blocks)}{FIX}")


def slices(stack, num_layers: int, stacked: bool) -> list:
    """Each layer's parameters: the stack's slices, or the list's items."""
    if stacked:
        return [jax.tree.map(lambda a, i=i: a[i], stack) for i in range(num_layers)]
    return [stack[i] if i in stack else stack[str(i)] for i in range(num_layers)]
