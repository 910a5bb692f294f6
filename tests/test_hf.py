"""Hugging Face import/export against `transformers` itself, one tiny random model per family."""

import dataclasses
import json
import re

import jax
import numpy as np
import pytest

from megatrain_jax import model
from megatrain_jax.cli import main
from megatrain_jax.config import ConfigError, load_config
from megatrain_jax.io import hf


class _Imported:
    """A module imported at its first use, not when the tests are collected (on every
    worker, torch takes seconds); a test that uses a missing one is skipped."""

    def __init__(self, name: str, reason: str | None = None):
        self._name, self._reason = name, reason

    def __getattr__(self, attr: str):
        return getattr(pytest.importorskip(self._name, reason=self._reason), attr)


torch = _Imported("torch", reason="the README's test command installs torch")
transformers = _Imported("transformers")

SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             rms_norm_eps=1e-6)
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
FAMILIES = {
    # name: (config class, model class, extra config)
    "llama2": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM",
                 {"rope_scaling": LLAMA31_ROPE, "rope_theta": 500000.0}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 64}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen2-untied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
}
TOKENS = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, 24))


def make_hf_model(family: str, folder, shard: str | None = None, init_std: float = 0.02):
    """A random model of `family`; a larger `init_std` makes its next token depend on the
    context more than on the last token (greedy text that does not repeat one token)."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    hf_model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(
        **SIZES, **extra, initializer_range=init_std, attn_implementation="eager"))
    with torch.no_grad():  # norms and biases start at 1 and 0; move them off that
        for p in hf_model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    kwargs = {"max_shard_size": shard} if shard else {}
    hf_model.save_pretrained(folder, **kwargs)
    return hf_model


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }} <|im_end|> "
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def write_tokenizer(folder, chat: bool = False) -> None:
    """A word-level tokenizer of the tiny models' vocabulary, "t0" … "t92" and three ChatML
    specials (eos <|im_end|>), with a chat template file where `chat`."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    words = [f"t{i}" for i in range(SIZES["vocab_size"] - len(specials))] + specials
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tok.save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                "bos_token": None, "unk_token": "t0"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    if chat:
        (folder / "chat_template.jinja").write_text(CHATML)


def hf_greedy(folder, ids, new_tokens: int, stop_ids) -> list[int]:
    """transformers' generate(do_sample=False) after prompt `ids`, its new tokens."""
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                          attn_implementation="eager")
    prompt = torch.tensor([list(ids)])
    out = m.eval().generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                            max_new_tokens=new_tokens, eos_token_id=sorted(stop_ids),
                            pad_token_id=0)
    new = out[0, len(ids):].tolist()
    return new[:-1] if new and new[-1] in stop_ids else new


def hf_logits(folder_or_model) -> np.ndarray:
    m = folder_or_model
    if not isinstance(m, torch.nn.Module):
        m = transformers.AutoModelForCausalLM.from_pretrained(
            folder_or_model, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return m.eval()(torch.tensor(TOKENS)).logits.numpy()


def fp32_config(folder):
    return load_config(None, [f"model.hf_path={folder}", "model.compute_dtype=float32",
                              "model.attention=xla", "data.seq_len=24"])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_matches_transformers_and_round_trips(family, tmp_path):
    source = tmp_path / "source"
    # One family is saved in several shards with an index, as large checkpoints are.
    reference = make_hf_model(family, source, shard="40KB" if family == "llama3.1" else None)
    if family == "llama3.1":
        assert (source / hf.INDEX).is_file()
    cfg = fp32_config(source)
    params = hf.load_params(source, cfg.model)
    ours = np.asarray(model.logits(params, TOKENS, cfg.model))
    expected = hf_logits(reference)
    assert np.max(np.abs(ours - expected)) <= 1e-4

    out = hf.save_params(params, cfg.model, tmp_path / "exported", source=source,
                         max_shard_bytes=30_000)
    assert (out / hf.INDEX).is_file()  # written in several shards
    assert np.max(np.abs(hf_logits(out) - expected)) <= 1e-4


@pytest.mark.parametrize("overrides", [[], ["model.qkv_bias=true", "model.tie_embeddings=true"],
                                       ["model.qk_norm=true", "model.head_dim=24"]])
def test_export_of_a_model_trained_from_scratch(overrides, tmp_path):
    cfg = load_config("tiny", ["model.compute_dtype=float32", "model.attention=xla",
                               "model.rope_scaling.kind=llama3", "model.rope_scaling.factor=4.0",
                               "model.rope_scaling.original_max_position=16", *overrides])
    params = model.init(cfg.model, jax.random.key(1))
    out = hf.save_params(params, cfg.model, tmp_path / "exported")
    ours = np.asarray(model.logits(params, TOKENS % cfg.model.vocab_size, cfg.model))
    m = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                          attn_implementation="eager")
    with torch.no_grad():
        theirs = m.eval()(torch.tensor(TOKENS % cfg.model.vocab_size)).logits.numpy()
    assert np.max(np.abs(ours - theirs)) <= 1e-4


def test_bfloat16_export_is_loadable_and_close(tmp_path):
    source = tmp_path / "source"
    reference = make_hf_model("qwen3", source)
    cfg = fp32_config(source)
    out = hf.save_params(hf.load_params(source, cfg.model), cfg.model, tmp_path / "bf16",
                         dtype="bfloat16", source=source)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert np.max(np.abs(hf_logits(out) - hf_logits(reference))) < 0.1


def test_stream_training_from_hf_then_cli_export(tmp_path, capsys):
    """Import into pinned_host, train, checkpoint, export with the CLI: transformers agrees."""
    from megatrain_jax.stream.placement import memory_kinds
    from megatrain_jax.train import initial_state, make_trainer, train

    source = tmp_path / "source"
    make_hf_model("llama3.1", source, init_std=0.3)  # greedy text that varies
    write_tokenizer(source)  # copied along by the export
    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"model.hf_path={source}", "model.compute_dtype=float32",
                             "model.attention=xla", "data.source=random", "data.seq_len=16",
                             "data.batch_size=2", "loop.steps=2", "loop.checkpoint_every=2",
                             f"loop.run_dir={run_dir}", "loop.progress=plain", "optim.lr=1e-2",
                             f"loop.export_dir={tmp_path / 'final'}"])
    state = initial_state(cfg, make_trainer(cfg))
    assert memory_kinds(state.params) == {"pinned_host"}
    on_device = lambda params: jax.tree.map(np.asarray, params)  # noqa: E731
    imported = np.asarray(model.logits(on_device(state.params), TOKENS, cfg.model))
    assert np.max(np.abs(imported - hf_logits(source))) <= 1e-4

    trained = train(cfg)["state"].params
    assert main(["export", str(run_dir), str(tmp_path / "out"), "--progress", "plain"]) == 0
    progress = capsys.readouterr().err
    assert "import 4/4  part head" in progress and "export 1/1  file model.safetensors" in progress
    assert re.search(r"init (\d+)/\1  part head optimizer state", progress), progress
    # step 1's speculative update, finished beside step 2: the parts it updated during the
    # backward ("early"), and those undone
    assert re.search(r"train 2/2 .*  early update \d+ parts, \d+ undone", progress), progress
    out = tmp_path / "out"
    assert (out / "tokenizer.json").is_file()
    ours = np.asarray(model.logits(on_device(trained), TOKENS, cfg.model))
    assert np.max(np.abs(ours - imported)) > 1e-3  # training moved the weights
    assert np.max(np.abs(hf_logits(out) - ours)) <= 1e-4
    # `sample` from the run's latest checkpoint writes what transformers' greedy generate
    # writes from the exported folder, token for token.
    from megatrain_jax.train import sample

    loaded = sample.load_model(run_dir)
    ids = sample.prompt_ids(loaded, "t40 t41")
    assert list(ids) == [40, 41]
    expected = hf_greedy(out, ids, 10, loaded.stop_ids)
    assert sample.generate(loaded, ids, 10) == expected and len(expected) >= 4
    assert main(["sample", str(run_dir), "t40 t41", "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out == loaded.tokenizer.decode(expected) + "\n"
    # loop.export_dir wrote the same final weights when training ended.
    assert np.max(np.abs(hf_logits(tmp_path / "final") - ours)) <= 1e-4
    assert train(cfg)["finished_before"]  # the same command again: nothing left to do
    with pytest.raises(ConfigError, match="loop.export_dir .* already exists"):
        train(dataclasses.replace(cfg, loop=dataclasses.replace(cfg.loop, steps=3)))


def test_sample_from_a_chat_model_folder_is_transformers_greedy(tmp_path):
    """A Qwen-style folder (biases, tied head) with a chat template: the prompt is what
    apply_chat_template gives, and greedy decoding with the KV cache is generate's."""
    from megatrain_jax.train import sample

    source = tmp_path / "qwen"
    make_hf_model("qwen2", source, init_std=0.3)
    write_tokenizer(source, chat=True)
    loaded = sample.load_model(source)
    ids = sample.prompt_ids(loaded, "t7 t8 t9")
    # (AutoTokenizer would pick Qwen2Tokenizer from config.json, not this tokenizer.json)
    hf_tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(source)
    rendered = hf_tokenizer.apply_chat_template([{"role": "user", "content": "t7 t8 t9"}],
                                                add_generation_prompt=True, tokenize=False)
    assert list(ids) == hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    new = sample.generate(loaded, ids, 12)
    assert new == hf_greedy(source, ids, 12, loaded.stop_ids) and len(new) >= 4


def test_mismatched_or_unsupported_checkpoints_name_what_differs(tmp_path):
    source = tmp_path / "source"
    make_hf_model("llama2", source)
    config_file = source / "config.json"
    original = json.loads(config_file.read_text())

    with pytest.raises(ConfigError, match=r"model.layers=3 differs from 2"):
        load_config(None, [f"model.hf_path={source}", "model.layers=3"])
    with pytest.raises(ConfigError, match="no such folder"):
        load_config(None, [f"model.hf_path={tmp_path / 'nowhere'}"])

    config_file.write_text(json.dumps({**original, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        fp32_config(source)
    config_file.write_text(json.dumps({k: v for k, v in original.items() if k != "hidden_size"}))
    with pytest.raises(ConfigError, match="no integer hidden_size"):
        fp32_config(source)
    config_file.write_text(json.dumps({**original, "hidden_act": "gelu"}))
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        fp32_config(source)

    config_file.write_text(json.dumps({**original, "intermediate_size": 96}))
    cfg = fp32_config(source)
    with pytest.raises(ConfigError, match=r"mlp.gate_proj.weight in .* has shape \[80, 64\]; "
                                          r"the config implies \[96, 64\]"):
        hf.load_params(source, cfg.model)

    config_file.write_text(json.dumps({**original, "num_hidden_layers": 3}))
    with pytest.raises(ConfigError, match=r"missing 9 tensors \(model.layers.2"):
        hf.load_params(source, fp32_config(source).model)

    config_file.write_text(json.dumps({**original, "model_type": "qwen2"}))
    with pytest.raises(ConfigError, match="missing 6 tensors .*q_proj.bias"):
        hf.load_params(source, fp32_config(source).model)

    assert main(["export", str(tmp_path / "not_a_run"), str(tmp_path / "out")]) == 2

    config_file.write_text(json.dumps(original))
    weights = source / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # truncated
    with pytest.raises(ConfigError, match="cannot read .*model.safetensors: SafetensorError"):
        hf.load_params(source, fp32_config(source).model)

    (source / "model.safetensors").unlink()
    config_file.write_text(json.dumps(original))
    with pytest.raises(ConfigError, match="neither model.safetensors nor"):
        hf.load_params(source, fp32_config(source).model)
