"""nn.LSTM, nn.GRU and nn.RNN through the kernels (Note [recurrence through the kernels] in
python/dpzero/private/recurrent.py).

References: torch's own recurrent forward (outputs, final states and every input and parameter
gradient, float64) for the rewritten forward; a float64 copy of the unpatched model, one example
at a time through torch's autograd, each example's whole gradient clipped, for the private step
(σ = 0, every example clipped); the replace-one movement against 2C (sensitivity.py) where
dropout makes a per-example reference draw other masks.
"""

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpzero
from dpzero.layers import DPGRU, DPLSTM
from dpzero.private import recurrent
from private_reference import first_step_error, parameters_after_steps, private_without_noise
from sensitivity import refused_or_bounded

V, T, D, H, K, N = 13, 6, 5, 4, 3, 32
C, LR = 1e-3, 1000.0

# ---- the rewritten forward against torch's ---------------------------------------------------

MODES = {"lstm": lambda **kw: nn.LSTM(D, H, **kw), "gru": lambda **kw: nn.GRU(D, H, **kw),
         "rnn-tanh": lambda **kw: nn.RNN(D, H, **kw),
         "rnn-relu": lambda **kw: nn.RNN(D, H, nonlinearity="relu", **kw)}
SHAPES = {"one-layer": {}, "two-layers": dict(num_layers=2),
          "bidirectional": dict(bidirectional=True),
          "two-bidirectional-no-bias": dict(num_layers=2, bidirectional=True, bias=False)}


@pytest.mark.parametrize("mode,shape,batch_first,initial", itertools.product(
    sorted(MODES), sorted(SHAPES), [True, False], [False, True]))
def test_the_forward_is_torchs(mode, shape, batch_first, initial):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    m = MODES[mode](batch_first=batch_first, **SHAPES[shape]).double()
    b, states = 3, m.num_layers * (2 if m.bidirectional else 1)
    x0 = torch.randn(b, T, D, generator=g, dtype=torch.float64)
    x0 = x0 if batch_first else x0.transpose(0, 1)
    h0 = torch.randn(states, b, H, generator=g, dtype=torch.float64)
    c0 = torch.randn(states, b, H, generator=g, dtype=torch.float64)

    def run(forward):
        x, h, c = (t.detach().clone().requires_grad_() for t in (x0, h0, c0))
        hx = ((h, c) if mode == "lstm" else h) if initial else None
        out, last = forward(x, hx)
        last = last if mode == "lstm" else (last,)
        loss = out.pow(2).sum() + sum(s.pow(3).sum() for s in last)
        wrt = [x] + ([h, c] if mode == "lstm" else [h]) * initial + list(m.parameters())
        return (out, *last, *torch.autograd.grad(loss, wrt))

    want = run(m.forward)
    got = run(lambda x, hx: recurrent.recurrent_forward(m, x, hx))
    assert len(got) == len(want)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_unbatched_call_is_torchs(mode):
    """torch treats a 2D input as a batch of one; so does the rewritten forward."""
    torch.manual_seed(0)
    m = MODES[mode](num_layers=2).double()
    x = torch.randn(T, D, dtype=torch.float64)
    h = torch.randn(2, H, dtype=torch.float64)
    hx = (h, h.flip(0)) if mode == "lstm" else h
    for a, w in zip(torch.utils._pytree.tree_leaves(recurrent.recurrent_forward(m, x, hx)),
                    torch.utils._pytree.tree_leaves(m(x, hx))):
        torch.testing.assert_close(a, w)


@pytest.mark.parametrize("mode,shape,enforce_sorted,initial", itertools.product(
    ["lstm", "gru", "rnn-tanh"], ["one-layer", "two-bidirectional-no-bias"], [True, False],
    [False, True]))
def test_a_packed_sequence_is_torchs(mode, shape, enforce_sorted, initial):
    """Note [packed sequences]: each example runs to its own length, the reverse direction from
    there; the output packed as the input was, the final states in the examples' order."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    m = MODES[mode](batch_first=True, **SHAPES[shape]).double()
    b, states = 4, m.num_layers * (2 if m.bidirectional else 1)
    lengths = torch.tensor([6, 4, 4, 1] if enforce_sorted else [3, 6, 1, 4])
    x0 = torch.randn(b, T, D, generator=g, dtype=torch.float64)
    h0 = torch.randn(states, b, H, generator=g, dtype=torch.float64)
    c0 = torch.randn(states, b, H, generator=g, dtype=torch.float64)

    def run(forward):
        x, h, c = (t.detach().clone().requires_grad_() for t in (x0, h0, c0))
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, True, enforce_sorted)
        hx = ((h, c) if mode == "lstm" else h) if initial else None
        out, last = forward(packed, hx)
        assert torch.equal(out.batch_sizes, packed.batch_sizes)
        assert out.sorted_indices is packed.sorted_indices
        last = last if mode == "lstm" else (last,)
        loss = out.data.pow(2).sum() + sum(s.pow(3).sum() for s in last)
        wrt = [x] + ([h, c] if mode == "lstm" else [h]) * initial + list(m.parameters())
        return (out.data, *last, *torch.autograd.grad(loss, wrt))

    want = run(m.forward)
    got = run(lambda x, hx: recurrent.recurrent_forward(m, x, hx))
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w)


def test_an_lstm_state_as_a_list_is_torchs():
    """torch takes (h0, c0) as any pair, a list too (a review: refused here at first)."""
    torch.manual_seed(0)
    m = nn.LSTM(D, H, batch_first=True)
    x, h = torch.randn(2, T, D), torch.randn(1, 2, H)
    for a, w in zip(torch.utils._pytree.tree_leaves(recurrent.recurrent_forward(m, x, [h, h])),
                    torch.utils._pytree.tree_leaves(m(x, [h, h]))):
        torch.testing.assert_close(a, w)
    with pytest.raises(TypeError, match="LSTM: hx must be a pair of tensors, got tuple of 3"):
        recurrent.recurrent_forward(m, x, (h, h, h))


def test_bad_states_get_torchs_errors():
    m = nn.LSTM(D, H, batch_first=True)
    x = torch.randn(2, T, D, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"Expected hidden\[0\] size \(1, 2, 4\), got "
                                           r"\[1, 3, 4\]"):
        recurrent.recurrent_forward(m, x, (torch.zeros(1, 3, H), torch.zeros(1, 3, H)))
    with pytest.raises(RuntimeError, match="For batched 3-D input, hx should also be 3-D"):
        recurrent.recurrent_forward(m, x, (torch.zeros(2, H), torch.zeros(2, H)))
    with pytest.raises(ValueError, match="LSTM: Expected input to be 2D or 3D, got 4D"):
        recurrent.recurrent_forward(m, x[None])


# ---- the private step ------------------------------------------------------------------------

def _data():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (N, T), generator=g)
    ids[::3, -2:] = 0  # padding
    ids[1::4, 2:] = 0
    return torch.utils.data.TensorDataset(ids, torch.randint(0, K, (N,), generator=g))


class Reading(nn.Module):
    """Embeddings through a recurrent module; the head reads the outputs' mean and the last
    layer's final state. ``initial``: the initial state computed from each example's own
    embeddings (its first token's), which the hidden-state call's input then carries."""

    def __init__(self, make, batch_first=True, initial=False, state_init=False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.rnn = make()
        width = H * (2 if self.rnn.bidirectional else 1)
        self.head = nn.Linear(width, K)
        self.batch_first, self.initial, self.state_init = batch_first, initial, state_init

    def forward(self, ids):
        h = self.emb(ids)  # [B, T, D]
        hx = None
        if self.initial:
            states = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
            first = torch.tanh(h[:, 0, :H]).unsqueeze(0).expand(states, -1, -1).contiguous()
            hx = (first, first * 0.5) if isinstance(self.rnn, nn.LSTM) else first
        seq = h if self.batch_first else h.transpose(0, 1)
        out, last = self.rnn(seq, state_init=hx) if self.state_init else self.rnn(seq, hx)
        h_n = last[0] if isinstance(last, tuple) else last  # [L * D, B, H]
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(out.mean(1)) + h_n[-1].sum(1, keepdim=True)


class Packing(nn.Module):
    """Each example's tokens up to its last non-padding id (0 pads), packed."""

    def __init__(self, make):
        super().__init__()
        self.emb, self.rnn = nn.Embedding(V, D), make()
        self.head = nn.Linear(H * (2 if self.rnn.bidirectional else 1), K)

    def forward(self, ids):
        lengths = T - (ids != 0).flip(1).int().argmax(1)  # [B]: up to the last real token
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(ids), lengths.cpu(), True, False)
        out, last = self.rnn(packed)
        h_n = last[0] if isinstance(last, tuple) else last
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=T)
        return self.head(out.sum(1)) + h_n.sum((0, 2)).unsqueeze(1)


MODELS = {
    "lstm-packed-2-bidirectional": lambda: Packing(
        lambda: nn.LSTM(D, H, num_layers=2, bidirectional=True, batch_first=True)),
    "gru-packed": lambda: Packing(lambda: nn.GRU(D, H)),
    "lstm": lambda: Reading(lambda: nn.LSTM(D, H, batch_first=True)),
    "lstm-2-bidirectional-seq-first": lambda: Reading(
        lambda: nn.LSTM(D, H, num_layers=2, bidirectional=True), batch_first=False),
    "lstm-initial-state": lambda: Reading(lambda: nn.LSTM(D, H, batch_first=True),
                                          initial=True),
    "gru-2-layers": lambda: Reading(lambda: nn.GRU(D, H, num_layers=2, batch_first=True)),
    "gru-bidirectional-initial-state": lambda: Reading(
        lambda: nn.GRU(D, H, bidirectional=True, batch_first=True), initial=True),
    "rnn-relu-no-bias": lambda: Reading(
        lambda: nn.RNN(D, H, nonlinearity="relu", bias=False, batch_first=True)),
    "opacus-dplstm-state-init": lambda: Reading(lambda: DPLSTM(D, H, batch_first=True),
                                                initial=True, state_init=True),
    "opacus-dpgru": lambda: Reading(lambda: DPGRU(D, H, num_layers=2, batch_first=True)),
    "hh-frozen": lambda: _frozen(Reading(lambda: nn.LSTM(D, H, batch_first=True)),
                                 "weight_hh_l0", "bias_hh_l0"),
    "ih-frozen": lambda: _frozen(Reading(lambda: nn.GRU(D, H, batch_first=True)),
                                 "weight_ih_l0", "bias_ih_l0"),
}


class _Exploding(nn.Module):
    """A packed ReLU RNN whose state grows threefold a step on the padding id (0) and stays at 0
    on the others: run on past a short example's length, its states would overflow (Note
    [packed sequences]), while every example's own steps stay finite."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.rnn = nn.RNN(D, H, nonlinearity="relu", batch_first=True)
        self.head = nn.Linear(H, K)
        with torch.no_grad():
            self.emb.weight.fill_(-1.0)
            self.emb.weight[0] = 1.0
            self.rnn.weight_ih_l0.fill_(0.5)
            self.rnn.weight_hh_l0.copy_(3 * torch.eye(H))

    def forward(self, ids):
        lengths = T_LONG - (ids != 0).flip(1).int().argmax(1)
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(ids), lengths.cpu(), True, False)
        return self.head(torch.tanh(self.rnn(packed)[1][-1]))


T_LONG = 90


def test_padding_steps_never_overflow_into_a_norm():
    """A review dropped two of four examples (NaN norms: an overflowing state past an example's
    length times its zero gradient); their states there are now zero."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (4, T_LONG), generator=g)
    ids[2, 1:], ids[3, 3:] = 0, 0  # lengths T_LONG, T_LONG, 1, 3; 3^90 overflows float32
    data = torch.utils.data.TensorDataset(ids, torch.randint(0, K, (4,), generator=g))
    torch.manual_seed(0)
    model = _Exploding()
    start = copy.deepcopy(model)
    p = dpzero.make_private(model, dataset=data, sample_rate=1.0, noise_multiplier=0.0,
                            max_grad_norm=C, allow_no_noise=True, lr=LR, seed=1)
    error = first_step_error(p, start, max_grad_norm=C, lr=LR, expected_batch=4.0)
    assert p.privacy_engine.last_step_diagnostics["dropped"] == 0
    assert error <= 1e-5, error


def _frozen(model, *names):
    for n in names:
        getattr(model.rnn, n).requires_grad_(False)
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_step_clips_each_examples_whole_gradient(name):
    start, p = private_without_noise(MODELS[name], _data(), max_grad_norm=C, lr=LR)
    kinds = {layer.name: type(layer.kind).__name__ for layer in p.privacy_engine.layers}
    assert set(kinds.values()) <= {"EmbeddingKind", "LinearKind"}, kinds  # all on the kernels
    error = first_step_error(p, start, max_grad_norm=C, lr=LR, expected_batch=8.0)
    assert error <= 1e-5, error


def test_each_weight_pair_is_a_layer_of_its_own():
    model = Reading(lambda: nn.GRU(D, H, num_layers=2, bidirectional=True, batch_first=True))
    model.rnn.bias_hh_l1_reverse.requires_grad_(False)
    model.rnn.weight_hh_l1_reverse.requires_grad_(False)
    p = dpzero.make_private(model, dataset=_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=C, seed=1, clipping="layer")
    layers = p.privacy_engine.layers
    assert [layer.name for layer in layers] == [
        "emb", "rnn.l0.ih", "rnn.l0.hh", "rnn.l0_reverse.ih", "rnn.l0_reverse.hh", "rnn.l1.ih",
        "rnn.l1.hh", "rnn.l1_reverse.ih", "head"]  # a pair with nothing trained is no layer
    assert len({layer.component for layer in layers}) == len(layers)  # disjoint parameters
    assert len(p.privacy_engine.book.groups) == len(layers)  # clipping="layer": one each
    ids, y = next(iter(p.data_loader))
    F.cross_entropy(p.model(ids), y).backward()
    assert p.optimizer.step()
    model = p.privacy_engine.detach()
    assert "forward" not in model.rnn.__dict__  # detached: torch's own forward again


def test_evaluation_runs_torchs_forward():
    """Under no_grad (evaluation) the module runs torch's fused forward, bit for bit."""
    torch.manual_seed(0)
    model = Reading(lambda: nn.LSTM(D, H, num_layers=2, batch_first=True))
    ids = torch.randint(1, V, (4, T))
    p = dpzero.make_private(model, dataset=_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=C, seed=1)
    with torch.no_grad():
        got = p.model(ids)
        want = p.privacy_engine.detach()(ids)  # the same parameters' memory, torch's forward
    assert torch.equal(got, want)


def test_dropout_between_layers_trains_within_the_bound():
    """Dropout between the layers, which the generic path refused (its per-example recompute
    would draw other masks), is an ordinary op of the forward here: one example moves the
    clipped sum by at most 2C."""
    g = torch.Generator().manual_seed(4)
    ids, y = torch.randint(1, V, (8, T), generator=g), torch.randint(0, K, (8,), generator=g)
    for make in (lambda: Reading(lambda: nn.LSTM(D, H, num_layers=3, dropout=0.3,
                                                 batch_first=True)),
                 lambda: Reading(lambda: nn.GRU(D, H, num_layers=2, dropout=0.5,
                                                bidirectional=True, batch_first=True))):
        assert refused_or_bounded(make, [ids], y) == "bounded"


class _Mixed(nn.Module):
    """An initial state computed from the whole batch (its mean): the hidden-state call's input
    then carries other examples' values."""

    def __init__(self):
        super().__init__()
        self.emb, self.rnn = nn.Embedding(V, D), nn.GRU(D, H, batch_first=True)
        self.head = nn.Linear(H, K)

    def forward(self, ids):
        h = self.emb(ids)
        h0 = torch.tanh(h[:, 0, :H].mean(0)).expand(1, h.shape[0], H)
        return self.head(self.rnn(h, h0)[0].mean(1))


def test_an_initial_state_from_the_batch_is_the_default_isolations_limit():
    """A state computed from the batch mean reaches every example's hidden-state rows: the model
    mixing examples itself, which the default isolation does not detect (as on the generic
    path: Note [strict isolation] lists the class); strict isolation bounds it."""
    g = torch.Generator().manual_seed(5)
    ids, y = torch.randint(1, V, (8, T), generator=g), torch.randint(0, K, (8,), generator=g)
    assert refused_or_bounded(_Mixed, [ids], y, isolation="strict") == "bounded"


class _Sub(nn.LSTM):
    pass


class _SharedWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.a, self.b = nn.GRU(D, D, batch_first=True), nn.GRU(D, D, batch_first=True)
        self.b.weight_hh_l0 = self.a.weight_hh_l0  # one parameter, two modules
        self.head = nn.Linear(D, K)

    def forward(self, ids):
        return self.head(self.b(self.a(self.emb(ids))[0])[0].mean(1))


def _tied_biases():
    model = Reading(lambda: nn.LSTM(D, H, num_layers=2, batch_first=True))
    model.rnn.bias_hh_l1 = model.rnn.bias_ih_l1  # one parameter, twice in one module
    return model


@pytest.mark.parametrize("make,tied", [
    (_SharedWeights, [["a.l0.hh", "b.l0.hh"]]),
    (_tied_biases, [["rnn.l1.ih", "rnn.l1.hh"]]),
])
def test_a_tied_weight_is_one_component_within_the_bound(make, tied):
    """A parameter two projections hold (shared with another module, or held twice by one) makes
    them one clipping component, bounded by the sum of their norms (a review: the tied bias was
    refused with a message about an escaped gradient), as any tied weight."""
    p = dpzero.make_private(make(), dataset=_data(), batch_size=8, noise_multiplier=1.0,
                            max_grad_norm=C, seed=1)
    by_component = {}
    for layer in p.privacy_engine.layers:
        assert type(layer.kind).__name__ != "FuncKind", layer.name
        by_component.setdefault(layer.component, []).append(layer.name)
    assert [names for names in by_component.values() if len(names) > 1] == tied
    g = torch.Generator().manual_seed(4)
    ids, y = torch.randint(1, V, (8, T), generator=g), torch.randint(0, K, (8,), generator=g)
    assert refused_or_bounded(make, [ids], y) == "bounded"


@pytest.mark.parametrize("make,generic", [
    (lambda: Reading(lambda: nn.LSTM(D, 6, proj_size=H, batch_first=True)), ["rnn"]),
    (lambda: Reading(lambda: _Sub(D, H, batch_first=True)), ["rnn"]),
    (lambda: Reading(lambda: nn.utils.parametrize.register_parametrization(
        nn.GRU(D, H, batch_first=True), "weight_hh_l0", _Halved())), ["rnn"]),
    (lambda: Reading(lambda: torch.nn.utils.weight_norm(nn.GRU(D, H, batch_first=True),
                                                        "weight_hh_l0")), ["rnn"]),
])
def test_what_the_kernels_cannot_take_keeps_the_generic_path(make, generic):
    """An LSTM's projection (a third weight), a subclass (its own methods), a parametrization and
    the deprecated weight_norm (computed weights): the generic path, whose step is the
    reference's."""
    torch.manual_seed(0)
    model = make()
    copyable = not hasattr(model.get_submodule(generic[0]), "weight_hh_l0_g")
    start = copy.deepcopy(model) if copyable else None
    p = dpzero.make_private(model, dataset=_data(), batch_size=8, noise_multiplier=0.0,
                            max_grad_norm=C, allow_no_noise=True, lr=LR, seed=1)
    assert sorted(layer.name for layer in p.privacy_engine.layers
                  if type(layer.kind).__name__ == "FuncKind") == generic
    if not copyable:
        return
    error = first_step_error(p, start, max_grad_norm=C, lr=LR, expected_batch=8.0)
    assert error <= 1e-5, error


class _Halved(nn.Module):
    def forward(self, w):
        return w * 0.5


def test_a_sequence_first_module_fed_batch_first_is_refused():
    """batch_first=False fed [B, T, d]: the module takes dim 1 for the examples, so its calls'
    dim 0 would hold time steps; the probe finds the examples on dim 1 and refuses at the
    forward (B = T here, where sizes alone could not tell)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, V, (T, T), generator=g)
    data = torch.utils.data.TensorDataset(ids, torch.randint(0, K, (T,), generator=g))
    class Misfed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.rnn, self.head = nn.Embedding(V, D), nn.GRU(D, H), nn.Linear(H, K)

        def forward(self, ids):
            return self.head(self.rnn(self.emb(ids))[0].mean(1))

    p = dpzero.make_private(Misfed(), dataset=data, sample_rate=1.0, noise_multiplier=1.0,
                            max_grad_norm=C, seed=1)
    x, _ = next(iter(p.data_loader))
    assert x.shape[0] == T
    with pytest.raises(dpzero.private.PrivacyViolation,
                       match=r"rnn.l0.ih.* dims \[1\] .* change with the number of examples"):
        p.model(x)


def _train(stage: int, units=None):
    torch.manual_seed(0)
    model = Reading(lambda: nn.LSTM(D, H, num_layers=2, bidirectional=True, batch_first=True),
                    initial=True)
    p = dpzero.make_private(model, dataset=_data(), batch_size=8, noise_multiplier=0.8,
                            max_grad_norm=C, lr=LR, seed=2, zero_stage=stage, units=units,
                            max_physical_batch_size=4)
    return parameters_after_steps(p, 2)


def _rank(rank, world):
    return _train(stage=3, units=["emb", "rnn", "head"])


@pytest.mark.multirank
def test_two_zero3_ranks_match_one_rank(tmp_path):
    """At stage 3 the recurrent module is a unit of its own, gathered for its forward and again
    for its backward, where the hidden-state gradients read W_hh (``_Recur``)."""
    import ranks

    single = _train(stage=0)
    results = ranks.spawn(_rank, 2, tmp_path, timeout_s=120)
    for rank in range(2):
        for name, value in single.items():
            torch.testing.assert_close(results[rank][name], value, rtol=1e-5, atol=1e-6)
