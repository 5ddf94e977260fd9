"""The errors a private run raises, C++'s own types (src/dp/errors.h): the step's transaction
(src/dp/private_step.h), the clipping book and the Python side raise the same ones."""

from __future__ import annotations

from .. import _C

# A gradient would escape clipping or be counted twice, or the model cannot be trained privately
# as built. Raised by the C++ book (dp::PrivacyError) and by the Python side alike.
PrivacyViolation = _C.dp.PrivacyError
# The next step would spend more than the run's ε budget; nothing was charged or applied.
BudgetExhausted = _C.dp.BudgetExhausted
# A collective of the private step failed on this rank: a peer rank died, hung past the process
# group's timeout (torch.distributed.init_process_group(timeout=...)), or lost its connection.
# Its message and its ``charged`` attribute say whether the step had been charged to the ledger
# (True, False, or None: rank 0's ledger may hold it).
CollectiveError = _C.dp.CollectiveError
# The step was charged to the ledger and then failed on this rank for another reason (the
# accountant raised, the update ran out of memory): not applied here, its privacy cost counts. Its
# message names the step, the charge and the cause; ``charged`` is always True.
UpdateError = _C.dp.UpdateError
UpdateError.charged = True
