"""What `plan` answers, line by line: each memory line its own verdict, the refusal's numbers
those of the placement it shows, parameter counts, whose rates the figures are, why a
budget does not fit, how long N tokens take, and what a save costs."""

import re

import pytest

from megatrain_jax.cli import main
from megatrain_jax.config import ConfigError, load_config
from megatrain_jax.planning import memory, planner, presets, staging
from megatrain_jax.planning.optimizer_state import model_state_bytes
from megatrain_jax.tools import plan, plan_time

GiB = 2**30
BOX = ["--host-gb", "125", "--gpu-gb", "141"]  # the H200 box


def test_each_memory_line_has_its_own_verdict(capsys):
    assert main(["plan", "14b", "--host-gb", "64", "--gpu-gb", "80"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"host memory: 64.00 GiB, [\d.]+ GiB needed -> does NOT fit", out)
    assert re.search(r"GPU memory: 76.00 GiB of 80.00 GiB \(XLA's share\), [\d.]+ GiB needed "
                     r"-> fits", out)  # the host's verdict was printed for both


def test_a_refusal_names_the_resident_layers_of_the_placement_it_shows(capsys):
    assert main(["plan", "14b", "--host-gb", "64", "--gpu-gb", "80"]) == 1
    captured = capsys.readouterr()
    shown = sum(int(n) for n in re.findall(r"\((\d+)\)\s+resident", captured.out))
    assert f"the GPU holds {shown} of its 40 layers' state" in captured.err  # not the most


def test_plan_counts_a_small_model_in_millions(capsys):
    assert main(["plan", "demo"]) == 0
    assert capsys.readouterr().out.startswith("1.7M parameters, 4 layers")  # was 0.00B


def test_without_a_gpu_plan_and_train_say_the_figures_are_an_h200s(capsys, monkeypatch):
    monkeypatch.setattr(plan, "gpu_name", lambda: None)  # a CPU machine
    assert main(["plan", "demo"]) == 0
    out = capsys.readouterr().out
    assert "rates (preset H200: no GPU here, the figures are for an H200" in out
    assert "what this engine takes on an H200)" in out
    assert "the figures are for an H200" in plan.placement_summary(plan.resolved(
        load_config("demo")))  # train's first line
    monkeypatch.setattr(plan, "gpu_name", lambda: "NVIDIA H200")
    assert plan.preset_label() == "preset H200"


def test_budgets_say_why_a_row_does_not_fit_and_the_readme_example_runs(capsys):
    assert main(["plan", "7b", "--budgets", "24,48,80", "--host-gb", "16"]) == 1
    out = capsys.readouterr().out
    assert "each budget's size, as none is known here" in out or "GiB usable" in out
    assert re.search(r"\n\s+24  does not fit: the host needs [\d.]+ GiB of 16.0", out)
    assert main(["plan", "7b", "--budgets", "24,48,80", *BOX]) == 0  # as the README has it
    out = capsys.readouterr().out
    rows = re.findall(r"\n\s+(24|48|80)\s+\d+\s+\d+\s+\d+\s+\d+\s+[\d,]+ /", out)
    assert rows == ["24", "48", "80"]


def test_tokens_take_the_time_the_expected_speed_implies_and_saves_cost_their_share(capsys):
    assert main(["plan", "7b", "loop.checkpoint_every=100", "--tokens", "1e9", *BOX]) == 0
    out = capsys.readouterr().out
    est = plan.estimate(load_config("7b", ["loop.checkpoint_every=100"]),
                        plan.usable_gpu_bytes(141 * GiB), 125 * GiB)
    cfg = est["config"]
    no_clip, clip = plan_time.expected_tokens_per_s(cfg, plan.machine_rates(cfg), 1)
    assert (f"1,000,000,000 tokens on 1 GPU at 16,384 tokens a step: "
            f"{plan_time.duration(1e9 / no_clip)} where steps do not clip") in out
    assert f"{plan_time.duration(1e9 / clip)} where every step clips" in out
    # The save: the whole state staged on this box, its stall and write, their share.
    assert cfg.stream.save_staging == "whole" and est["host"]["save_staging"] == \
        staging.checkpoint_bytes(cfg)
    cost = staging.save_cost(cfg, presets.PRESETS["H200"])
    step = 16384 / no_clip
    assert f"a save stalls the run {cost['stall']:.1f} s" in out
    assert f"every 100 steps the saves cost {cost['stall'] / (100 * step):.1%}" in out
    assert "host memory: 125.00 GiB" in out and "-> fits" in out


def test_the_staging_area_is_what_the_host_has_room_for():
    cfg = load_config("14b")
    parts = staging.part_bytes(cfg)
    assert sum(parts) == 4 * cfg.model.num_params + model_state_bytes(cfg)
    assert staging.decide(cfg, None) == "whole"
    assert staging.decide(cfg, sum(parts)) == "whole"
    layer = parts[1]
    assert staging.decide(cfg, 3 * layer + 1) == "3"
    assert staging.decide(cfg, 1) == "0"  # no room for a part: each is written from the state
    quiet = memory.replaced(cfg, "loop", final_checkpoint=False, stop_save=False)
    assert staging.staged_bytes(quiet) == 0 and staging.decide(quiet, 1) == "whole"
    # 14b fills the box: the planner stages as many layers as the rest leaves room for.
    run = plan.resolved(cfg, plan.usable_gpu_bytes(141 * GiB), 125 * GiB)
    k = int(run.stream.save_staging)
    placed = planner.host_total(run, memory.plan_of(run), 1)
    assert 1 <= k < cfg.model.layers and placed <= 125 * GiB
    assert staging.staged_bytes(run) == sum(sorted(parts, reverse=True)[:k])
    assert placed + parts[1] > 125 * GiB  # one more layer would not have fit


def test_a_refusal_says_when_the_staging_area_is_what_is_missing():
    """A host with room for everything but one part's copy: the planner stages none (each
    part written from the state); a staging area set by hand is what does not fit."""
    cfg = load_config("14b")
    gpu = plan.usable_gpu_bytes(141 * GiB)
    quiet = memory.replaced(cfg, "loop", final_checkpoint=False, stop_save=False)
    budget = planner.gpu_budget(quiet, gpu)
    grid = planner._candidates(quiet, budget, 1)
    need = grid["host_total"][grid["device_total"] <= budget - memory.HEADROOM].min()
    one = memory.replaced(cfg, "stream", save_staging="1")
    with pytest.raises(ConfigError, match="it is the save's staging area .* that does not fit"):
        plan.check_fits(one, need + GiB, gpu)
    plan.check_fits(quiet, need + GiB, gpu)
    plan.check_fits(cfg, need + GiB, gpu)
    assert plan.resolved(cfg, gpu, need + GiB).stream.save_staging == "0"


def test_120b_at_full_precision_fits_one_h200_with_1536_gib_and_a_refusal_names_the_bytes(
        capsys):
    """fp32 weights, fp32 AdamW: the moments live beside the pinned pool (none of its 1/32
    bookkeeping) and the save writes each part from the state itself (no staging copy)."""
    one = ["--gpu-gb", "141"]
    assert main(["plan", "120b", "--host-gb", "1536", *one]) == 0
    out = capsys.readouterr().out
    host = {k: float(v) for k, v in re.findall(r"^  (\w+) +([\d.]+) GiB$",
                                               out.split("device:")[0], re.M)}
    cfg = load_config("120b")
    assert cfg.optim.state_dtype == "float32" and cfg.optim.name == "adamw"
    assert host["optimizer_state"] == pytest.approx(8 * 104.4e9 / GiB, rel=0.1)
    pooled = host["master_weights"] + host["gradients"] + host["saved_inputs"]
    assert host["pool_bookkeeping"] == pytest.approx((pooled + host["pool_margin"]) / 32,
                                                     abs=0.01)
    assert "save_staging" not in host and "stream.save_staging=0" in out
    assert host["total"] <= 1536 and "host memory: 1536.00 GiB" in out
    assert main(["plan", "120b", "--host-gb", "1400", *one]) == 1
    err = capsys.readouterr().err
    needs = float(re.search(r"needs ([\d.]+) GiB of host memory", err).group(1))
    assert needs == pytest.approx(host["total"], rel=0.01) and "1400.0 GiB is" in err
    # Eight H200s hold 52 layers' state: a host of 965 GiB takes the rest.
    assert main(["plan", "120b", "mesh.data=8", "--host-gb", "965", *one]) == 0
    assert main(["plan", "120b", "mesh.data=8", "--host-gb", "963", *one]) == 1
    # The moments in the pool again: its bookkeeping of them does not fit.
    capsys.readouterr()
    assert main(["plan", "120b", "stream.plain_optimizer_state=false", "--host-gb", "1536",
                 *one]) == 1
    assert "pool_bookkeeping" in capsys.readouterr().out
