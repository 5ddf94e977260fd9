"""dpzero._C.tree (python/csrc/module_tree_bindings.cpp), which the step's checks read the module
tree with: a snapshot is ``same`` exactly when a Python walk of every listed module's children,
buffers and parameters, by identity, and the parameters' requires_grad reads what it read when the
snapshot was taken (Note [module tree snapshots]); ``versions`` and ``storages`` are torch's own
``_version`` and ``untyped_storage()`` in one call."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from dpzero import _C


def _walk(modules):
    """The Python reference: every (module, dict name, key, value) by identity, and each
    parameter's requires_grad."""
    return [(id(m), name, key, id(v), name == "_parameters" and getattr(v, "requires_grad", None))
            for m in modules for name in ("_modules", "_buffers", "_parameters")
            for key, v in getattr(m, name).items()]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.norm = nn.BatchNorm1d(2)
        self.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)


def _changes():
    """Each change a model can undergo between two steps, as (name, function of the model)."""
    def swap_weight(m):
        m.fc.weight = nn.Parameter(m.fc.weight.detach().clone())

    def same_values_new_buffer(m):  # equal values, another tensor
        m.norm.running_mean = m.norm.running_mean.clone()

    def reorder(m):
        params = m.fc._parameters
        params["weight"] = params.pop("weight")

    def rename(m):
        params = m.fc._parameters
        params["w"] = params.pop("weight")

    return [
        ("freeze", lambda m: m.fc.weight.requires_grad_(False)),
        ("unfreeze", lambda m: m.frozen.requires_grad_(True)),
        ("replace parameter", swap_weight),
        ("set parameter None", lambda m: setattr(m.fc, "bias", None)),
        ("add parameter", lambda m: m.register_parameter("extra", nn.Parameter(torch.zeros(1)))),
        ("add buffer", lambda m: m.register_buffer("count", torch.zeros(1))),
        ("replace buffer", same_values_new_buffer),
        ("delete buffer", lambda m: delattr(m.norm, "running_var")),
        ("add child", lambda m: m.blocks.append(nn.Linear(2, 2))),
        ("replace child", lambda m: m.blocks.__setitem__(1, nn.Linear(2, 2))),
        ("delete child", lambda m: delattr(m, "norm")),
        ("insert child by dict", lambda m: m._modules.__setitem__("side", nn.Linear(1, 1))),
        ("reorder", reorder),
        ("rename", rename),
    ]


@pytest.mark.parametrize("name,change", _changes(), ids=[n for n, _ in _changes()])
def test_a_snapshot_is_the_same_exactly_when_the_walk_reads_the_same(name, change):
    model = Net()
    listing = list(model.modules())
    before = _walk(listing)
    snapshot = _C.tree.Snapshot(listing)
    assert snapshot.same(listing)
    assert snapshot.same(list(model.modules()))  # another list of the same modules
    change(model)
    walk_same = _walk(listing) == before and list(model.modules()) == listing
    assert not walk_same, name  # every change is one the walk sees
    # The listing the checks hold (modules() lists again when children change): either way.
    assert not snapshot.same(listing), name
    assert not snapshot.same(list(model.modules())), name


def test_a_snapshot_keeps_what_it_holds_alive_so_no_address_is_reused():
    """A replaced parameter freed and a new object allocated at its address would look the same
    to a comparison of addresses: the snapshot holds what it read until it is dropped."""
    model = Net()
    listing = list(model.modules())
    snapshot = _C.tree.Snapshot(listing)
    old = weakref.ref(model.fc.weight)
    model.fc.weight = nn.Parameter(torch.zeros(2, 3))
    gc.collect()
    assert old() is not None
    assert not snapshot.same(listing)
    del snapshot
    gc.collect()
    assert old() is None


def test_equal_objects_that_are_other_objects_are_changes_the_walk_then_reads():
    """Keys and dicts compare by identity: the same tensor put back under an equal str of another
    object, or an equal copy of a dict, makes ``same`` False (the checks then walk, and find
    nothing), never the converse."""
    model = Net()
    listing = list(model.modules())
    before = _walk(listing)
    snapshot = _C.tree.Snapshot(listing)
    params = model.fc._parameters
    w, b = params.pop("weight"), params.pop("bias")
    params["".join(["wei", "ght"])], params["bias"] = w, b
    assert _walk(listing) == before
    assert not snapshot.same(listing)
    # Likewise a module given an equal copy of one of its dicts.
    snapshot = _C.tree.Snapshot(listing)
    model.blocks[0]._parameters = dict(model.blocks[0]._parameters)
    assert _walk(listing) == before
    assert not snapshot.same(listing)


def test_a_cycle_through_a_snapshot_is_collected():
    """The modules often reach what holds their snapshot (an engine's patched forward): the
    collector must see the snapshot's references, or the cycle, and the engine's ledger lock with
    it, would live until the process ends."""
    model = Net()
    model.holder = {"snapshot": _C.tree.Snapshot(list(model.modules()))}  # a cycle through it
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_a_snapshot_compares_the_listing_itself():
    model = Net()
    listing = list(model.modules())
    snapshot = _C.tree.Snapshot(listing)
    assert not snapshot.same(listing[:-1])
    assert not snapshot.same(listing[::-1])
    assert not snapshot.same(listing[:-1] + [nn.Linear(2, 2)])
    with pytest.raises(TypeError):
        snapshot.same(tuple(listing))  # the checks pass lists
    with pytest.raises(TypeError, match="_buffers is not a dict"):
        broken = nn.Linear(1, 1)
        object.__setattr__(broken, "_buffers", [])
        _C.tree.Snapshot([broken])


def test_versions_and_storages_are_torchs_own():
    a = nn.Parameter(torch.randn(4))
    b = torch.randn(6)[2:]  # a view: its storage is its base's
    c = torch.zeros(0)
    with torch.no_grad():
        a.add_(1)
        a.mul_(2)
    ts = [a, b, c]
    assert _C.tree.versions(ts) == [t._version for t in ts]
    assert _C.tree.storages(ts) == [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                                    for t in ts]
    b.untyped_storage().resize_(8)  # moved and resized: both are seen
    assert _C.tree.storages([b])[0] == (b.untyped_storage().data_ptr(), 8)
    with pytest.raises(TypeError, match=r"tensors\[1\] is a int"):
        _C.tree.versions([a, 3])
