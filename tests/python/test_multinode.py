"""Two machines: two hosts made on this machine with network namespaces joined by a
veth pair, each running `torchrun --nnodes 2 --nproc-per-node 2` with the c10d rendezvous on
host A. The private job's 4 ranks talk across the veth (each namespace has only its loopback
and its end of the pair); the result must equal the same job's single-node 4-rank run.

Needs CAP_NET_ADMIN (`ip netns add`); CI runs as root in its sandbox, where it runs.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import dpzero
from dpzero.train import datasets

pytestmark = [pytest.mark.multirank,
              pytest.mark.skipif(not os.path.isdir(datasets.FASHION_DIR),
                                 reason="Debian package dataset-fashion-mnist not installed")]

PORT = 29531  # inside host A's fresh namespace: nothing else listens there


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def two_hosts():
    """{name: (namespace, interface, address)} of hosts A and B, removed afterwards."""
    tag = f"dpz{os.getpid() % 100000}"
    subnet = f"10.{77 + os.getpid() % 100}.{os.getpid() % 250}"
    hosts = {"A": (f"{tag}a", f"{tag}va", f"{subnet}.1"), "B": (f"{tag}b", f"{tag}vb",
                                                                 f"{subnet}.2")}
    made = []
    try:
        for ns, _, _ in hosts.values():
            out = _ip("netns", "add", ns, check=False)
            if out.returncode != 0:
                pytest.skip(f"cannot create network namespaces here: {out.stderr.strip()}")
            made.append(ns)
        (na, va, aa), (nb, vb, ab) = hosts["A"], hosts["B"]
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, dev, addr in hosts.values():
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
        yield hosts
    finally:
        for ns in made:  # deleting a namespace deletes its end of the pair, and so the pair
            _ip("netns", "del", ns, check=False)


def _write_config(path, run_dir):
    raw = {"model": {"kind": "cnn"}, "data": {"dataset": "fashion-mnist", "limit": 256},
           "privacy": {"noise_multiplier": 1.0, "accountant": "rdp", "secure_mode": False},
           "training": {"epochs": 1, "batch_size": 64, "max_physical_batch_size": 32,
                        "lr": 0.01, "world_size": 4, "zero_stage": 3, "baseline": False,
                        "timeout_s": 60},
           "output": {"dir": str(run_dir)}}
    path.write_text("\n".join(f"[{s}]\n" + "\n".join(f"{k} = {json.dumps(v)}"
                                                       for k, v in vals.items())
                              for s, vals in raw.items()) + "\n")


def _tx_bytes(ns, dev):
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/"
                          "tx_bytes"], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_two_nodes_of_two_ranks_equal_one_node_of_four(tmp_path, two_hosts):
    two = tmp_path / "two.toml"
    _write_config(two, tmp_path / "two-nodes")
    master = two_hosts["A"][2]
    before = {h: _tx_bytes(ns, dev) for h, (ns, dev, _) in two_hosts.items()}
    nodes = []
    for node, (ns, dev, addr) in enumerate(two_hosts.values()):
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
               "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={master}:{PORT}", "--rdzv-id=dpzero",
               f"--rdzv-conf=is_host={int(node == 0)},join_timeout=120",
               f"--local-addr={addr}", "-m", "dpzero.train.worker", str(two)]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": dev, "OMP_NUM_THREADS": "1"}
        nodes.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = []
    for proc in nodes:
        try:
            logs.append(proc.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for p in nodes:
                p.kill()
            raise
    for node, (proc, log) in enumerate(zip(nodes, logs)):
        assert proc.returncode == 0, f"node {node}:\n{log[-4000:]}"
    # The ranks of A and B reached each other over the veth pair, in both directions: far more
    # than the rendezvous alone (the model's gathers and reduce-scatters, some MB).
    for h, (ns, dev, _) in two_hosts.items():
        assert _tx_bytes(ns, dev) - before[h] > 1_000_000, h

    one = tmp_path / "one.toml"
    _write_config(one, tmp_path / "one-node")
    out = subprocess.run([sys.executable, "-m", "dpzero", "train", str(one)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    got = json.loads((tmp_path / "two-nodes" / "result.json").read_text())["private"]
    want = json.loads((tmp_path / "one-node" / "result.json").read_text())["private"]
    assert got["steps"] == want["steps"] == 4
    assert got["epsilon"] == want["epsilon"] and got["accuracy"] == want["accuracy"]
    ledgers = [dpzero.Ledger.open_read_only(str(tmp_path / d / "ledger.jsonl"))
               for d in ("two-nodes", "one-node")]
    assert [(r.first_step, r.q, r.sigma) for r in ledgers[0].records] == \
        [(r.first_step, r.q, r.sigma) for r in ledgers[1].records]
    sizes = [[json.loads(line).get("logical_batch_size")
              for line in (tmp_path / d / "private" / "diagnostics.jsonl").read_text()
              .splitlines()]
             for d in ("two-nodes", "one-node")]
    assert sizes[0] == sizes[1] and len(sizes[0]) == 5  # the header and 4 steps
    a, b = (torch.load(tmp_path / d / "model.pt") for d in ("two-nodes", "one-node"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
