// src/dp/run.cpp — see run.h (Note [one set of rules]).
#include "src/dp/run.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <stdexcept>

#include "accounting/banded.h"
#include "accounting/calibrate.h"
#include "accounting/types.h"
#include "privacy/clipping.h"
#include "privacy/entropy.h"
#include "src/checkpoint/crc32.h"
#include "src/comm/collectives.h"

namespace dpzero::dp {
namespace {

using accounting::format_double;

[[noreturn]] void refuse(const std::string& why) { throw std::invalid_argument(why); }

int64_t bits_of(double x) {
  int64_t b = 0;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

int64_t bits_of(const std::string& s) { return checkpoint::crc32(s.data(), s.size()); }

std::string quoted(const std::string& s) { return "'" + s + "'"; }

// The settings every rank must share, in the agreement's order. Whether a seed was given is
// agreed apart from its value, which may be any 64 bits.
std::vector<AgreedSetting> shared_settings(const RunSettings& s, bool secure) {
  const auto number = [](const char* name, double v) { return agreed(name, v); };
  const auto integer = [](const char* name, int64_t v) {
    return AgreedSetting{name, v, std::to_string(v)};
  };
  const auto flag = [](const char* name, bool v) { return agreed(name, v); };
  const auto text = [](const char* name, const std::string& v) {
    return AgreedSetting{name, bits_of(v), quoted(v)};
  };
  const auto optional = [&](const char* name, std::optional<double> v) {
    return v ? number(name, *v) : AgreedSetting{name, -1, "None"};
  };
  return {flag("seed given", s.seed.has_value()),
          s.seed ? AgreedSetting{"seed", static_cast<int64_t>(*s.seed), std::to_string(*s.seed)}
                 : AgreedSetting{"seed", 0, "None"},
          flag("secure_mode", secure),
          number("noise_multiplier", s.noise_multiplier),
          number("max_grad_norm", s.max_grad_norm),
          number("sample_rate", s.sample_rate),
          integer("dataset_size", s.dataset_size),
          s.max_physical_batch_size ? integer("max_physical_batch_size",
                                              *s.max_physical_batch_size)
                                    : AgreedSetting{"max_physical_batch_size", -1, "None"},
          text("loss_reduction", s.loss_reduction),
          text("clipping", s.clipping),
          number("automatic_gamma", s.automatic_gamma),
          text("accountant", s.accountant),
          integer("zero_stage", s.zero_stage),
          integer("bands", s.bands),
          text("strategy", s.strategy),
          integer("strategy_rows", s.strategy_rows),
          optional("epsilon_budget", s.epsilon_budget),
          optional("budget_delta", s.budget_delta)};
}

// A 63-bit seed from the OS, for a run with secure_mode=false and no seed.
uint64_t random_seed() {
  std::random_device device;
  const uint64_t hi = device(), lo = device();
  return ((hi << 32) | lo) & ((uint64_t{1} << 63) - 1);
}

// Steps 1–3: this rank's refusal, the agreement, the randomness.
void agree(const RunSettings& s, const std::vector<AgreedSetting>& own,
           const comm::Collectives& comm, RunStart& out) {
  std::optional<std::string> refusal;  // raised on every rank, by the agreement
  bool secure = false;
  privacy::ChaCha20Key key{};  // rank 0's draws, made before the agreement so that a failure
  uint64_t seed = 0;           // to draw is a refusal every rank raises
  try {
    check_run_settings(s);
    secure = privacy::secure_noise(
        s.secure_mode, s.seed ? std::optional<std::string>(std::to_string(*s.seed)) : std::nullopt);
    if (comm.rank() == 0) {
      if (secure) key = privacy::entropy_key();
      else if (!s.seed) seed = random_seed();
    }
  } catch (const std::invalid_argument& e) {
    refusal = e.what();
  } catch (const std::exception& e) {
    refusal = std::string("rank 0 could not draw the run's randomness from the OS: ") + e.what();
  }
  std::vector<AgreedSetting> settings = shared_settings(s, secure);
  settings.insert(settings.end(), own.begin(), own.end());
  agree_settings(settings, refusal, comm);
  out.secure = secure;
  if (secure) {  // rank 0's key, on every rank (Note [secure by default])
    std::vector<int64_t> words = comm.broadcast(std::vector<int64_t>(key.w, key.w + 8), 0);
    for (int i = 0; i < 8; ++i) out.key.w[i] = static_cast<uint32_t>(words[i]);
  } else if (s.seed) {
    out.seed = *s.seed;  // the same on every rank (agreed)
  } else {               // rank 0's
    out.seed = static_cast<uint64_t>(comm.broadcast({static_cast<int64_t>(seed)}, 0)[0]);
  }
}

// The strategy a ledger's header records (Note [run strategy]): refused unless it is the one
// `s` names; its coefficients, or (a header written before they were recorded) `s`'s fitted.
std::vector<double> ledger_strategy(const accounting::LedgerHeader& header, const RunSettings& s,
                                    const std::string& path) {
  const nlohmann::ordered_json& h = header.settings;
  const auto bad = [&](const char* key, const std::string& needs) {
    refuse("ledger " + path + " has " + key + " " + h[key].dump() + "; it must be " + needs +
           ". The ledger was edited: give this run its own ledger path");
  };
  if (h.contains("strategy") && !h["strategy"].is_string()) bad("strategy", "a string");
  if (h.contains("strategy_rows") && !h["strategy_rows"].is_number_integer())
    bad("strategy_rows", "an integer");
  const std::string name = h.value("strategy", std::string("sqrt_prefix_sum"));
  const int64_t rows = h.value("strategy_rows", int64_t{0});
  if (name != s.strategy || rows != s.strategy_rows)
    refuse("ledger " + path + " is for a run of strategy=" + quoted(name) +
           (rows > 0 ? " fitted to " + std::to_string(rows) + " rows" : std::string()) +
           ", this run has strategy=" + quoted(s.strategy) +
           (s.strategy_rows > 0 ? " fitted to " + std::to_string(s.strategy_rows) + " rows"
                                : std::string()) +
           ": its noise would not continue. Continue it with the ledger's strategy, or give "
           "this run its own ledger path");
  if (!h.contains("strategy_coefficients")) return run_strategy(s).coefficients();
  const nlohmann::ordered_json& c = h["strategy_coefficients"];
  std::vector<double> out;
  if (c.is_array())
    for (const auto& x : c)
      if (x.is_number()) out.push_back(x.get<double>());
  const std::string needs = std::to_string(s.bands) + " finite numbers, the first 1" +
                            (s.strategy == "sqrt_prefix_sum" ? ", the square root's" : "") +
                            ", whose column norm is finite";
  if (!c.is_array() || out.size() != c.size() ||
      !privacy::BandedToeplitz::is_run_strategy(out, s.bands) ||
      (s.strategy == "sqrt_prefix_sum" && out != run_strategy(s).coefficients()))
    bad("strategy_coefficients", needs);
  return out;
}

// Rank 0's half of step 5: the ledger created, or continued when it is this run's; `strategy`
// set to the run's coefficients (a banded run: the ledger's when it continues one).
std::shared_ptr<accounting::Ledger> open_on_rank_0(const RunSettings& s, bool secure,
                                                   int64_t world_size,
                                                   std::vector<double>& strategy) {
  const std::string& path = s.ledger_path;
  if (!std::filesystem::exists(path)) {
    if (s.bands > 1) strategy = run_strategy(s).coefficients();
    accounting::LedgerHeader header;
    header.run_id =
        s.run_id.empty() ? std::filesystem::path(path).filename().string() : s.run_id;
    header.dataset_size = s.dataset_size;
    header.settings = ledger_settings(s, secure, world_size, strategy);
    return std::make_shared<accounting::Ledger>(accounting::Ledger::create(path, header));
  }
  // A given run id must be the ledger's (Ledger::open refuses another).
  auto ledger = std::make_shared<accounting::Ledger>(
      accounting::Ledger::open(path, accounting::TornTailPolicy::kError, s.run_id));
  if (ledger->header().dataset_size != s.dataset_size)
    refuse("ledger " + path + " is for a dataset of " +
           std::to_string(ledger->header().dataset_size) + " examples, this run has " +
           std::to_string(s.dataset_size) +
           ": it holds another run's charges. Give this run its own ledger path, or continue "
           "that run with its dataset");
  const int64_t bands = accounting::header_bands(ledger->header());
  if (bands != s.bands)
    refuse("ledger " + path + " is for a run of bands=" + std::to_string(bands) +
           ", this run has bands=" + std::to_string(s.bands) +
           ": its accounting would not hold. Give this run its own ledger path");
  if (s.bands > 1) strategy = ledger_strategy(ledger->header(), s, path);
  if (ledger->has_unnoised_steps())
    refuse("ledger " + path +
           " records steps without noise; a private run cannot continue it. Give this run its "
           "own ledger path");
  for (const accounting::Phase& ph : ledger->phases())
    if (ph.steps > 0 && (ph.sigma != s.noise_multiplier || ph.q != s.sample_rate))
      refuse("ledger " + path + " holds steps at sigma=" + format_double(ph.sigma) +
             ", q=" + format_double(ph.q) + "; this run uses sigma=" +
             format_double(s.noise_multiplier) + ", q=" + format_double(s.sample_rate) +
             ". Continuing a ledger with other settings is not supported: give this run its own "
             "ledger path");
  return ledger;
}

}  // namespace

AgreedSetting agreed(const std::string& name, double value) {
  return AgreedSetting{name, bits_of(value), format_double(value)};
}

AgreedSetting agreed(const std::string& name, bool value) {
  return AgreedSetting{name, value ? 1 : 0, value ? "True" : "False"};
}

void agree_settings(const std::vector<AgreedSetting>& settings,
                    const std::optional<std::string>& refusal, const comm::Collectives& comm) {
  std::vector<int64_t> mine;
  for (const AgreedSetting& a : settings) mine.push_back(a.bits);
  const std::vector<int64_t> first = comm.broadcast(mine, 0);
  std::string differs;
  for (size_t i = 0; i < settings.size() && differs.empty(); ++i)
    if (first[i] != mine[i])
      differs = settings[i].name + "=" + settings[i].shown + " on rank " +
                std::to_string(comm.rank()) +
                " differs from rank 0's; every rank must make the model private with the same "
                "settings";
  const bool any =
      comm.all_reduce_sum(std::vector<int64_t>{!refusal && differs.empty() ? 0 : 1})[0] != 0;
  if (!any) return;
  if (refusal) refuse(*refusal);
  if (!differs.empty()) refuse(differs);
  refuse(
      "another rank's privacy settings differ from rank 0's; every rank must make the model "
      "private with the same settings");
}

void check_run_settings(const RunSettings& s) {
  const double sigma = s.noise_multiplier, c = s.max_grad_norm;
  if (!(sigma >= 0.0) || !std::isfinite(sigma))
    refuse("noise_multiplier must be finite and >= 0, got " + format_double(sigma));
  if (sigma == 0.0 && !s.allow_no_noise)
    refuse(
        "noise_multiplier=0 trains WITHOUT privacy; pass allow_no_noise=True to do that on "
        "purpose (epsilon is then reported as inf)");
  if (!(c > 0.0)) refuse("max_grad_norm must be > 0, got " + format_double(c));
  if (c < privacy::kMinClipNorm)
    refuse("max_grad_norm must be at least 2^-64 (about 5.4e-20), the smallest clip norm whose "
           "rounding the clipped sums' bound absorbs (Note [smallest clip norm]), got " +
           format_double(c));
  if (sigma > 0.0 && !std::isfinite(c))
    refuse("noise needs a finite max_grad_norm (the noise is sigma * C), got " +
           format_double(c));
  // The noise kernels draw in float32 (privacy/noise.h): the standard deviation must be one.
  if (sigma > 0.0 && !(sigma * c <= std::numeric_limits<float>::max()))
    refuse("the noise's standard deviation noise_multiplier * max_grad_norm must be finite, got " +
           format_double(sigma) + " * " + format_double(c) + " (above float32's " +
           format_double(std::numeric_limits<float>::max()) + ")");
  if (!(s.sample_rate > 0.0 && s.sample_rate <= 1.0))
    refuse("sample_rate must be in (0, 1], got " + format_double(s.sample_rate));
  if (s.dataset_size <= 0)
    refuse("dataset_size must be > 0, got " + std::to_string(s.dataset_size));
  if (s.max_physical_batch_size && *s.max_physical_batch_size < 1)
    refuse("max_physical_batch_size must be >= 1, got " +
           std::to_string(*s.max_physical_batch_size));
  if (s.loss_reduction != "mean" && s.loss_reduction != "sum")
    refuse("loss_reduction must be 'mean' or 'sum', got " + quoted(s.loss_reduction));
  if (s.clipping != "flat" && s.clipping != "layer" && s.clipping != "group" &&
      s.clipping != "automatic")
    refuse("clipping must be one of ('flat', 'layer', 'group', 'automatic'), got " +
           quoted(s.clipping));
  if (s.clipping == "automatic" && !std::isfinite(c))
    refuse("automatic clipping needs a finite max_grad_norm, got " + format_double(c));
  if (!(s.automatic_gamma > 0.0) || !std::isfinite(s.automatic_gamma))
    refuse("automatic_gamma must be finite and > 0, got " + format_double(s.automatic_gamma));
  if (s.accountant != "rdp" && s.accountant != "prv")
    refuse("accountant must be one of ('rdp', 'prv'), got " + quoted(s.accountant));
  if (s.bands < 1) refuse("bands must be >= 1, got " + std::to_string(s.bands));
  if (s.bands > 1 && sigma == 0.0)
    refuse("bands=" + std::to_string(s.bands) +
           " correlates the noise across steps, and noise_multiplier=0 adds none; use bands=1");
  if (s.bands > s.dataset_size && s.dataset_size > 0)
    refuse("bands=" + std::to_string(s.bands) + " splits the data into that many partitions, " +
           "and the dataset has " + std::to_string(s.dataset_size) + " examples");
  if (s.strategy != "sqrt_prefix_sum" && s.strategy != "optimized")
    refuse("strategy must be 'sqrt_prefix_sum' or 'optimized', got " + quoted(s.strategy));
  if (s.strategy != "sqrt_prefix_sum" && s.bands == 1)
    refuse("strategy=" + quoted(s.strategy) +
           " with bands=1: one band is DP-SGD's independent noise, which has no strategy to "
           "fit; give bands > 1");
  if (s.strategy == "optimized" && s.strategy_rows < 1)
    refuse("strategy='optimized' fits the strategy to the run's length and needs strategy_rows "
           ">= 1 (make_private: epochs or steps), got " + std::to_string(s.strategy_rows));
  if (s.strategy == "optimized" &&
      static_cast<double>(s.strategy_rows) * static_cast<double>(s.bands) *
              static_cast<double>(s.bands) >
          privacy::BandedToeplitz::kMaxOptimizedWork)
    refuse("strategy='optimized' with strategy_rows=" + std::to_string(s.strategy_rows) +
           " and bands=" + std::to_string(s.bands) + ": the fit's work, rows × bands², is above " +
           format_double(privacy::BandedToeplitz::kMaxOptimizedWork) +
           "; fit it to fewer steps, or use strategy='sqrt_prefix_sum'");
  if (s.strategy != "optimized" && s.strategy_rows != 0)
    refuse("strategy_rows=" + std::to_string(s.strategy_rows) + " is read by strategy='optimized' "
           "only, and this run has strategy=" + quoted(s.strategy) + "; leave it 0");
  if (s.zero_stage < 0 || s.zero_stage > 3)
    refuse("zero_stage must be 0, 1, 2 or 3, got " + std::to_string(s.zero_stage));
  if (s.budget_delta && !(*s.budget_delta > 0.0 && *s.budget_delta < 1.0))
    refuse("budget_delta must be in (0, 1), got " + format_double(*s.budget_delta));
  if (s.epsilon_budget) {
    const double eps = *s.epsilon_budget;
    if (!(eps > 0.0) || !std::isfinite(eps))
      refuse("epsilon_budget must be finite and > 0, got " + format_double(eps));
    if (!s.budget_delta) refuse("epsilon_budget=" + format_double(eps) + " needs budget_delta");
    if (sigma == 0.0)
      refuse("an epsilon budget cannot be kept without noise (noise_multiplier=0)");
  }
}

nlohmann::ordered_json ledger_settings(const RunSettings& s, bool secure, int64_t world_size,
                                       const std::vector<double>& strategy) {
  nlohmann::ordered_json out = {{"accountant", s.accountant},
                                {"clipping", s.clipping},
                                {"secure_mode", secure},
                                {"world_size", world_size}};
  if (s.bands > 1) {  // what ε is computed from (accounting/banded.h), and the noise's strategy
    out["bands"] = s.bands;
    out["strategy"] = s.strategy;  // Note [run strategy]
    if (s.strategy_rows > 0) out["strategy_rows"] = s.strategy_rows;
    out["strategy_coefficients"] = strategy;
  }
  return out;
}

privacy::BandedToeplitz run_strategy(const RunSettings& s) {
  if (s.bands == 1) return privacy::BandedToeplitz::identity();
  if (s.strategy == "optimized") return privacy::BandedToeplitz::optimized(s.bands, s.strategy_rows);
  return privacy::BandedToeplitz::sqrt_prefix_sum(s.bands);
}

NoiseKey RunStart::noise_key() const {
  NoiseKey k;
  if (secure) {
    k.secure = true;
    k.key.assign(key.w, key.w + 8);
  } else {
    k.seed = static_cast<int64_t>(seed);
  }
  return k;
}

StepSettings RunStart::step_settings(const RunSettings& s) const {
  StepSettings out;
  out.noise_multiplier = s.noise_multiplier;
  out.max_grad_norm = s.max_grad_norm;
  out.sample_rate = s.sample_rate;
  out.dataset_size = s.dataset_size;
  out.max_steps = max_steps;
  out.budget = budget;
  out.noise_key = noise_key();
  out.bands = s.bands;
  out.strategy = strategy;
  return out;
}

RunStart start_run(const RunSettings& s, const std::vector<AgreedSetting>& own,
                   const comm::Collectives& comm, accounting::Accountant& accountant) {
  RunStart out;
  agree(s, own, comm, out);

  // 4. The budget, before any file is made: a PRV that cannot count its steps refuses the run.
  if (s.epsilon_budget) {
    accounting::CalibrationOptions options;
    options.accountant = accounting::parse_accountant_kind(s.accountant);
    try {  // the same inputs on every rank, so the same outcome
      out.max_steps = accounting::steps_for_epsilon(*s.epsilon_budget, *s.budget_delta,
                                                    s.sample_rate, s.noise_multiplier, options);
    } catch (const std::runtime_error& e) {
      refuse("epsilon_budget=" + format_double(*s.epsilon_budget) +
             ": the steps it allows cannot be counted: " + e.what());
    }
    out.budget = "epsilon=" + format_double(*s.epsilon_budget) +
                 " at delta=" + format_double(*s.budget_delta) + " (" + s.accountant + ")";
  }
  // 5. The ledger: rank 0 opens it, every rank learns the outcome and the charge count.
  std::vector<double> strategy;  // rank 0's: the ledger's, or fitted below
  if (!s.ledger_path.empty()) {
    std::string failure;
    bool refused = false;  // a ledger of another run, rather than one that cannot be opened
    int64_t charges = 0, rows = 0;
    if (comm.rank() == 0) {
      try {
        out.ledger = open_on_rank_0(s, out.secure, comm.world_size(), strategy);
        charges = out.ledger->total_steps();
        rows = out.ledger->rows();
      } catch (const std::invalid_argument& e) {
        failure = e.what();
        refused = true;
      } catch (const std::exception& e) {
        failure = e.what();
      }
      if (!failure.empty()) out.ledger.reset();
    }
    const std::vector<int64_t> agreed = comm.all_reduce_sum(
        std::vector<int64_t>{failure.empty() ? 0 : 1, refused ? 1 : 0, charges, rows});
    if (agreed[0] != 0) {
      if (refused) refuse(failure);
      if (!failure.empty()) throw accounting::LedgerError(failure);
      if (agreed[1] != 0)
        refuse("rank 0 refused the privacy ledger " + s.ledger_path + "; see its error");
      throw accounting::LedgerError("rank 0 could not open the privacy ledger " + s.ledger_path +
                                    "; see its error");
    }
    out.charges = agreed[2];  // rank 0's
    out.rows = agreed[3];
    // Every recorded step is noised at this run's σ and q (checked above).
    const int64_t steps = accounting::equivalent_steps(out.charges, out.rows, s.bands);
    if (steps > 0) accountant.step(s.sample_rate, s.noise_multiplier, steps);
  }

  // 6. The strategy (Note [run strategy]): rank 0's coefficients, as bits, on every rank. The
  // settings were checked and agreed, so the fit cannot throw, and every rank knows b.
  if (s.bands > 1) {
    if (comm.rank() == 0 && strategy.empty()) strategy = run_strategy(s).coefficients();
    std::vector<int64_t> bits(static_cast<size_t>(s.bands), 0);
    if (comm.rank() == 0)
      for (size_t i = 0; i < bits.size(); ++i) bits[i] = bits_of(strategy[i]);
    bits = comm.broadcast(bits, 0);
    out.strategy.resize(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) std::memcpy(&out.strategy[i], &bits[i], sizeof(double));
  }
  return out;
}

std::vector<int64_t> layer_components(const std::vector<std::vector<int64_t>>& params) {
  std::vector<size_t> parent(params.size());
  std::iota(parent.begin(), parent.end(), 0);
  const auto find = [&](size_t i) {
    while (parent[i] != i) {
      parent[i] = parent[parent[i]];
      i = parent[i];
    }
    return i;
  };
  std::map<int64_t, size_t> first_layer;  // parameter -> the first layer holding it
  for (size_t l = 0; l < params.size(); ++l)
    for (int64_t p : params[l]) {
      auto [it, fresh] = first_layer.emplace(p, l);
      if (!fresh) parent[find(l)] = find(it->second);
    }
  std::map<size_t, int64_t> number;  // root -> component, in order of first layer
  std::vector<int64_t> out;
  for (size_t l = 0; l < params.size(); ++l)
    out.push_back(number.emplace(find(l), static_cast<int64_t>(number.size())).first->second);
  return out;
}

std::optional<std::string> trained_set_refusal(
    const std::vector<at::Tensor>& trained,
    const std::vector<std::pair<std::string, at::Tensor>>& now) {
  std::set<const void*> fixed, trainable, present;
  for (const at::Tensor& p : trained) fixed.insert(p.unsafeGetTensorImpl());
  std::vector<std::string> moved;  // trainable now and not then, or the other way
  for (const auto& [name, p] : now) {
    if (!p.defined()) continue;
    const void* impl = p.unsafeGetTensorImpl();
    if (!present.insert(impl).second) continue;  // a tied parameter listed twice
    if (p.requires_grad()) trainable.insert(impl);
    if (p.requires_grad() != (fixed.count(impl) > 0)) moved.push_back(name);
  }
  if (trainable == fixed) return std::nullopt;
  int64_t gone = 0;
  for (const void* impl : fixed) gone += present.count(impl) == 0 ? 1 : 0;
  std::string what;
  if (!moved.empty()) {
    what = "trainable or frozen since: [";
    for (size_t i = 0; i < moved.size() && i < 5; ++i) what += (i ? ", '" : "'") + moved[i] + "'";
    what += moved.size() > 5 ? "]..." : "]";
  }
  if (gone > 0) {
    what += std::string(what.empty() ? "" : "; ") + std::to_string(gone) +
            " trained parameter(s) no longer in the model";
  }
  return "the trainable parameters changed since the model was made private (" + what +
         "); freeze, unfreeze, add or remove parameters before make_private or before the "
         "PrivacyEngine takes the model";
}

}  // namespace dpzero::dp
