"""Sharded checkpoints (src/checkpoint/, dpzero.checkpoint) over real Gloo ranks.

The model, batches, optimizer settings, single-process reference and tolerances are
test_zero.py's: a run resumed from a checkpoint must continue like the uninterrupted run, to the
fp32 summation-order tolerance of test_zero (LOSS_TOL, PARAM_TOL) when the world size changes the
summation order, and bit for bit when it does not.

What is checked against what:
- resume across world size and stage (W=4 stage 3 → W=2 stage 2, SGD-momentum and AdamW) against
  the uninterrupted 20-step single-process torch.optim run;
- resume at the same W and stage against the uninterrupted sharded run, bitwise, every stage;
- every checkpoint loaded into every stage at W ∈ {1, 2, 4} against the checkpoint's content as
  an independent reader sees it (read_checkpoint: json + zlib.crc32 + torch.load(weights_only)),
  and every writer against the same reader, so values round-trip exactly in every direction;
- a crash (std::_Exit through DPZERO_CHECKPOINT_FAULT) at each phase of the commit protocol;
- corrupt, truncated and mismatching checkpoints give errors naming the file, parameter or value.
"""

import json
import os
import time
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import dpzero
import ranks
from dpzero._C import checkpoint as cckpt
from test_zero import GPT, LOSS_TOL, OPTIMIZERS, PARAM_TOL, STEPS, make_model, reference
from test_zero import train_steps as train  # sharded_run's loop over given steps

HALF = STEPS // 2  # the uninterrupted run is STEPS steps; the checkpoint is taken after HALF
SOURCE_OPTIMIZER = {0: "sgd", 1: "adamw", 2: "sgd", 3: "adamw"}  # round-trip sources by stage


@pytest.fixture(autouse=True)
def one_thread():
    """The in-process parts run single-threaded, like the ranks: the tensors are tiny, and CI's two
    cores are shared with the spawned ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- helpers run inside ranks -------------------------------------------------------------------

def fresh_model(seed=7, **kwargs):
    """The test model with a different initialisation from make_model(): whatever a loaded engine
    holds afterwards came from the checkpoint."""
    torch.manual_seed(seed)
    return GPT(**kwargs)


def shard(model, stage, optimizer, **kwargs):
    return dpzero.shard(model, stage=stage, optimizer=optimizer, **OPTIMIZERS[optimizer], **kwargs)



def read_checkpoint(path):
    """An independent reader of the format (Note [checkpoint format]): checks each file's size and
    zlib.crc32 against the manifest, loads it with torch.load(weights_only=True), checks padding
    is zero, and returns (manifest, {entry: {param name: [numel] tensor}})."""
    step_dir = cckpt.resolve(str(path))
    with open(os.path.join(step_dir, "manifest.json")) as f:
        manifest = json.load(f)
    files = []
    for meta in manifest["rank_files"]:
        with open(os.path.join(step_dir, meta["name"]), "rb") as f:
            raw = f.read()
        assert len(raw) == meta["bytes"] and f"{zlib.crc32(raw):08x}" == meta["crc32"], meta
        files.append(torch.load(os.path.join(step_dir, meta["name"]), weights_only=True))
    values = {}
    for u, unit in enumerate(manifest["units"]):
        for entry in unit["entries"]:
            flat = torch.cat([f["units"][u]["entries"][entry] for f in files])
            assert flat.numel() == unit["padded_numel"]
            covered = torch.zeros(flat.numel(), dtype=torch.bool)
            for p in unit["params"]:
                piece = slice(p["flat_offset"], p["flat_offset"] + p["numel"])
                values.setdefault(entry, {})[p["name"]] = flat[piece].clone()
                covered[piece] = True
            assert torch.all(flat[~covered] == 0), f"{unit['name']} {entry}: padding not zero"
    return manifest, values


def check_engine_holds(wrapped, manifest, values):
    """The engine's parameters (all of them, gathered) and optimizer state (what this rank keeps)
    equal the checkpoint's, bit for bit. A collective in stage 3."""
    full = wrapped.full_parameters()
    assert set(full) == set(values["param"])
    for name, value in values["param"].items():
        assert torch.equal(full[name].reshape(-1), value), name
    state = wrapped.zero_state
    (optimizer_steps,) = {u["optimizer_steps"] for u in manifest["units"]}  # all step together
    for u, (unit, members) in enumerate(wrapped.unit_members):
        layout = wrapped.plan.units[u]
        begin, end = state.kept_range(u)
        held = state.optimizer_state(u)
        assert set(held) | {"param"} == set(values), unit
        for entry, tensor in held.items():
            flat = torch.zeros(layout.padded_numel)
            for (name, param, _), offset in zip(members, layout.flat_offsets):
                flat[offset:offset + param.numel()] = values[entry][name]
            assert torch.equal(tensor, flat[begin:end]), f"{unit} {entry}"
        assert state.optimizer_steps(u) == optimizer_steps, unit
    assert wrapped.steps == manifest["engine_steps"]


# ---- tasks: each runs on every rank (or in this process as rank 0 of 1) ----------------------

def task_train_and_save(rank, world_size, *, stage, optimizer, root):
    wrapped = shard(make_model(), stage, optimizer)
    losses = train(wrapped, rank, world_size, range(HALF))
    dpzero.checkpoint.save(wrapped, root, extra={"cursor": torch.tensor([100 + rank])},
                           metadata={"losses": losses})


def task_load_and_train(rank, world_size, *, stage, optimizer, root):
    wrapped = shard(fresh_model(), stage, optimizer)
    info = dpzero.checkpoint.load(wrapped, root)
    losses = info["metadata"]["losses"] + train(wrapped, rank, world_size, range(HALF, STEPS))
    return dict(losses=losses, params=wrapped.full_parameters(), steps=wrapped.steps,
                info={k: info[k] for k in ("step", "world_size", "stage", "extra_rank")},
                cursor=info["extra"]["cursor"].item())


def task_resume_bitwise(rank, world_size, *, stage, optimizer, root, steps=STEPS, **shard_kwargs):
    """The uninterrupted run, and steps // 2 steps + save + load into a fresh engine + the rest;
    also checks that load restored torch's RNG state."""
    straight = shard(make_model(), stage, optimizer, **shard_kwargs)
    straight_losses = train(straight, rank, world_size, range(steps))
    first = shard(make_model(), stage, optimizer, **shard_kwargs)
    losses = train(first, rank, world_size, range(steps // 2))
    dpzero.checkpoint.save(first, root)
    after_save = torch.rand(4)
    del first
    resumed = shard(fresh_model(), stage, optimizer, **shard_kwargs)
    torch.rand(100)
    info = dpzero.checkpoint.load(resumed, root)
    assert torch.equal(torch.rand(4), after_save), "RNG state not restored"
    assert info["extra_rank"] == rank and info["extra"] == {}
    losses += train(resumed, rank, world_size, range(steps // 2, steps))
    return dict(straight_losses=straight_losses, losses=losses,
                straight=straight.full_parameters(), resumed=resumed.full_parameters())


def task_write_sources(rank, world_size, *, root):
    """One checkpoint per stage after one step (so optimizer state exists), each checked against
    the independent reader."""
    for stage, optimizer in SOURCE_OPTIMIZER.items():
        wrapped = shard(make_model(), stage, optimizer)
        train(wrapped, rank, world_size, range(1))
        path = dpzero.checkpoint.save(wrapped, os.path.join(root, f"w{world_size}_s{stage}"),
                                      extra={"rank": torch.tensor([rank])})
        check_engine_holds(wrapped, *read_checkpoint(path))


def task_load_sources(rank, world_size, *, root, sources):
    """Every source checkpoint into every stage (stage 1 also with other units and alignment);
    returns the (source, stage) pairs checked."""
    checked = []
    for source in sources:
        manifest, values = read_checkpoint(os.path.join(root, source))
        optimizer = manifest["optimizer"]["kind"]
        for stage in range(4):
            kwargs = dict(alignment=1, units=["blocks.0", "blocks.1.attn"]) if stage == 1 else {}
            wrapped = shard(fresh_model(), stage, optimizer, **kwargs)
            info = dpzero.checkpoint.load(wrapped, os.path.join(root, source))
            check_engine_holds(wrapped, manifest, values)
            if rank < manifest["world_size"]:  # Note [checkpoint extras]
                assert info["extra_rank"] == rank and info["extra"]["rank"].item() == rank
            else:
                assert info["extra_rank"] is None and info["extra"] == {}
            checked.append((source, f"w{world_size}_s{stage}"))
    return checked


def task_load_error_reaches_every_rank(rank, world_size, *, root):
    """rank-00001.pt corrupted: at W=2 stage 1 only rank 1 reads it, yet both ranks raise, and
    neither engine changed. Returns the message."""
    wrapped = shard(make_model(), 1, "sgd")
    train(wrapped, rank, world_size, range(1))
    path = dpzero.checkpoint.save(wrapped, root)
    dist.barrier()
    if rank == 0:
        flip_byte(os.path.join(path, "rank-00001.pt"))
    dist.barrier()
    target = shard(fresh_model(), 1, "sgd")
    before = target.full_parameters()
    with pytest.raises(RuntimeError) as error:
        dpzero.checkpoint.load(target, root)
    after = target.full_parameters()
    assert all(torch.equal(before[n], after[n]) for n in before) and target.steps == 0
    return str(error.value)


def task_crash(rank, world_size, *, root, fault):
    wrapped = shard(make_model(), 2, "sgd")
    train(wrapped, rank, world_size, range(1))
    dpzero.checkpoint.save(wrapped, root)  # step 1: the checkpoint that must survive
    train(wrapped, rank, world_size, range(1, 2))
    os.environ["DPZERO_CHECKPOINT_FAULT"] = fault
    dpzero.checkpoint.save(wrapped, root)  # step 2: crashes
    raise AssertionError("unreachable: the fault should have ended this process")


# ---- multi-rank plumbing -------------------------------------------------------------------------

RANK_TIMEOUT_S = 120  # the ranks' process group timeout in this file


def run_tasks(rank, world_size, tasks):
    """Runs `tasks` [(task name, kwargs)] in order on this rank; their results. ranks.spawn(
    run_tasks, W, tmp_path, tasks, timeout_s=RANK_TIMEOUT_S) gives results[rank][task]."""
    return [globals()[name](rank, world_size, **kwargs) for name, kwargs in tasks]


def flip_byte(path, offset=None):
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(size // 2 if offset is None else offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


def sources(world_size):
    return [f"w{world_size}_s{stage}" for stage in range(4)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The spawned multi-rank work of this file, in three rank sets (starting ranks is most of
    the cost): W=1 (this process) writes round-trip sources; W=2 loads them and writes its own;
    W=4 loads both, writes and reloads its own, and trains HALF steps of the resume runs and
    saves; W=2 loads W=2's and W=4's sources, resumes those runs at stage 2, runs the bitwise
    resumes and the error case; W=1 loads every source. Returns rank 0's results (and both
    ranks' error messages)."""
    tmp = tmp_path_factory.mktemp("runs")
    root = str(tmp / "sources")
    resume = {opt: str(tmp / f"resume_{opt}") for opt in ("sgd", "adamw")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        task_write_sources(0, 1, root=root)
        w2 = ranks.spawn(run_tasks, 2, tmp,
                         [("task_load_sources", dict(root=root, sources=sources(1))),
                          ("task_write_sources", dict(root=root))],
                         timeout_s=RANK_TIMEOUT_S)
        w4 = ranks.spawn(run_tasks, 4, tmp,
                         [("task_load_sources", dict(root=root, sources=sources(1) + sources(2))),
                          ("task_write_sources", dict(root=root)),
                          ("task_load_sources", dict(root=root, sources=sources(4)))]
                         + [("task_train_and_save", dict(stage=3, optimizer=opt, root=path))
                            for opt, path in resume.items()],
                         timeout_s=RANK_TIMEOUT_S)
        again = ranks.spawn(
            run_tasks, 2, tmp,
            [("task_load_sources", dict(root=root, sources=sources(2) + sources(4)))]
            + [("task_load_and_train", dict(stage=2, optimizer=opt, root=path))
               for opt, path in resume.items()]
            + [("task_resume_bitwise", dict(stage=s, optimizer=SOURCE_OPTIMIZER[s],
                                            root=str(tmp / f"bitwise_{s}"))) for s in range(4)]
            + [("task_load_error_reaches_every_rank", dict(root=str(tmp / "corrupt")))],
            timeout_s=RANK_TIMEOUT_S)
        w1 = task_load_sources(0, 1, root=root, sources=sources(1) + sources(2) + sources(4))
    finally:
        torch.set_num_threads(threads)
    return dict(
        round_trips=set(w2[0][0] + w4[0][0] + w4[0][2] + again[0][0] + w1),
        resumed=dict(zip(resume, again[0][1:3])),
        bitwise=again[0][3:7],
        load_error=[again[r][7] for r in range(2)],
    )


# ---- resume ------------------------------------------------------------------------------------

@pytest.mark.multirank
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_resume_at_another_world_size_and_stage_matches_uninterrupted(runs, optimizer):
    # W=4 stage 3 trained HALF steps and saved; W=2 stage 2 loaded it and trained the rest.
    # Against the uninterrupted single-process torch.optim run, with test_zero's tolerances.
    result = runs["resumed"][optimizer]
    assert result["info"] == dict(step=HALF, world_size=4, stage=3, extra_rank=0)
    assert result["steps"] == STEPS and result["cursor"] == 100  # rank 0 got old rank 0's extra
    ref_losses, ref_params = reference(optimizer, dict(tied=True))
    torch.testing.assert_close(torch.tensor(result["losses"], dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), **LOSS_TOL)
    assert set(result["params"]) == set(ref_params)
    for name, value in ref_params.items():
        torch.testing.assert_close(result["params"][name], value, **PARAM_TOL,
                                   msg=lambda m, name=name: f"{optimizer} {name}: {m}")
    # Not an assertion, a record (as in test_zero): the worst parameter difference of this run.
    worst = max((result["params"][n] - p).abs().max().item() for n, p in ref_params.items())
    print(f"W=4 stage 3 -> W=2 stage 2 {optimizer}: max |param - reference| = {worst:.3g}")


def assert_bitwise(result):
    assert result["losses"] == result["straight_losses"]
    for name, value in result["straight"].items():
        assert torch.equal(result["resumed"][name], value), name


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_at_the_same_world_size_and_stage_is_bitwise(runs, stage):
    assert_bitwise(runs["bitwise"][stage])  # W=2, SOURCE_OPTIMIZER[stage]


def test_single_process_resume_is_bitwise(tmp_path):
    assert not dist.is_initialized()
    assert_bitwise(task_resume_bitwise(0, 1, stage=3, optimizer="adamw", root=str(tmp_path),
                                       steps=6))


@pytest.mark.parametrize("stage", [0, 3])
def test_mixed_precision_resume_is_bitwise(tmp_path, stage):
    # Checkpoints hold the fp32 master weights (Note [master weights]), not the 16-bit copies, so
    # a bf16 run resumes exactly.
    assert_bitwise(task_resume_bitwise(0, 1, stage=stage, optimizer="adamw", root=str(tmp_path),
                                       steps=6, param_dtype=torch.bfloat16))


def test_mixed_precision_checkpoint_loads_into_fp32(tmp_path):
    wrapped = shard(make_model(), 2, "adamw", param_dtype=torch.bfloat16)
    train(wrapped, 0, 1, range(3))
    dpzero.checkpoint.save(wrapped, str(tmp_path))
    fp32 = shard(fresh_model(), 1, "adamw")
    dpzero.checkpoint.load(fp32, str(tmp_path))
    masters = wrapped.full_parameters()
    for name, value in fp32.full_parameters().items():
        assert torch.equal(value, masters[name]), name


@pytest.mark.multirank
def test_values_round_trip_between_every_stage_and_world_size(runs):
    # Every (W, stage) source loaded into every (W', stage') target, W, W' ∈ {1, 2, 4}, each
    # checked bitwise against the independent reader (check_engine_holds), as was each writer.
    expected = {(f"w{w}_s{s}", f"w{v}_s{t}")
                for w in (1, 2, 4) for v in (1, 2, 4) for s in range(4) for t in range(4)}
    assert runs["round_trips"] == expected, sorted(expected ^ runs["round_trips"])


@pytest.mark.multirank
def test_a_load_error_on_one_rank_reaches_every_rank(runs):
    rank0, rank1 = runs["load_error"]
    assert "rank-00001.pt is corrupt" in rank1, rank1
    assert "rank 1 failed: checkpoint file" in rank0 and "rank-00001.pt is corrupt" in rank0, rank0


# ---- crashes during a save -----------------------------------------------------------------------

# (DPZERO_CHECKPOINT_FAULT, the ranks that crash, whether step 2 got committed)
FAULTS = [
    ("during_rank_file:1", [1], False),
    ("after_rank_file", [0, 1], False),
    ("before_manifest", [0], False),
    ("before_commit_rename", [0], False),
    ("before_latest", [0], True),
]


def _crash_main(rank, world_size, store, root, fault):
    with ranks.gloo_group(rank, world_size, store, timeout_s=RANK_TIMEOUT_S):
        task_crash(rank, world_size, root=root, fault=fault)


@pytest.mark.multirank
@pytest.mark.parametrize("fault,crashing,committed", FAULTS, ids=[f[0] for f in FAULTS])
def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, fault, crashing, committed):
    # Two ranks save step 1, then crash (std::_Exit) at `fault` while saving step 2. Forked, not
    # spawned: a crash costs a whole rank set, and a forked rank need not import torch again.
    root = tmp_path / "ckpt"
    ctx = mp.start_processes(_crash_main, args=(2, str(tmp_path / "store"), str(root), fault),
                             nprocs=2, join=False, start_method="fork")
    for r in crashing:
        ctx.processes[r].join(timeout=120)
    for p in ctx.processes:  # a survivor waits in a collective for the dead rank: end it
        if p.exitcode is None:
            p.terminate()
        p.join()
    for r in crashing:
        assert ctx.processes[r].exitcode == cckpt.FAULT_EXIT_CODE, (fault, r)

    # ROOT/latest still names step 1, which loads; step 2 exists only if it was committed.
    assert (root / "latest").read_text() == "step-00000001\n"
    assert (root / "step-00000002").exists() == committed
    # A crashed rank 0 leaves its temporary directory behind; a surviving rank 0 may remove it
    # when its collective fails (the crashed peer closed the connection) before it is ended.
    leftovers = sorted(p.name for p in root.iterdir() if p.name.startswith(".step-2.tmp-"))
    if 0 in crashing:
        assert len(leftovers) == (0 if committed else 1), leftovers
    else:
        assert len(leftovers) <= 1, leftovers
    manifest, values = read_checkpoint(root)
    assert manifest["step"] == 1
    wrapped = shard(fresh_model(), 0, "sgd")
    dpzero.checkpoint.load(wrapped, root)
    check_engine_holds(wrapped, manifest, values)

    # The next save works and removes the leftovers. A committed step 2 is never overwritten.
    train(wrapped, 0, 1, range(1, 2))
    if committed:
        with pytest.raises(RuntimeError, match="step-00000002 already exists"):
            dpzero.checkpoint.save(wrapped, root)
        dpzero.checkpoint.load(wrapped, root / "step-00000002")  # complete, loadable by path
        train(wrapped, 0, 1, range(2, 3))
    path = dpzero.checkpoint.save(wrapped, root)
    assert (root / "latest").read_text() == os.path.basename(path) + "\n"
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]
    check_engine_holds(wrapped, *read_checkpoint(root))


# ---- errors --------------------------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    """A W=1 stage-2 SGD-momentum checkpoint after one step: (wrapped, step dir)."""
    wrapped = shard(make_model(), 2, "sgd")
    train(wrapped, 0, 1, range(1))
    return wrapped, dpzero.checkpoint.save(wrapped, tmp_path / "ckpt")


def test_corrupt_or_truncated_files_are_named_and_change_nothing(saved, tmp_path):
    _, path = saved
    target = shard(fresh_model(), 2, "sgd")
    before = target.full_parameters()
    rank_file = os.path.join(path, "rank-00000.pt")
    original = open(rank_file, "rb").read()

    flip_byte(rank_file)
    with pytest.raises(RuntimeError, match=r"rank-00000.pt is corrupt: its CRC-32 is [0-9a-f]{8}, "
                                           r"the manifest says [0-9a-f]{8}"):
        dpzero.checkpoint.load(target, path)
    with open(rank_file, "wb") as f:
        f.write(original[:-100])
    with pytest.raises(RuntimeError, match=f"rank-00000.pt has {len(original) - 100} bytes, the "
                                           f"manifest says {len(original)}"):
        dpzero.checkpoint.load(target, path)
    os.remove(rank_file)
    with pytest.raises(RuntimeError, match="cannot open .*rank-00000.pt: No such file"):
        dpzero.checkpoint.load(target, path)
    with open(rank_file, "wb") as f:
        f.write(original)
    flip_byte(os.path.join(path, "shared.pt"), offset=10)
    with pytest.raises(RuntimeError, match="shared.pt is corrupt"):
        dpzero.checkpoint.load(target, path)
    with open(os.path.join(path, "manifest.json"), "a") as f:
        f.write("}")
    with pytest.raises(RuntimeError, match="manifest.json is not valid JSON"):
        dpzero.checkpoint.load(target, path)
    after = target.full_parameters()
    assert all(torch.equal(before[n], after[n]) for n in before) and target.steps == 0


def test_a_different_model_is_named(saved):
    _, path = saved
    cases = [
        (dict(tied=False), "parameter 'head.weight' \\(unit 'head'\\) is not in the checkpoint"),
        (dict(unused=True), "parameter 'unused.weight' \\(unit 'unused'\\) is not in the"),
    ]
    for kwargs, message in cases:
        with pytest.raises(RuntimeError, match=message):
            dpzero.checkpoint.load(shard(fresh_model(**kwargs), 2, "sgd"), path)
    model = fresh_model()
    model.logit_scale = nn.Parameter(torch.ones(2))
    with pytest.raises(RuntimeError, match="'logit_scale' has 2 elements in the model and 1 in"):
        dpzero.checkpoint.load(shard(model, 2, "sgd"), path)
    model = fresh_model()
    model.wpe.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="the checkpoint has parameter 'wpe.weight' \\(unit "
                                           "'wpe'\\), which is not a trainable parameter"):
        dpzero.checkpoint.load(shard(model, 2, "sgd"), path)


def test_a_different_optimizer_is_named(saved):
    _, path = saved
    with pytest.raises(RuntimeError, match="optimizer 'sgd', this engine uses 'adamw'"):
        dpzero.checkpoint.load(shard(fresh_model(), 2, "adamw"), path)
    plain = dpzero.shard(fresh_model(), stage=2, optimizer="sgd", lr=0.05)  # no momentum
    with pytest.raises(RuntimeError, match="unit '<root>': sgd state: unexpected entry "
                                           "'momentum_buffer'"):
        dpzero.checkpoint.load(plain, path)
    # Other hyperparameters may change: the engine keeps its own, the saved ones are returned.
    other = dpzero.shard(fresh_model(), stage=2, optimizer="sgd", lr=0.5, momentum=0.5)
    info = dpzero.checkpoint.load(other, path)
    assert other.lr == 0.5 and info["optimizer"]["hyperparameters"]["lr"] == 0.05
    assert info["optimizer"]["hyperparameters"]["momentum"] == 0.9

    adam_path = os.path.dirname(path) + "_adam"
    amsgrad = dpzero.shard(make_model(), stage=1, optimizer="adam", amsgrad=True)
    train(amsgrad, 0, 1, range(1))
    dpzero.checkpoint.save(amsgrad, adam_path)
    with pytest.raises(RuntimeError, match="adam state: unexpected entry 'max_exp_avg_sq'"):
        dpzero.checkpoint.load(dpzero.shard(fresh_model(), stage=3, optimizer="adam"), adam_path)


def test_save_refuses_to_overwrite_and_bad_requests_are_named(saved, tmp_path):
    wrapped, path = saved
    root = os.path.dirname(path)
    with pytest.raises(RuntimeError, match="step-00000001 already exists; a committed checkpoint "
                                           "is never overwritten"):
        dpzero.checkpoint.save(wrapped, root)
    with pytest.raises(RuntimeError, match="no checkpoint at .*nowhere: it has neither "
                                           "manifest.json"):
        dpzero.checkpoint.load(wrapped, tmp_path / "nowhere")
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("step-00000007\n")
    with pytest.raises(RuntimeError, match="latest names step-00000007, but .* does not exist"):
        dpzero.checkpoint.load(wrapped, root)
    os.environ["DPZERO_CHECKPOINT_FAULT"] = "befor_manifest"
    try:
        with pytest.raises(RuntimeError, match="unknown phase 'befor_manifest'"):
            dpzero.checkpoint.save(wrapped, root, step=5)
    finally:
        del os.environ["DPZERO_CHECKPOINT_FAULT"]
    assert not os.path.exists(os.path.join(root, "step-00000005"))
    with pytest.raises(ValueError, match="reserved, got 'dpzero.rng.cpu'"):
        dpzero.checkpoint.save(wrapped, root, step=5, extra={"dpzero.rng.cpu": torch.zeros(1)})
    with pytest.raises(TypeError, match="extra 'n' must be a torch.Tensor, got <class 'int'>"):
        dpzero.checkpoint.save(wrapped, root, step=5, extra={"n": 3})


def test_keep_last_deletes_only_older_committed_steps(tmp_path):
    wrapped = shard(make_model(), 1, "adamw")
    root = tmp_path / "ckpt"
    dpzero.checkpoint.save(wrapped, root, step=10)  # a later step of another branch: kept
    for step in (1, 2, 3, 4):
        dpzero.checkpoint.save(wrapped, root, step=step, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == [
        "latest", "step-00000003", "step-00000004", "step-00000010"]
    assert dpzero.checkpoint.resolve(root) == str(root / "step-00000004")


def test_buffers_frozen_parameters_and_metadata_are_restored(tmp_path):
    def model(seed, buffer=True):
        m = fresh_model(seed)
        if buffer:
            m.register_buffer("counter", torch.zeros(3))
        m.wpe.weight.requires_grad_(False)
        return m

    wrapped = shard(model(0), 3, "adamw")
    wrapped.module.counter += torch.tensor([1.0, 2.0, 3.0])
    train(wrapped, 0, 1, range(2))
    path = dpzero.checkpoint.save(wrapped, tmp_path, metadata={"epoch": 3, "note": "ok"},
                                  extra={"cursor": torch.tensor([42])})
    target = shard(model(5), 0, "adamw")
    info = dpzero.checkpoint.load(target, tmp_path)
    assert torch.equal(target.module.counter, torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(target.module.wpe.weight, wrapped.module.wpe.weight)
    assert info["metadata"] == {"epoch": 3, "note": "ok"}
    assert info["extra"]["cursor"].item() == 42 and info["path"] == path
    check_engine_holds(target, *read_checkpoint(path))
    shared = torch.load(os.path.join(path, "shared.pt"), weights_only=True)["tensors"]
    assert sorted(shared) == ["buffer.counter", "frozen.wpe.weight"]
    # A model without the buffer does not match.
    with pytest.raises(RuntimeError, match="it has 'buffer.counter', which is not a buffer"):
        dpzero.checkpoint.load(shard(model(5, buffer=False), 0, "adamw"), tmp_path)


def test_crc32_is_zlibs():
    # CRC-32/ISO-HDLC check value (crc32.h) and agreement with zlib on arbitrary bytes.
    assert cckpt.crc32(b"123456789") == 0xCBF43926
    assert cckpt.crc32(b"") == 0
    data = bytes(range(256)) * 37 + b"tail"
    assert cckpt.crc32(data) == zlib.crc32(data)
