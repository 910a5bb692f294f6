"""The placement keys as the config gives them (stream.resident_layers, keep_layers,
keep_attention, keep_weights, recompute_inputs: `auto`, a word, or a count of layers) and the
checks of how their counts go with the model's layers, which schema.validate runs.

    pinned("3"), pinned("auto")          # 3, None
    placement_checks(cfg)                # [(ok, message), ...]

What the planner makes of them is planning/'s; these read what the user wrote.
"""

from __future__ import annotations


def pinned(value: str) -> int | None:
    """A placement key's count of layers where one is set (`3`), None where it is a word."""
    return int(value) if value.isdigit() else None


def layers_fetched_twice(cfg) -> int:
    """The layers whose weights the forward fetches and the backward fetches again, unless
    they keep them (stream.keep_weights): all but the resident and the saving layers, as
    far as they are set (a key left to the planner counts none)."""
    s = cfg.stream
    resident, saving = pinned(s.resident_layers) or 0, pinned(s.keep_layers) or 0
    return max(0, cfg.model.layers - saving - resident)


def placement_checks(cfg) -> list[tuple[bool, str]]:
    """(holds, the message naming the value and the fix) for each relation between the
    placement keys' counts and the model's layers."""
    m, s = cfg.model, cfg.stream
    fetched_twice = layers_fetched_twice(cfg)
    saving, attention = pinned(s.keep_layers) or 0, pinned(s.keep_attention) or 0
    return [
        ((pinned(s.resident_layers) or 0) <= m.layers,
         f"stream.resident_layers ({s.resident_layers}) must be within [0, model.layers = "
         f"{m.layers}]"),
        (not s.keep_weights.isdigit() or int(s.keep_weights) <= fetched_twice,
         f"stream.keep_weights ({s.keep_weights}) exceeds the {fetched_twice} layers "
         "fetched for their backward (model.layers less stream.keep_layers and "
         "stream.resident_layers); `on` keeps every one of them"),
        (saving <= m.layers,
         f"stream.keep_layers ({s.keep_layers}) must be within [0, model.layers = {m.layers}]"),
        (attention <= m.layers - saving,
         f"stream.keep_attention ({s.keep_attention}) exceeds the layers that do not save "
         f"their activations (model.layers less stream.keep_layers); `on` keeps every one"),
        # Layer 0's input is always saved: the runs of recomputed inputs start from it.
        ((pinned(s.recompute_inputs) or 0) < max(1, m.layers - saving - attention),
         f"stream.recompute_inputs ({s.recompute_inputs}) exceeds the layers that may "
         f"recompute their input: at most model.layers ({m.layers}) less stream.keep_layers, "
         "stream.keep_attention and one (layer 0 saves its input); or set it to auto or off"),
    ]
