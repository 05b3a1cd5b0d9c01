"""The emulated network (repro.netem): namespaces per rank, shaped links, nothing routed
out, everything removed afterwards; `repro netcheck`; runs on it; refusals in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from repro import netem
from repro.costmodel import Network


def _unavailable() -> str | None:
    try:
        netem.check_available()
    except netem.NetworkUnavailable as exc:
        return str(exc)
    return None


REASON = _unavailable()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no emulated network here: {REASON}")


def mine(tag: str) -> list[str]:
    return [n for n in netem.existing_namespaces() if n.startswith(tag)]


# -- refusals, without building anything ----------------------------------------------------
def test_not_root_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(netem, "_available", {})
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(netem.NetworkUnavailable, match="needs root") as info:
        netem.check_available()
    assert "\n" not in str(info.value) and "cluster.network=host" in str(info.value)


def test_missing_iproute2_is_refused_naming_the_package(monkeypatch):
    monkeypatch.setattr(netem, "_available", {})
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netem.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    with pytest.raises(netem.NetworkUnavailable, match="tc not found.*apt-get install iproute2"):
        netem.check_available()


@pytest.mark.parametrize("overrides,words", [
    (["cluster=simulated", "cluster.network=emulated"], ["cluster.mode=simulated", "spawn or torchrun"]),
    (["cluster.network=emulated", "cluster.nodes=2", "cluster.mode=torchrun", "cluster.workers=4"],
     ["cluster.nodes=2"]),
    (["cluster.latency_ms=2"], ["cluster.latency_ms=2", "cluster.network=emulated"]),
    (["cluster.network=emulated", "cluster.bandwidth_gbps=inf"], ["cluster.bandwidth_gbps=inf"]),
    (["cluster.network=wifi"], ["cluster.network", "host", "emulated"]),
])
def test_bad_network_settings_fail_before_any_worker(tmp_path, overrides, words):
    from repro import launch

    with pytest.raises(ValueError) as info:
        launch.train([*overrides, f"runs_root={tmp_path}"], out=lambda s: None)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)
    assert not os.listdir(tmp_path)


def test_an_unbuildable_network_refuses_the_run_before_any_folder(tmp_path, monkeypatch):
    from repro import launch

    monkeypatch.setattr(netem, "_available", {False: "cluster.network=emulated needs root (test)"})
    with pytest.raises(ValueError, match="needs root"):
        launch.train(["cluster.network=emulated", f"runs_root={tmp_path}"], out=lambda s: None)
    assert not os.listdir(tmp_path)


def test_emulated_link_model():
    net = Network.emulated_link(4, 1.0)
    assert net.bytes_per_s == pytest.approx(1e9 / 8 * 1448 / 1514)
    n = 100e6
    assert net.allreduce_s(n) == pytest.approx(2 * 3 * n / (4 * net.bytes_per_s))
    assert net.broadcast_s(n) == pytest.approx(3 * n / net.bytes_per_s)
    ring = Network(4, 1.0, 0.0)
    assert ring.broadcast_s(n) == pytest.approx(ring.allreduce_s(n) / 2)


# -- the network itself ----------------------------------------------------------------------
RECEIVER = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 5001)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = int(sys.argv[2]); got = 0; buf = bytearray(1 << 20); t0 = None
while got < n:
    k = c.recv_into(buf)
    if not k: break
    t0 = t0 or time.perf_counter(); got += k
print(got * 8 / (time.perf_counter() - t0) / 1e9)
"""
SENDER = """
import socket, sys
c = socket.create_connection((sys.argv[1], 5001)); data = b"x" * (1 << 20)
for _ in range(int(sys.argv[2]) >> 20): c.sendall(data)
c.close()
"""


@needs_netns
def test_a_link_carries_its_rate_and_nothing_is_left_afterwards():
    nbytes = 24 << 20
    with netem.emulated(2, 0.5) as net:
        tag = net.tag
        assert len(mine(tag)) == 3  # two ranks and the switch
        for rank in range(2):
            routes = subprocess.run(["ip", "-n", net.namespace(rank), "route"],
                                    capture_output=True, text=True, check=True).stdout
            assert "default" not in routes and routes.split()[0] == "10.77.0.0/24"
        recv = subprocess.Popen([*net.exec_prefix(1), sys.executable, "-c", RECEIVER,
                                 net.address(1), str(nbytes)], stdout=subprocess.PIPE, text=True)
        assert recv.stdout.readline().strip() == "ready"
        subprocess.run([*net.exec_prefix(0), sys.executable, "-c", SENDER, net.address(1),
                        str(nbytes)], check=True, timeout=60)
        gbps = float(recv.stdout.readline())
        recv.wait(timeout=30)
        payload_gbps = 0.5 * 1448 / 1514
        assert 0.75 * payload_gbps < gbps < 1.1 * payload_gbps  # shaped, on a busy host too
        # the host's own namespace holds none of the run's addresses, links or routes
        def host(*cmd: str) -> str:
            return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout

        addrs, links = host("ip", "-o", "addr"), host("ip", "-o", "link")
        routes = host("ip", "route", "show", "10.77.0.0/24")
        assert "10.77.0." not in addrs and routes.strip() == ""
        assert not any(f" {p}@" in links or f" {p}:" in links for p in ("p0", "p1", "br0"))
    assert mine(tag) == []
    assert not os.path.exists(os.path.join(netem.MARKER_DIR, f"{tag}.json"))


@needs_netns
def test_an_error_inside_the_block_removes_the_network():
    with pytest.raises(KeyError), netem.emulated(3, 1.0) as net:
        tag = net.tag
        raise KeyError("boom")
    assert mine(tag) == []


OWNER = """
import time
from repro import netem
net = netem.EmulatedNetwork(2, 1.0)
net.create()
print(net.tag, flush=True)
time.sleep(600)
"""


@needs_netns
def test_a_killed_owners_namespaces_are_removed_by_the_next_network():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    tag = owner.stdout.readline().strip()
    assert len(mine(tag)) == 3
    assert tag not in " ".join(netem.remove_leftovers())  # its owner still runs: kept
    assert len(mine(tag)) == 3
    owner.kill()  # SIGKILL: no clean-up of its own
    owner.wait()
    assert len(mine(tag)) == 3
    with netem.emulated(2, 1.0):
        assert mine(tag) == []  # the next network proved them leftovers and removed them


# -- netcheck --------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.distributed
@needs_netns
def test_netcheck_times_collectives_beside_the_model(tmp_path, capsys):
    from repro.cli import main

    out = tmp_path / "out.json"
    page = tmp_path / "netcheck.md"
    assert main(["netcheck", "--workers", "2", "--bandwidth-gbps", "1", "--sizes", "4M",
                 "--ops", "allreduce,broadcast", "--repeats", "2", "--json", str(out),
                 "--markdown", str(page)]) == 0
    text = capsys.readouterr().out
    assert "allreduce" in text and "broadcast" in text and "agree with the cost model" in text
    report = json.loads(out.read_text())
    cells = {c["op"]: c for c in report["cells"]}
    for op, cell in cells.items():
        assert cell["workers"] == 2 and cell["bandwidth_gbps"] == 1 and cell["bytes"] == 16_000_000
        assert len(cell["samples_s"]) == 2 and cell["projected_s"] > 0
        # 16 MB over a 1 Gbit/s link: ~0.14 s by the model. No round beats the link's rate
        # (the shaping is real), and the faster round is near the model (a busy machine
        # can slow one round, not both by much)
        fastest = min(cell["samples_s"]) / cell["projected_s"]
        assert 0.8 < fastest < 2.0, (op, cell)
    assert report["command"].startswith("repro netcheck") and "--json" in report["command"]
    md = page.read_text()
    assert "## allreduce" in md and "## broadcast" in md and "| 2 | 1 |" in md
    ratio = f"{cells['allreduce']['ratio']:.2f} [" in md
    assert ratio and cells["allreduce"]["bound"] in ("link", "host")


# -- runs on the emulated network -------------------------------------------------------------
RUN = ["compressor=topk", "compressor.ratio=0.05", "task=cifar10_mixer", "steps=3", "eval_every=0",
       "eval_batches=1", "logger=local", "logger.progress=false", "cluster.network=emulated",
       "cluster.bandwidth_gbps=1"]


@pytest.mark.slow
@pytest.mark.distributed
@needs_netns
def test_a_run_trains_over_the_emulated_link_and_records_it(tmp_path):
    """Under torchrun (one agent per rank's namespace); the spawned ranks of
    cluster=local_cpu train over the link in the SIGTERM test below."""
    from repro import launch
    from repro.logging import read_summary
    from repro.runs import load_run

    before = netem.existing_namespaces()
    (run_dir,) = launch.train([*RUN, "cluster=torchrun", "cluster.workers=3",
                               f"runs_root={tmp_path}"], out=lambda s: None)
    assert os.path.exists(os.path.join(run_dir, "DONE"))
    run = load_run(run_dir)
    assert run.cfg("cluster.network") == "emulated" and run.cfg("cluster.bandwidth_gbps") == 1
    assert "emu1g" in os.path.basename(run_dir)
    assert read_summary(run_dir)["samples_per_s"] > 0
    assert netem.existing_namespaces() == before


@pytest.mark.heavy
@pytest.mark.distributed
@needs_netns
def test_sigterm_to_the_launcher_removes_the_network_and_the_ranks(tmp_path):
    cmd = [sys.executable, "-m", "repro.cli", "train", *RUN, "steps=100000", "cluster=local_cpu",
           f"runs_root={tmp_path}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tag = f"{netem.PREFIX}{launcher.pid}x"
    deadline = time.monotonic() + 120
    metrics = None
    while time.monotonic() < deadline and metrics is None:
        time.sleep(0.5)
        found = [os.path.join(d, "metrics.jsonl") for d, _, files in os.walk(tmp_path)
                 if "metrics.jsonl" in files]
        if found and os.path.getsize(found[0]) > 0:
            metrics = found[0]
    assert metrics is not None, "the run did not start logging"
    assert len(mine(tag)) == 3
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=60)
    assert mine(tag) == []
    size = os.path.getsize(metrics)
    time.sleep(2)
    assert os.path.getsize(metrics) == size, "ranks kept training after the launcher ended"
