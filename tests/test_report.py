"""Watching a run: metrics per step, the timeline, TensorBoard files, `report`, the bar."""

import io
import json
import sys
from pathlib import Path

import pytest
from conftest import tiny

from megatrain_jax.io.progress import Progress
from megatrain_jax.stream import speculation
from megatrain_jax.tools.report import ReportError, report
from megatrain_jax.train import train

FIELDS = ("loss", "lr", "grad_norm", "skipped_steps", "tokens_per_s", "mfu",
          "peak_device_bytes", "host_rss_bytes", "host_rss_now_bytes", "time_forward_backward_s",
          "time_wait_update_s", "time_wait_d2h_s")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("run")
    cfg = tiny("model.layers=3", "loop.steps=5", "loop.log_every=1", f"loop.run_dir={path}",
               "loop.timeline_step=3", "loop.progress=none", "stream.speculate=on",
               "optim.clip_norm=0")  # every part but the embedding updated during the backward
    with pytest.MonkeyPatch.context() as patch:  # every speculative update runs, none dropped
        patch.setattr(speculation, "DROP_LATE_SPECULATION", False)
        train(cfg)
    return path


def test_metrics_have_every_field_every_step(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        assert set(FIELDS) <= set(r), set(FIELDS) - set(r)
        assert r["time_forward_backward_s"] > 0
    # from step 2 on, the host update of the step before overlapped this one
    assert all(r["time_update_s"] > 0 for r in records[1:])
    assert [r["speculated_parts"] for r in records[1:]] == [4] * 4  # 3 layers and the head
    assert [r["speculating"] for r in records] == [1.0] * 5  # each step's own update
    assert all(r["undone_parts"] == 0 for r in records[1:])  # no clipping: all stand


def test_timeline_shows_every_layer_on_every_lane(run_dir):
    timeline = json.loads((run_dir / "timeline.json").read_text())
    assert timeline["step"] == 3 and timeline["layers"] == 3
    names = {(b["lane"], b["name"]) for b in timeline["bars"]}
    for i in range(3):
        assert {("compute", f"forward {i}"), ("compute", f"backward {i}"),
                ("d2h", f"layer {i} grad"), ("h2d", f"layer {i}"),
                ("host update", f"layer {i}")} <= names
    for b in timeline["bars"]:  # only the last step's update may have begun before the step
        assert b["start"] <= b["end"] and (b["start"] >= 0 or "last step's" in b["name"]), b
    assert ("host update", "layer 2 (last step's)") in names  # it overlapped this forward


def test_tensorboard_event_files(run_dir):
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_report_writes_valid_pngs_and_a_summary(run_dir):
    import matplotlib.image

    written, lines = report(run_dir)
    assert {p.name for p in written} == {"loss.png", "speed.png", "memory.png", "timeline.png"}
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width, _ = matplotlib.image.imread(path).shape
        assert height > 100 and width > 100
    text = "\n".join(lines)
    assert "steps 5" in text and "tokens/s" in text and "timeline of step 3" in text
    assert "peak GPU: not reported (no GPU)" in text  # the CPU reports no device memory
    assert "last attempt's run time" in text and "save stalls" in text and "goodput" in text
    assert ("speculative update: 4 of 5 logged steps updated 16 parts early (during their "
            "backward), 0 undone") in text


def test_timeline_labels_fit_their_bars_and_never_overlap(run_dir):
    from megatrain_jax.tools.report import label_positions

    bars = json.loads((run_dir / "timeline.json").read_text())["bars"]
    extent = max(b["end"] for b in bars) - min(b["start"] for b in bars)
    for char in (extent / 400, extent / 60):  # a wide figure, a narrow one
        for lane in {b["lane"] for b in bars}:
            mine = [b for b in bars if b["lane"] == lane]
            spans = sorted((m - (len(n) + 1) * char / 2, m + (len(n) + 1) * char / 2, n)
                           for m, n in label_positions(mine, char))
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
            for left, right, name in spans:  # inside a bar of that name
                assert any(b["name"] == name and b["start"] <= left and right <= b["end"]
                           for b in mine)
        assert len(label_positions(bars, extent / 400)) > len(label_positions(bars, extent / 60))


def test_report_names_what_is_missing(tmp_path):
    with pytest.raises(ReportError, match="metrics.jsonl does not exist"):
        report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2,\n')
    with pytest.raises(ReportError, match="metrics.jsonl:2 is not valid JSON"):
        report(tmp_path)


def test_progress_is_plain_lines_without_a_terminal():
    out = io.StringIO()
    bar = Progress(4, "auto", stream=out, plain_every=2)
    for step in range(1, 5):
        bar.update(step, {"loss": 1.5, "tok/s": 1000.0, "mfu": 0.4})
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines == [line for line in lines if "\r" not in line and "\x1b" not in line]
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"]
    assert "loss 1.5" in lines[-1] and "mfu 0.4" in lines[-1] and "eta" in lines[-1]


def test_progress_bar_on_a_terminal_redraws_one_line():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    bar = Progress(3, "auto", stream=out)
    for step in range(1, 4):
        bar.update(step, {"loss": 1.0})
    bar.close()
    assert out.getvalue().count("\r") == 3 and out.getvalue().count("\n") == 1


def test_skipped_steps_are_counted_between_log_lines(tmp_path, monkeypatch):
    from megatrain_jax.train import loop as train_module

    batch_at = train_module.TokenSource.batch_at

    def poisoned(self, step):
        batch = batch_at(self, step)
        if step == 1:  # not a logged step with log_every=3
            batch["mask"][0, 0] = float("nan")
        return batch

    monkeypatch.setattr(train_module.TokenSource, "batch_at", poisoned)
    cfg = tiny("loop.steps=3", "loop.log_every=3", f"loop.run_dir={tmp_path}",
               "loop.progress=none", "loop.timeline_step=-1")
    summary = train(cfg)
    assert summary["skipped_steps"] == 1
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3 and last["skipped_steps"] == 1


def test_resident_memory_splits_into_heap_and_mapped_files():
    """The parts /proc reports add up to the process's resident memory now, and a new heap
    buffer shows in `anon` (Linux; elsewhere nothing is reported)."""
    import numpy as np

    from megatrain_jax.train.machine import host_rss_now_bytes, host_rss_parts_bytes

    before = host_rss_parts_bytes()
    if not before:
        pytest.skip("no /proc/self/status here")
    assert sum(before.values()) == pytest.approx(host_rss_now_bytes(), rel=0.05)
    buffer = np.ones(64 * 2**20, np.uint8)  # 64 MiB, touched
    after = host_rss_parts_bytes()
    assert after["anon"] - before["anon"] >= 60 * 2**20
    del buffer


def test_the_gpu_peak_is_the_fullest_device_s(monkeypatch):
    """Over a mesh, the memory record and the benchmarks take the device that peaked highest,
    not device 0 alone."""
    import jax

    from megatrain_jax.train import machine

    class Device:
        def __init__(self, peak):
            self.stats = {"peak_bytes_in_use": peak, "bytes_in_use": peak // 2}

        def memory_stats(self):
            return self.stats

    monkeypatch.setattr(jax, "local_devices", lambda: [Device(5), Device(9), Device(7)])
    assert machine.peak_device_bytes() == 9
    assert machine.memory_record()["device_bytes_now"] == 4


def test_benchmarks_flag_timed_steps_still_getting_faster():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from common import still_falling

    # call X4F (RESULTS.md, 2026-11-26): four GPUs first on a fresh machine, then one GPU
    assert still_falling([2.87, 2.60, 2.28, 2.03, 2.41, 2.06, 2.18, 2.01])
    assert not still_falling([1.73, 1.75, 1.70, 1.84, 1.74, 1.75, 1.74, 1.73])
    assert not still_falling([2.60, 2.05, 1.80])  # too few to tell
