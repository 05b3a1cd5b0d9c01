"""W&B runs laid out for dashboards (repro/logging.py): a smoke training run in offline
mode, read back from its .wandb file, carries the project, group, job_type, tags, name
and resolved config, its metrics under grouped names with `step` as their x-axis, and the
summary; `repro compare --metric` takes a metric by either of its names."""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import struct
import time

import pytest
import yaml

from repro import launch
from repro.cli import main
from repro.logging import WANDB_NAMES, metric_key, read_metrics, read_summary, wandb_name

GROUP = "dash-fig"
PROJECT = "dash-project"
TRAIN = ["compressor=topk", "compressor.ratio=0.001", "task=cifar10_resnet20", "task.size=smoke",
         "cluster=simulated", "cluster.workers=2", "cluster.threads_per_worker=1", "steps=2",
         "eval_every=0", "eval_batches=1", "logger=wandb_offline", "logger.progress=false",
         f"logger.project={PROJECT}", f"group={GROUP}"]

# The .wandb file: a 7-byte header, then LevelDB-log blocks of 32 KiB whose chunks
# (4-byte checksum, 2-byte length, 1-byte type) hold serialised Record protos.
FILE_HEADER = 7
BLOCK = 32768
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: str) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path} does not start with the W&B header"
    pos, pending, records = FILE_HEADER, b"", []
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + CHUNK_HEADER])
        pos += CHUNK_HEADER
        if (kind == 0 and length == 0) or pos + length > len(data):  # end, or still being written
            break
        chunk, pos = data[pos:pos + length], pos + length
        if kind in (FULL, FIRST):
            pending = b""
        pending += chunk
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(pending)
            records.append(rec)
    return records


def item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    pytest.importorskip("wandb")
    root = tmp_path_factory.mktemp("runs")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    mp.setenv("WANDB_DIR", str(root / "wandb-dir"))
    try:
        (run_dir,) = launch.train([*TRAIN, f"runs_root={root}"], out=lambda s: None)
    finally:
        mp.undo()
    # W&B's files under WANDB_DIR, as W&B's users set it; the run's id stays in its folder.
    assert os.path.exists(os.path.join(run_dir, "wandb", "run_id"))
    (path,) = glob.glob(os.path.join(root, "wandb-dir", "wandb", "offline-run-*", "run-*.wandb"))
    # W&B's service may still be writing the file when finish() returns: its last record
    # is the run's exit.
    deadline = time.monotonic() + 30
    while True:
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, f"{path} holds no exit record"
        time.sleep(0.2)
    by_kind: dict[str, list] = {}
    for rec in records:
        by_kind.setdefault(rec.WhichOneof("record_type"), []).append(rec)
    return run_dir, by_kind


@pytest.mark.slow
def test_run_carries_project_group_job_type_tags_name_and_config(trained):
    run_dir, by_kind = trained
    (run,) = [r.run for r in by_kind["run"]]
    assert os.path.basename(os.path.dirname(run_dir)) == GROUP  # runs/<group>/<name>
    assert run.project == PROJECT
    assert run.run_group == GROUP
    assert run.display_name == os.path.basename(run_dir)
    assert run.job_type == "topk"
    assert set(run.tags) == {"task:cifar10_resnet20", "size:smoke", "workers:2", "ratio:0.001",
                             "cluster:simulated"}
    config = {item_key(u): json.loads(u.value_json) for u in run.config.update}
    config.pop("_wandb", None)
    with open(os.path.join(run_dir, "config.yaml")) as f:
        saved = yaml.safe_load(f)
    assert config == saved  # the whole resolved config, nested as in config.yaml
    assert config["compressor"]["ratio"] == 0.001 and config["cluster"]["workers"] == 2


def test_history_rows_use_grouped_names_with_step(trained):
    run_dir, by_kind = trained
    rows = {}
    for rec in by_kind["history"]:
        row = {item_key(i): json.loads(i.value_json) for i in rec.history.item}
        rows[row["step"]] = row
    records = read_metrics(run_dir)
    assert sorted(rows) == [r["step"] for r in records] == [0, 1]
    for rec in records:
        row = rows[rec["step"]]
        for key, value in rec.items():
            if key in ("step", "wall_time") or value is None:
                continue
            assert row[wandb_name(key)] == pytest.approx(value), key
        user_keys = {k for k in row if not k.startswith("_")} - {"step"}
        assert all("/" in k for k in user_keys), sorted(user_keys)
        assert not user_keys & set(WANDB_NAMES), "a bare metrics.jsonl key reached W&B"
    last = rows[1]
    for name in ("train/loss", "train/lr", "train/step_s", "train/samples_per_s",
                 "comm/bytes_sent", "comm/time_s", "compress/time_s", "compress/khat_over_k",
                 "compress/density", "projected/step_s", "projected/samples_per_s"):
        assert name in last, f"{name} missing from the W&B row: {sorted(last)}"
    assert last["compress/khat_over_k"] == records[-1]["estimation_quality"]
    assert any(k.startswith("eval/") for k in last)  # the final evaluation


def test_step_is_the_x_axis_of_every_metric(trained):
    _, by_kind = trained
    metrics = [r.metric for r in by_kind["metric"]]
    assert any(m.name == "step" for m in metrics)
    assert any(m.glob_name == "*" and m.step_metric == "step" for m in metrics)


def test_summary_holds_the_final_values_under_the_same_names(trained):
    run_dir, by_kind = trained
    final: dict = {}
    for rec in by_kind["summary"]:
        for u in rec.summary.update:
            final[item_key(u)] = json.loads(u.value_json)
    summary = read_summary(run_dir)
    metric = summary["metric"]
    assert final[f"eval/{metric}"] == pytest.approx(summary[f"eval/{metric}"])
    assert final["eval/metric"] == metric
    assert final["train/steps"] == summary["steps"] == 2
    assert final["train/wall_time_s"] == pytest.approx(summary["wall_time_s"])
    assert final["train/training"] == summary["training"]
    last = read_metrics(run_dir)[-1]
    assert final["step"] == 1
    assert final["train/loss"] == pytest.approx(last["loss"])
    assert final["compress/khat_over_k"] == pytest.approx(last["estimation_quality"])


def test_names_map_both_ways():
    for key in ("loss", "estimation_quality", "comm_s", "eval/accuracy", "projected/step_s",
                "some_new_key", "step"):
        assert metric_key(wandb_name(key)) == key
    assert wandb_name("estimation_quality") == "compress/khat_over_k"
    assert wandb_name("some_new_key") == "train/some_new_key"
    assert wandb_name("projected/comm_s") == "projected/comm_s"
    assert metric_key("compress/khat_over_k") == "estimation_quality"
    assert metric_key("estimation_quality") == "estimation_quality"


@pytest.mark.slow
def test_compare_takes_a_metric_by_either_name(trained, tmp_path, capsys):
    run_dir, _ = trained
    outputs = {}
    for name in ("compress/khat_over_k", "estimation_quality"):
        out = str(tmp_path / name.replace("/", "_"))
        assert main(["compare", run_dir, "--out", out, "--metric", name,
                     "--metric", "train/lr"]) == 0
        with open(os.path.join(out, "table.csv")) as f:
            outputs[name] = f.read()
        assert os.path.exists(os.path.join(out, "lr_vs_step.png"))
    assert outputs["compress/khat_over_k"] == outputs["estimation_quality"]
    (columns,) = csv.DictReader(io.StringIO(outputs["estimation_quality"]))
    records = read_metrics(run_dir)
    assert float(columns["last estimation_quality"]) == records[-1]["estimation_quality"]
    assert float(columns["last lr"]) == records[-1]["lr"]
    capsys.readouterr()
    assert main(["compare", run_dir, "--out", str(tmp_path / "bad"), "--metric", "comm/nothing"]) == 2
    assert "comm/nothing" in capsys.readouterr().err
