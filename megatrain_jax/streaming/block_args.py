"""A block's arguments besides x: what the model passes its blocks, and what the step passes.

Decoders call their blocks with more than the hidden states: a padding mask
(`block(x, keep)` with `keep = tokens != 0`), position ids, segment ids, a constant table.
The step calls the block as `block(x, *args)` with `args = block_args(micro_batch)` (or
`block(x, **kwargs)` when `block_args` returns a dict), the same in the forward and in the
backward's recompute; per-row arrays are the micro-batch's own rows, since `block_args`
computes them from it:

    step = from_nnx_model(model, loss, optax.adamw(3e-4), blocks="blocks",
                          block_args=lambda batch: (batch["inputs"] != 0,))

The model check (nnx_check.py, linen_check.py) watches the model's own call of its block in
one abstract trace (no computation: a model in host memory is checked too) and refuses,
naming the argument, a block the model calls with an argument the step would not pass, one
the step passes and the model does not, or one of another shape or dtype. The values are
then compared through the model's own forward on every row of the batch.
"""

from __future__ import annotations

import inspect
from typing import Callable

import jax
import numpy as np

from megatrain_jax.streaming.errors import TemplateError
from megatrain_jax.streaming.randomness import without_rng_rows

EXAMPLE = "e.g. block_args=lambda batch: (batch['inputs'] != 0,) for a padding mask"


def call_args(block_args: Callable | None, batch: dict) -> tuple[tuple, dict]:
    """The block's (positional, keyword) arguments after x for `batch` (a micro-batch)."""
    if block_args is None:
        return (), {}
    given = block_args(without_rng_rows(batch))
    if isinstance(given, dict):
        return (), dict(given)
    if isinstance(given, (tuple, list)):
        return tuple(given), {}
    raise TemplateError(f"block_args returned a {type(given).__name__}: it must return a tuple "
                        "of the block's arguments after x, in the order of its __call__, or a "
                        f"dict of them by name ({EXAMPLE})")


def shapes_of(tree):
    """`tree`'s arrays as ShapeDtypeStructs of no memory kind: an abstract trace of a model
    whose weights are in host memory then computes nothing there."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype)
                        if hasattr(a, "dtype") else a, tree)


def _describe(value) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{np.dtype(value.dtype).name}{list(value.shape)}"
    return repr(value)


def _is_default(value, param: inspect.Parameter) -> bool:
    """Whether passing `value` is the same as passing nothing (None, or the default)."""
    if value is None or hasattr(value, "shape") or param.default is param.empty:
        return value is None
    try:
        return bool(value == param.default)
    except Exception:  # noqa: BLE001 - a value that cannot be compared is an argument
        return False


def named_args(call_fn: Callable, args: tuple, kwargs: dict, who: str) -> dict:
    """{name: value} of the arguments after x in a call of `call_fn` (a block class's
    `__call__`), leaving out those that say nothing: None, or a default's own value."""
    signature = inspect.signature(call_fn)
    try:
        bound = signature.bind_partial(None, None, *args, **kwargs)  # self, x
    except TypeError as error:
        raise TemplateError(f"{who} does not fit the block's __call__{signature} ({error}): "
                            f"return its arguments after x ({EXAMPLE})") from None
    named = {}
    for name, value in list(bound.arguments.items())[2:]:
        param = signature.parameters[name]
        if param.kind is param.VAR_POSITIONAL:
            named.update({f"{name}[{i}]": v for i, v in enumerate(value) if v is not None})
        elif param.kind is param.VAR_KEYWORD:
            named.update({k: v for k, v in value.items() if v is not None})
        elif not _is_default(value, param):
            named[name] = value
    return named


def check_block_call(name: str, call_fn: Callable, model_call: tuple | None,
                     step_call: tuple) -> None:
    """Refuses a step that would call the block `name` with other arguments than the model
    does: `model_call` is the (args, kwargs) after x the model's own forward passed it (None:
    the model was not seen to call it), `step_call` what the step passes on the same rows."""
    if model_call is None:
        return
    seen = named_args(call_fn, *model_call, f"the model's call of '{name}'")
    given = named_args(call_fn, *step_call, "block_args")
    missing = [k for k in seen if k not in given]
    if missing:
        listed = ", ".join(f"{k} ({_describe(seen[k])})" for k in missing)
        raise TemplateError(
            f"the model calls '{name}' with {listed} besides x, and the step would call it "
            f"without: '{name}' would train as another function than the model's. Pass "
            "block_args=fn(batch) -> the block's arguments after x, computed from the "
            "micro-batch as the model's __call__ computes them (a tuple in the order of the "
            f"block's __call__, or a dict by name; {EXAMPLE}).")
    extra = [k for k in given if k not in seen]
    if extra:
        listed = ", ".join(f"{k} ({_describe(given[k])})" for k in extra)
        raise TemplateError(f"block_args gives '{name}' {listed}, which the model does not "
                            f"pass it: give only the arguments the model's __call__ passes "
                            f"its blocks ({', '.join(seen) or 'none besides x'}).")
    for k, value in seen.items():
        if _describe(value) != _describe(given[k]) and hasattr(value, "shape"):
            raise TemplateError(
                f"block_args gives '{name}' {k} as {_describe(given[k])}, the model passes "
                f"{_describe(value)}: compute it from the micro-batch as the model's __call__ "
                "does (the same rows, shape and dtype; a value the model's scan gives each "
                "layer apart cannot be passed).")
