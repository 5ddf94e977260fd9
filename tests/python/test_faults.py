"""Collective faults under the multi-rank private step: a rank that dies or hangs makes
the others fail with a clear error within the process group's timeout, never hang, and the error
says whether the step was charged. Real Gloo groups over loopback, ranks in separate processes."""

import os
import time

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import dpzero
import ranks
from dpzero import CollectiveError  # exported at the top level

from test_private import SeqNet, seq_data

pytestmark = pytest.mark.multirank

TIMEOUT_S = 4


def _rank_main(rank, world_size, store_path, out_path, fault, stage):
    # Never leaves the group's block normally: every way out is os._exit, as a dead rank or a
    # broken group would (no collective teardown).
    with ranks.gloo_group(rank, world_size, store_path, timeout_s=TIMEOUT_S):
        p = dpzero.make_private(SeqNet(), dataset=seq_data(), batch_size=8, noise_multiplier=1.0,
                                max_grad_norm=1.0, seed=5, zero_stage=stage)
        x, y = next(iter(p.data_loader))
        if rank == 1:
            if fault == "dies":
                os._exit(3)  # as kill -9 would: no cleanup, sockets closed by the OS
            time.sleep(120)  # hangs; the test kills it
            os._exit(0)
        outcome = {}
        t0 = time.monotonic()
        try:
            F.cross_entropy(p.model(x), y).backward()
            p.optimizer.step()
            outcome["result"] = "step taken"
        except CollectiveError as e:
            outcome["result"], outcome["error"] = "CollectiveError", str(e)
            outcome["charged"] = getattr(e, "charged", "no attribute")
        except Exception as e:  # noqa: BLE001 - what the test reports
            outcome["result"], outcome["error"] = type(e).__name__, str(e)
        outcome["seconds"] = time.monotonic() - t0
        outcome["charges"] = p.privacy_engine.charges
        # Written whole, then renamed: the test polls for out_path and reads it as soon as it exists
        # (a torch.save straight to out_path was once caught half-written: EOFError in CI).
        torch.save(outcome, out_path + ".part")
        os.replace(out_path + ".part", out_path)
        os._exit(0)  # the group is broken: leave without collective teardown


@pytest.mark.parametrize("fault", ["dies", "hangs"])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_dead_or_hung_rank_fails_the_others_within_the_timeout(tmp_path, fault, stage):
    out = str(tmp_path / "out.pt")
    ctx = mp.start_processes(_rank_main, args=(2, str(tmp_path / "store"), out, fault, stage),
                             nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    try:
        while not os.path.exists(out) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
            proc.join()
    assert os.path.exists(out), "rank 0 never finished: it hung"
    got = torch.load(out)
    if stage == 0:  # the first collective is the step's own agreement: CollectiveError
        assert got["result"] == "CollectiveError", got
    else:  # stage 3 all-gathers parameters first: the engine's wait (Note [collective failures])
        assert got["result"] == "DistBackendError", got
        assert got["error"].startswith("dpzero: all-gather"), got
        assert "on rank 0" in got["error"], got
    assert "a peer rank died, hung past the process group's timeout, or lost its " \
           "connection" in got["error"], got
    cause = "timed out" if fault == "hangs" else "connection"
    assert cause in got["error"].lower(), got  # the transport's own words are kept
    # within the process group's timeout (plus start-up slack), not forever
    assert got["seconds"] < TIMEOUT_S + 20, got
    assert got["charges"] == 0, got  # nothing charged: the failure came before the ledger
    if got["result"] == "CollectiveError":
        assert "rank 0 of 2, step 0" in got["error"], got
        assert "nothing was charged or applied" in got["error"], got
        assert got["charged"] is False, got  # the C++ charge state, as an attribute
