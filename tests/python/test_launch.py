"""How a script is launched and how it ends: a launcher's ranks without a process group are
refused, naming the fix (Note [launched without a process group] in python/dpzero/zero.py),
never W one-rank runs; and the same script with the group trains as one run. Reference: the
launcher's own environment (torch.distributed.run sets WORLD_SIZE and RANK)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ranks import torchrun

pytestmark = pytest.mark.multirank

_SCRIPT = """
import os, sys, torch
import dpzero
from torch.utils.data import DataLoader, TensorDataset

if sys.argv[2] == "init":
    torch.distributed.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
if sys.argv[1] == "shard":
    sharded = dpzero.shard(model, stage=1)
    world = sharded.world_size
else:
    private = dpzero.make_private(model, data_loader=DataLoader(data, batch_size=16),
                                  noise_multiplier=1.0, max_grad_norm=1.0, seed=1,
                                  ledger_path=os.path.join(sys.argv[3], "run", "ledger.jsonl"))
    for x, y in private.data_loader:
        torch.nn.functional.cross_entropy(private.model(x), y).backward()
        private.optimizer.step()
        private.optimizer.zero_grad()
        break
    world = private.privacy_engine.world_size
rank = os.environ["RANK"]
with open(os.path.join(sys.argv[3], f"world.{rank}"), "w") as f:
    f.write(str(world))
"""


def _torchrun(tmp_path, entry, init):
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    return torchrun([script, entry, init, tmp_path], 2)


def test_ranks_launched_without_a_process_group_are_refused_naming_the_fix(tmp_path):
    # The launcher stops the other ranks as soon as one fails, so which ranks get as far as the
    # refusal is a race: at least one does, each names itself, and none trains. Both entries'
    # refusals at every rank are the next test's.
    out = _torchrun(tmp_path, "make_private", "no-init")
    assert out.returncode != 0
    refused = re.findall(r"dpzero\.make_private: this process is rank (\S+) of WORLD_SIZE=2",
                         out.stderr)
    assert refused and set(refused) <= {"0", "1"}, out.stderr[-3000:]
    assert "init_process_group" in out.stderr
    assert not list(tmp_path.glob("world.*"))
    assert not (tmp_path / "run").exists()  # no rank trained or charged alone


@pytest.mark.parametrize("entry", ["make_private", "shard"])
def test_every_rank_of_a_launch_is_refused_on_its_own(tmp_path, entry):
    # Each rank as its own process, in the environment the launcher gives it (torch.distributed.run
    # sets these variables), so no other rank's failure can stop it first.
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    ranks = []
    for rank in (0, 1):
        env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", RANK=str(rank),
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT="29500")
        ranks.append(subprocess.Popen([sys.executable, str(script), entry, "no-init",
                                       str(tmp_path)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    caller = "dpzero.make_private" if entry == "make_private" else "dpzero.shard"
    for rank, process in enumerate(ranks):
        _, stderr = process.communicate(timeout=300)
        assert process.returncode != 0
        assert f"{caller}: this process is rank {rank} of WORLD_SIZE=2" in stderr, stderr[-3000:]
    assert not list(tmp_path.glob("world.*"))
    assert not (tmp_path / "run").exists()


def test_the_same_script_with_a_process_group_is_one_run(tmp_path):
    out = _torchrun(tmp_path, "make_private", "init")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [(tmp_path / f"world.{r}").read_text() for r in (0, 1)] == ["2", "2"]
    from dpzero import Ledger
    assert Ledger.open_read_only(str(tmp_path / "run" / "ledger.jsonl")).total_steps == 1
