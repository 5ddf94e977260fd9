"""Opacus's DP layers (``opacus.layers``) for scripts switched by their import.

Opacus cannot compute per-sample gradients of torch's recurrent and attention modules, so it asks
for these replacements. dpzero trains torch's own modules privately, on the kernels, so each name
here is torch's module, taking Opacus's arguments: ``DPMultiheadAttention`` is
``nn.MultiheadAttention`` itself (the same constructor; with ``batch_first=True`` Opacus's own
layer joins the heads in another order, so its output differs from torch's, which this one
gives), and the recurrent classes are torch's with Opacus's argument order (``DPRNN`` takes
``nonlinearity`` last) and its ``state_init`` keyword for the initial state. Their state dicts are Opacus's layers' (which use torch's names).
"""

from __future__ import annotations

from typing import Optional

from torch import nn

__all__ = ["DPGRU", "DPLSTM", "DPMultiheadAttention", "DPRNN"]

DPMultiheadAttention = nn.MultiheadAttention


class _StateInit:
    """``forward(input, state_init=None)``: Opacus's name for torch's ``hx``."""

    def forward(self, input, state_init=None):  # noqa: A002 - Opacus's and torch's name
        return super().forward(input, state_init)


class DPLSTM(_StateInit, nn.LSTM):
    """nn.LSTM(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
    proj_size), Opacus's order, which is torch's."""


class DPGRU(_StateInit, nn.GRU):
    """nn.GRU with Opacus's arguments (``proj_size`` must be 0, as torch's GRU requires)."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 proj_size: int = 0, device=None, dtype=None) -> None:
        if proj_size:
            raise ValueError(f"DPGRU: proj_size={proj_size}; only an LSTM has a projection "
                             "(torch's GRU has none)")
        super().__init__(input_size, hidden_size, num_layers, bias=bias, batch_first=batch_first,
                         dropout=dropout, bidirectional=bidirectional, device=device,
                         dtype=dtype)


class DPRNN(_StateInit, nn.RNN):
    """nn.RNN with Opacus's argument order: ``nonlinearity`` after ``proj_size`` (torch's
    fourth positional argument is ``nonlinearity``, Opacus's is ``bias``)."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 proj_size: int = 0, nonlinearity: str = "tanh", device=None,
                 dtype: Optional[object] = None) -> None:
        if proj_size:
            raise ValueError(f"DPRNN: proj_size={proj_size}; only an LSTM has a projection "
                             "(torch's RNN has none)")
        super().__init__(input_size, hidden_size, num_layers, nonlinearity=nonlinearity,
                         bias=bias, batch_first=batch_first, dropout=dropout,
                         bidirectional=bidirectional, device=device, dtype=dtype)
