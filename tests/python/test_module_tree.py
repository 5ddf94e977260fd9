"""dpzero._C.tree (python/csrc/module_tree_bindings.cpp), which the step's checks read the module
tree with: a snapshot is ``same`` exactly when a Python walk of every listed module's children,
buffers and parameters, by identity, and the parameters' requires_grad reads what it read when the
snapshot was taken (Note [module tree snapshots]); ``versions``, ``storage_pointers`` and
``Places`` read torch's own ``_version``, ``untyped_storage()``, offset, shape, strides and dtype
in one call."""

from __future__ import annotations

import gc
import types
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


def test_a_snapshot_of_a_listing_the_tree_has_grown_past_is_never_the_same():
    """Note [module tree snapshots]: a child added after the listing was made and before the
    snapshot is held by its parent's dict but not listed; such a snapshot is incomplete and never
    ``same``, so the tree is listed again."""
    model = Net()
    listing = list(model.modules())
    model.blocks.append(nn.Linear(2, 2))
    snapshot = _C.tree.Snapshot(listing)
    assert not snapshot.complete
    assert not snapshot.same(listing)
    relisted = list(model.modules())
    assert _C.tree.Snapshot(relisted).complete and _C.tree.Snapshot(relisted).same(relisted)


def test_a_snapshot_of_a_listing_the_tree_has_shrunk_below_is_never_the_same():
    """A module removed after the listing was made: the snapshot would list a module no listed
    module holds (a second review kept a removed module's parameters listed for good)."""
    model = Net()
    listing = list(model.modules())
    del model.blocks[1]
    snapshot = _C.tree.Snapshot(listing)
    assert not snapshot.complete
    assert not snapshot.same(listing)


def test_what_a_snapshot_holds_is_what_the_walk_read():
    model = Net()
    listing = list(model.modules())
    snapshot = _C.tree.Snapshot(listing)
    assert sorted(snapshot.trainable()) == sorted(
        id(p) for m in listing for p in m._parameters.values() if p is not None and p.requires_grad)
    held = snapshot.items()
    assert [m for m, _, _ in held] == listing
    for (m, buffers, params) in held:
        assert [(k, id(v)) for k, v in buffers] == [(k, id(v)) for k, v in m._buffers.items()]
        assert [(k, id(v)) for k, v in params] == [(k, id(v)) for k, v in m._parameters.items()]
    model.fc.weight.requires_grad_(False)  # the live tree moves on; the snapshot does not
    model.norm.running_mean = torch.zeros(2)
    assert id(model.fc.weight) in snapshot.trainable()
    held = {id(m): dict(buffers) for m, buffers, _ in snapshot.items()}
    assert held[id(model.norm)]["running_mean"] is not model.norm.running_mean


def test_a_snapshot_compares_the_listing_itself():
    model = Net()
    listing = list(model.modules())
    snapshot = _C.tree.Snapshot(listing)
    assert not snapshot.same(listing[:-1])
    assert not snapshot.same(listing[::-1])
    assert not snapshot.same(listing[:-1] + [nn.Linear(2, 2)])
    with pytest.raises(TypeError):
        snapshot.same(tuple(listing))  # the checks pass lists
    odd = nn.Linear(1, 1)  # another mapping: the Python walks read it, the snapshot stands aside
    object.__setattr__(odd, "_parameters", types.MappingProxyType(dict(odd._parameters)))
    assert not _C.tree.Snapshot([odd]).complete
    assert not _C.tree.Snapshot([odd]).same([odd])


def test_versions_and_places_are_torchs_own():
    a = nn.Parameter(torch.randn(4))
    b = torch.randn(6)[2:]  # a view: its storage is its base's
    c = torch.zeros(0)
    with torch.no_grad():
        a.add_(1)
        a.mul_(2)
    ts = [a, b, c]
    assert _C.tree.versions(ts) == [t._version for t in ts]
    assert _C.tree.storage_pointers(ts) == [t.untyped_storage().data_ptr() for t in ts]
    places = _C.tree.Places(ts)
    assert places.moved(ts) == []
    assert places.moved([a, b]) == [0, 1]  # another count: every position
    base = b.data
    for moved in (base[1:], base[:3].view(1, 3), base.view(torch.int32)[:4],  # the same storage
                  base._neg_view(), base.clone()):
        assert places.moved([a, moved, c]) == [1]
    b.untyped_storage().resize_(8)  # the storage resized in place (and moved)
    assert places.moved(ts) == [1]
    with pytest.raises(TypeError, match=r"tensors\[1\] is a int"):
        _C.tree.versions([a, 3])
