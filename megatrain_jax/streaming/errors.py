"""Errors that name what the user called: the entry point, and the argument at fault.

    @entry_point(options=ENGINE_OPTIONS)
    def from_nnx_model(model, head_loss, optimizer, *, embed="embed", ..., **options): ...

An unknown keyword is refused before any work, naming the entry point, the nearest valid
name and every valid one; a TemplateError raised inside gets the entry point's name in front
(once: an entry point that calls another keeps the outer name).
"""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Callable, Iterable


class TemplateError(ValueError):
    """The layers or templates given cannot be streamed as they are; the message says why."""


def named(error: TemplateError, entry: str) -> TemplateError:
    """`error` with `entry()` in front of its message, unless it already names one."""
    if getattr(error, "entry", None):
        return error
    renamed = TemplateError(f"{entry}(): {error}")
    renamed.entry = entry
    return renamed


def check_keywords(entry: str, given: Iterable[str], valid: Iterable[str]) -> None:
    """Raises TypeError for the first keyword of `given` not in `valid`, naming `entry`."""
    valid = sorted(valid)
    for name in given:
        if name not in valid:
            near = difflib.get_close_matches(name, valid, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise TypeError(f"{entry}() got an unexpected keyword argument {name!r}{hint}; "
                            f"its keywords are {', '.join(valid)}")


def entry_point(options: Iterable[str] = ()) -> Callable:
    """Decorates a public entry point taking **options: checks the keywords it is given
    against its own and `options`, and names it in the TemplateErrors raised inside."""
    options = tuple(options)

    def decorate(fn: Callable) -> Callable:
        own = [p.name for p in inspect.signature(fn).parameters.values()
               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

        @functools.wraps(fn)
        def checked(*args, **kwargs):
            check_keywords(fn.__name__, kwargs, (*own, *options))
            try:
                return fn(*args, **kwargs)
            except TemplateError as error:
                if getattr(error, "entry", None):
                    raise
                raise named(error, fn.__name__) from error.__cause__

        return checked

    return decorate
