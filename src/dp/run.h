// src/dp/run.h — the rules a private run starts by, written once for every front door: which
// settings are valid, how the ranks agree on them and on the run's randomness, how the privacy
// ledger is opened or continued, what the ε budget allows, and which DP layers form one clipping
// component. The C++ front door (privacy_engine.h) and Python's (python/dpzero/private/engine.py,
// through dpzero._C.dp) call these functions and repeat none of their rules.
//
// Note [one set of rules]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Two front doors that each wrote these rules drifted apart: one reopened a ledger without
// checking its run id, one refused layers sharing parameters that the other joined, each named a
// differing setting its own way. Here a rule is code both call, so a refusal is the same text
// from either (tests/python/test_cpp_api.py runs one table of bad settings through both and
// compares the messages, and the ledgers of equal runs byte for byte). What stays in a front door
// is what only it has: its options' names and types, its model traversal (torch::nn in C++,
// torch.nn in Python), and its own capabilities (the C++ door clips flat, at stages 0–2).
//
// Order at start (start_run), every rank:
//   1. check        this rank's settings (check_run_settings), Note [secure by default]'s rule,
//                   and rank 0's draw of the key or seed from the OS; a refusal (or a failed
//                   draw) is kept, not thrown, until step 2 has run;
//   2. agreement    agree_settings: rank 0's settings (whether a seed was given, and which)
//                   broadcast; any rank's refusal or difference is raised on every rank (no
//                   rank waits alone in a later collective), this rank naming its own;
//   3. randomness   secure mode: rank 0's key on every rank; else the seed given, or rank 0's;
//   4. budget       the steps the ε budget allows at (q, σ) with the run's accountant (the same
//                   inputs everywhere, so the same outcome), before any file is made;
//   5. ledger       rank 0 creates the ledger or continues it (its run id, dataset, σ, q,
//                   bands and strategy must be this run's, and every step it holds noised);
//                   every rank learns the outcome, the charge count and the rows, and the run's
//                   accountant composes the charges (a banded run: its equivalent steps, Note
//                   [amplified banded accounting] in accounting/banded.h);
//   6. strategy     a banded run's strategy coefficients, rank 0's on every rank (Note [run
//                   strategy]).
// A front door may also call check_run_settings on its own before it touches the model (both do,
// to refuse before any change); that refusal is this rank's alone, as any check of a rank's own
// arguments is.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "accounting/accountant.h"
#include "accounting/ledger.h"
#include "privacy/banded.h"
#include "privacy/chacha20.h"
#include "src/dp/private_step.h"

namespace dpzero::comm {
class Collectives;
}

namespace dpzero::dp {

// The settings every front door has, as the rules read them. Its defaults are every front door's
// (Python's config.py reads them from here).
struct RunSettings {
  double noise_multiplier = 1.0;        // σ, finite and >= 0
  bool allow_no_noise = false;          // σ = 0 needs it (ε is then infinite)
  double max_grad_norm = 1.0;           // C > 0; inf (no clipping) only with σ = 0
  double sample_rate = 0.0;             // q in (0, 1]
  int64_t dataset_size = 0;             // N > 0
  std::optional<int64_t> max_physical_batch_size;  // rows per micro-batch at most (>= 1); none: no cap
  std::string loss_reduction = "mean";  // "mean" or "sum"
  std::string clipping = "flat";        // "flat", "layer", "group" or "automatic"
  double automatic_gamma = 0.01;        // automatic clipping's γ, finite and > 0
  std::string accountant = "prv";       // "rdp" or "prv"
  int64_t zero_stage = 0;               // 0..3
  std::optional<double> epsilon_budget;  // > 0; needs budget_delta and σ > 0
  std::optional<double> budget_delta;    // in (0, 1)
  int64_t bands = 1;                     // >= 1: banded correlated noise with this many bands
                                         // (Note [banded steps] in private_step.h); 1: DP-SGD
  std::string strategy = "sqrt_prefix_sum";  // with bands > 1: "sqrt_prefix_sum" or "optimized"
                                             // (Note [run strategy])
  int64_t strategy_rows = 0;  // "optimized" only: the run's length in rows it is fitted to (>= 1)
  std::optional<uint64_t> seed;          // Note [secure by default] in privacy/entropy.h
  std::optional<bool> secure_mode;
  std::string ledger_path;  // "": no ledger
  std::string run_id;       // the ledger's run id; "": the ledger file's name
};

// Throws std::invalid_argument naming the first bad setting and its value.
void check_run_settings(const RunSettings& settings);

// A front door's own setting that every rank must share: its name, its value as 64 bits (a
// float's IEEE bits, a string's hash), and the value as the refusal shows it.
struct AgreedSetting {
  std::string name;
  int64_t bits = 0;
  std::string shown;
};

// Every rank of `comm` calls it with settings of the same names in the same order: rank 0's
// values are broadcast, and if any rank has a `refusal` or a value unlike rank 0's, every rank
// throws std::invalid_argument: its own refusal, else the first of its settings that differs
// ("max_grad_norm=2 on rank 1 differs from rank 0's; ..."), else that another rank's did.
void agree_settings(const std::vector<AgreedSetting>& settings,
                    const std::optional<std::string>& refusal, const comm::Collectives& comm);

// A front door's own setting of a number or a flag, as agreed (a number by its IEEE bits).
AgreedSetting agreed(const std::string& name, double value);
AgreedSetting agreed(const std::string& name, bool value);

// What start_run decided.
struct RunStart {
  bool secure = false;             // Note [secure by default]
  uint64_t seed = 0;               // the Philox seed (rank 0's); unused in secure mode
  privacy::ChaCha20Key key{};      // secure mode's key (rank 0's); never written anywhere
  std::shared_ptr<accounting::Ledger> ledger;  // rank 0's, when the run has a ledger path
  int64_t charges = 0;             // the steps the ledger already holds (Note [noise index])
  int64_t rows = 0;                // one more than the last step the ledger holds
  // The sampler's first step: past every charge index and every step the ledger holds (a
  // banded run never reuses a row, Note [amplified banded accounting] in accounting/banded.h).
  int64_t first_step() const { return charges > rows ? charges : rows; }
  std::optional<int64_t> max_steps;  // the ε budget's steps at (q, σ); nullopt: no budget
  std::string budget;              // the budget as BudgetExhausted names it
  std::vector<double> strategy;    // bands > 1: c_0 .. c_{b−1} (Note [run strategy]); else empty

  NoiseKey noise_key() const;
  // The step's settings (private_step.h) for `settings`.
  StepSettings step_settings(const RunSettings& settings) const;
};

// Note [run strategy]
// ~~~~~~~~~~~~~~~~~~~
// A banded run's noise is C⁻¹z for a b-banded Toeplitz strategy C with c_0 = 1 (Note [banded
// strategies] in privacy/banded.h). RunSettings::strategy names it: "sqrt_prefix_sum", the banded
// square root of the prefix sums, which needs nothing but b; or "optimized", the b-banded
// strategy of least expected error for a run of strategy_rows rows (Note [optimized banded
// strategies]), which a front door derives from the run's length (make_private: its epochs).
// Which strategy a run takes changes its noise's correlation, never its ε: the step scales the
// noise by the strategy's largest column norm κ, so every strategy's columns have norm at most 1,
// which is all the amplified accounting reads (Note [amplified banded accounting]).
//
// The coefficients are computed once, by rank 0, and broadcast as their bits, so every rank
// adds the same noise by construction (the fit is iterative floating point; nothing else needs
// two ranks to have computed it alike). The ledger's header records the strategy's name, rows
// and coefficients; a run that continues a ledger must name the same strategy and rows and takes
// the coefficients the ledger holds, so a resumed run's noise continues the same C⁻¹z (Note
// [correlated noise on shards]) without fitting again, on any build. A run resumed from a
// PrivacyEngine.state_dict(), which records the same three, must have them too (Python's
// load_state_dict refuses another): rows drawn through one C⁻¹ and then another are no banded
// mechanism (a column of the stitched matrix can exceed norm 1). The fit's work, rows × b², is
// bounded (BandedToeplitz::kMaxOptimizedWork).
//
// Steps 1–6 of Note [one set of rules] on every rank of `comm`, which must all call it.
// `accountant` (its kind is settings.accountant's) composes the charges a continued ledger holds.
// Throws std::invalid_argument for a bad or differing setting and for a ledger of another run
// (every rank), accounting::LedgerError for a ledger that cannot be created or opened (every
// rank), std::runtime_error from c10d for a failed collective.
RunStart start_run(const RunSettings& settings, const std::vector<AgreedSetting>& own,
                   const comm::Collectives& comm, accounting::Accountant& accountant);

// The ledger header's settings of a run (the same from every front door, so that equal runs
// write equal ledgers); `strategy`: the banded run's coefficients (Note [run strategy]).
nlohmann::ordered_json ledger_settings(const RunSettings& settings, bool secure,
                                       int64_t world_size, const std::vector<double>& strategy);

// Note [run strategy]: the strategy `settings` names, fitted here (bands 1: the identity).
privacy::BandedToeplitz run_strategy(const RunSettings& settings);

// Note [trained set]
// ~~~~~~~~~~~~~~~~~~
// A front door clips the parameters that were trainable when it took the model, and no others: a
// parameter unfrozen since would be updated by a gradient nothing clipped, one frozen since would
// still get noise and updates. So every step compares the model's trainable parameters with that
// set and refuses any difference. Each door lists its own model (torch.nn or torch::nn) and may
// detect a difference its own cheap way; the rule, which tensors count and what the refusal
// says, is this function.
//
// The refusal for `now` (the model's parameters, name and tensor, as the front door lists them)
// against `trained` (the tensors trainable when the door took the model), by tensor identity;
// nullopt when the trainable tensors of `now` are exactly `trained`.
std::optional<std::string> trained_set_refusal(
    const std::vector<at::Tensor>& trained,
    const std::vector<std::pair<std::string, at::Tensor>>& now);

// Clipping components: DP layers that share a trained parameter are clipped together. `params`:
// for each layer (in the front door's order), its trained parameters' identities (any value
// naming a tensor, the same for a tied one). Returns each layer's component, numbered
// 0..K-1 in order of each component's first layer (union-find over shared identities).
std::vector<int64_t> layer_components(const std::vector<std::vector<int64_t>>& params);

}  // namespace dpzero::dp
