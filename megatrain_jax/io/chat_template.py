"""A tokenizer folder's chat template, found and rendered as transformers does it.

    template, source = find_chat_template(folder, settings)   # settings: tokenizer_config.json
    render = compile_chat_template(template)
    text = render(messages, special_tokens)                   # apply_chat_template(tokenize=False)
    prompt = render(messages, special_tokens, add_generation_prompt=True)   # to generate from

transformers keeps a folder's template in `chat_template.jinja` (what it saves since version
4.50), which takes priority over the `chat_template` entry of `tokenizer_config.json` (a
string, or a list of named templates of which `default` is used). Rendering follows its
`apply_chat_template`: a sandboxed Jinja environment with `trim_blocks` and `lstrip_blocks`,
the loop controls, its `tojson`, `raise_exception` and `strftime_now`, `{% generation %}`
blocks rendered as their content, `tools` and `documents` None, and the special tokens
(`bos_token`, `eos_token`, ...) as variables. Needs jinja2 (the `tokenizers` extra).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from megatrain_jax.config import ConfigError

TEMPLATE_FILE = "chat_template.jinja"


def find_chat_template(folder: Path, settings: dict) -> tuple[str | None, str]:
    """(the template, where it was found), or (None, why there is none)."""
    file = folder / TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8"), str(file)
    entry = settings.get("chat_template")
    if isinstance(entry, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
        entry = named.get("default")
    if isinstance(entry, str) and entry.strip():
        return entry, str(folder / "tokenizer_config.json")
    return None, f"none in {folder} ({TEMPLATE_FILE} or tokenizer_config.json)"


def _environment():
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ConfigError("the tokenizer has a chat template, which needs jinja2: "
                          "pip install 'megatrain-jax[tokenizers]'") from e

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: its content (transformers marks there
        what the assistant wrote; prepare finds that by rendering message by message)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_content"), [], [], body) \
                .set_lineno(lineno)

        def _content(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env, jinja2.exceptions.TemplateError


def compile_chat_template(template: str):
    """`render(messages, special_tokens) -> str`, raising ConfigError for a template that
    does not parse or refuses the messages."""
    env, template_error = _environment()
    try:
        compiled = env.from_string(template)
    except template_error as e:
        raise ConfigError(f"the tokenizer's chat template does not parse: {e}") from None

    def render(messages: list[dict], special_tokens: dict,
               add_generation_prompt: bool = False) -> str:
        try:
            return compiled.render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt,
                                   **special_tokens)
        except template_error as e:
            raise ConfigError(f"the chat template refuses these messages: {e}") from None

    return render
