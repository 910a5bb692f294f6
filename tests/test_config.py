import json

import pytest

from megatrain_jax.config import (
    Config,
    ConfigError,
    from_dict,
    load_config,
    save_config,
    shipped_configs,
    to_dict,
)


def test_json_round_trip(tmp_path):
    cfg = load_config("tiny", ["model.layers=3", "optim.lr=0.01"])
    save_config(cfg, tmp_path / "c.json")
    assert load_config(str(tmp_path / "c.json")) == cfg
    assert from_dict(Config, to_dict(cfg)) == cfg


def test_overrides_are_typed():
    cfg = load_config("tiny", ["model.hidden=48", "optim.lr=1e-4", "model.tie_embeddings=true",
                               "model.rope_scaling.kind=llama3", "loop.trainer=reference"])
    assert cfg.model.hidden == 48 and isinstance(cfg.model.hidden, int)
    assert cfg.optim.lr == 1e-4
    assert cfg.model.tie_embeddings is True
    assert cfg.model.rope_scaling.kind == "llama3"
    assert cfg.loop.trainer == "reference"
    # an int is accepted for a float field
    assert load_config("tiny", ["optim.lr=1"]).optim.lr == 1.0


def test_gin_file(tmp_path):
    pytest.importorskip("gin")
    (tmp_path / "base.gin").write_text("model.hidden = 48\nmodel.heads = 4\n")
    (tmp_path / "run.gin").write_text(
        "include 'base.gin'\n"
        "# a comment\n"
        "model.layers = 3\n"
        "model.rope_scaling.kind = 'llama3'\n"
        "optim.lr = 2e-4\n"
        "loop.trainer = 'reference'\n"
    )
    cfg = load_config(str(tmp_path / "run.gin"), ["model.layers=5"])
    assert (cfg.model.hidden, cfg.model.layers, cfg.optim.lr) == (48, 5, 2e-4)
    assert cfg.model.rope_scaling.kind == "llama3"
    assert cfg.loop.trainer == "reference"


def test_gin_unknown_key_or_type_names_the_file_and_line(tmp_path):
    pytest.importorskip("gin")
    bad = tmp_path / "bad.gin"
    bad.write_text("include 'demo'\n\nmodel.layers = 3\noptim.lrr = 1e-3\n")
    with pytest.raises(ConfigError, match=f"^{bad}:4: Unknown config key 'optim.lrr'. Did "
                                          "you mean 'optim.lr'?"):
        load_config(str(bad))
    bad.write_text("model.layers = 'three'\n")
    with pytest.raises(ConfigError, match=f"^{bad}:1: model.layers: expected int, got str"):
        load_config(str(bad))
    bad.write_text("include 'nowhere.gin'\n")
    with pytest.raises(ConfigError, match=f"^{bad}:1: include: No config file 'nowhere.gin'"):
        load_config(str(bad))


def test_a_gin_file_includes_a_shipped_config_by_name(tmp_path, monkeypatch):
    """`include 'demo'` and the guide's `include 'configs/demo.json'` work from any folder,
    not only from a clone."""
    pytest.importorskip("gin")
    monkeypatch.chdir(tmp_path)
    for name in ("demo", "configs/demo.json"):
        (tmp_path / "mine.gin").write_text(f"include '{name}'\nloop.steps = 7\n")
        cfg = load_config("mine.gin")
        assert cfg.model == load_config("demo").model and cfg.loop.steps == 7


def test_json_base_extends(tmp_path):
    (tmp_path / "mine.json").write_text(json.dumps({"base": "7b", "model": {"layers": 4}}))
    cfg = load_config(str(tmp_path / "mine.json"))
    assert cfg.model.hidden == 4096 and cfg.model.layers == 4


@pytest.mark.parametrize("name", sorted(shipped_configs()))
def test_every_shipped_config_parses(name):
    cfg = load_config(name)
    assert cfg.model.num_params > 0


def test_shipped_shapes_match_published_sizes():
    sizes = {"3b": 3.14e9, "7b": 6.74e9, "14b": 13.0e9, "30b": 32.5e9, "llama3-8b": 8.03e9,
             "mistral-7b": 7.25e9, "qwen2.5-7b": 7.62e9, "llama3-70b": 70.55e9}
    for name, n in sizes.items():
        assert abs(load_config(name).model.num_params - n) / n < 0.005, name


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.hiden=3", "Unknown config key 'model.hiden'. Did you mean 'model.hidden'"),
        ("modle.hidden=3", "Unknown config key 'modle'"),
        ("model.hidden=abc", "model.hidden: expected int, got str"),
        ("model.hidden=1.5", "model.hidden: expected int, got float"),
        ("model.tie_embeddings=1", "expected bool"),
        ("model.compute_dtype=fp16", "not one of bfloat16, float32"),
        ("optim.name=adagrad", "not one of adamw, adam, lion, sgd"),
        ("model.kv_heads=3", "must be a multiple of model.kv_heads"),
        ("data.micro_batches=3", "divisible by data.micro_batches"),
        ("model.hidden", "not of the form section.key=value"),
        ("model.rope_scaling=2", "expected a mapping"),
        ("optim.name=sgd stream.update=host", "use stream.update=device"),
        ("stream.speculate_share=0", "stream.speculate_share (0.0) must be within (0, 1]"),
    ],
)
def test_clear_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config("tiny", override.split())


def test_missing_config_names_shipped_ones():
    with pytest.raises(ConfigError, match="Shipped configs: .*tiny"):
        load_config("no-such-config")


def test_invalid_json_names_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="broken.json is not valid JSON"):
        load_config(str(path))
