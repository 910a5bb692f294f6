import json
import subprocess
import sys

import pytest
from conftest import process_env

from megatrain_jax.cli import main
from megatrain_jax.config import load_config


def _run(*args, cwd=None):
    """The command in a process of its own, with the test session's compilation cache
    (conftest.py)."""
    return subprocess.run([sys.executable, "-m", "megatrain_jax.cli", *args], cwd=cwd,
                          env=process_env(), capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("trainer", ["stream", "reference"])
def test_train_tiny_end_to_end(tmp_path, trainer, capsys):
    """`megatrain-jax train tiny`: the streamed trainer in a process of its own, as a user
    starts it; the reference trainer through the same entry point in this one."""
    run_dir = tmp_path / "run"
    args = ("train", "tiny", f"loop.run_dir={run_dir}", f"loop.trainer={trainer}")
    if trainer == "stream":
        result = _run(*args)
        assert result.returncode == 0, result.stderr
        out, err = result.stdout, result.stderr
    else:
        assert main(list(args)) == 0
        out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["skipped_steps"] == 0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    record = json.loads(lines[-1])
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "skipped_steps", "host_rss_bytes"):
        assert key in record
    assert json.loads((run_dir / "config.json").read_text())["loop"]["trainer"] == trainer
    assert "train 3/3" in err  # plain progress lines when not on a terminal
    if trainer == "stream":  # the state built part by part: weights, then optimizer states
        assert "init 4/8  part head weights" in err
        assert "init 8/8  part head optimizer state" in err


def test_bad_override_fails_fast_with_the_key():
    result = _run("train", "tiny", "model.hiden=3")
    assert result.returncode == 2
    assert "Unknown config key 'model.hiden'" in result.stderr
    assert "Did you mean 'model.hidden'" in result.stderr


def test_help_is_useful(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "train" in text and "plan" in text and "section.key=value" in text
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "shipped config name" in capsys.readouterr().out


def test_overrides_may_follow_the_flags(capsys):
    assert main(["plan", "7b", "--host-gb", "125", "--gpu-gb", "140",
                 "optim.state_dtype=int8", "stream.resident_embeddings=off",
                 "stream.resident_layers=0"]) == 0
    out = capsys.readouterr().out  # every parameter's state on the host: 2.03 B/param
    assert "optimizer_state          12.75 GiB" in out
    assert "pinned by the config: stream.resident_layers=0, stream.resident_embeddings=off" \
        in out
    with pytest.raises(SystemExit):  # a stray flag is still refused
        main(["plan", "7b", "--host-gb", "125", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_plan_and_configs(capsys):
    assert main(["plan", "7b"]) == 0
    out = capsys.readouterr().out
    assert "6.74B parameters" in out and "master_weights" in out and "optimizer_state" in out
    assert main(["configs"]) == 0
    out = capsys.readouterr().out
    assert "llama3-70b" in out and " 70.55B " in out
    tiny_params = load_config("tiny").model.num_params
    tiny_line = next(line for line in out.splitlines() if line.startswith("tiny "))
    assert f"{tiny_params / 1e3:.1f}K" in tiny_line.split()  # it was "0.000B"


def test_report_command_errors_clearly(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_a_checkpoint_error_is_named_and_exits_3(tmp_path, capsys):
    """Any command's CheckpointError reaches the user as one line and exit status 3."""
    from megatrain_jax.config import load_config, save_config

    save_config(load_config("tiny"), tmp_path / "config.json")  # a run with no checkpoint
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 3
    err = capsys.readouterr().err
    assert err.startswith("megatrain-jax: checkpoint error:") and "kept no checkpoint" in err


def test_the_help_names_every_config_section():
    from megatrain_jax import cli
    from megatrain_jax.config import Config

    line = next(x for x in cli.EPILOG.splitlines() if x.startswith("Sections: "))
    named = line.removeprefix("Sections: ").split(" (")[0].split(", ")
    assert sorted(named) == sorted(Config.__dataclass_fields__)


def test_sample_refuses_bad_settings_and_folders_in_one_line(tmp_path, capsys):
    assert main(["sample", str(tmp_path), "hi", "--top-p", "0"]) == 2
    assert "sample --top-p=0.0 is out of range; give a probability in (0, 1]" in \
        capsys.readouterr().err
    assert main(["sample", str(tmp_path), "hi"]) == 2
    err = capsys.readouterr().err
    assert "neither a training run's folder" in err and len(err.splitlines()) == 1
