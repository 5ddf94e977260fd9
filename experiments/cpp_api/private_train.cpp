// experiments/cpp_api/private_train.cpp — private training from a LibTorch program, no Python
// (src/dp/privacy_engine.h): an MLP or a small transformer block, Poisson sampling, flat
// clipping, Gaussian noise, a privacy ledger and ε, on one rank or several (Gloo).
//
//   private_train --model mlp --steps 50                       one rank, synthetic data
//   private_train --world 2 --rank R --init tcp://127.0.0.1:29600 ...   one process per rank
//
// Flags: --model mlp|transformer, --steps, --dataset-size (N), --sigma, --allow-no-noise, --clip
// (C), --q, --lr, --delta (the δ ε is printed at), --seed, --secure-mode true|false, --stage
// 0|1|2, --max-physical-batch-size, --loss-reduction mean|sum, --epsilon-budget,
// --budget-delta, --bands (b > 1: banded correlated noise), --strategy sqrt_prefix_sum|optimized
// with --strategy-rows N (the optimized strategy is fitted to N rows), --world, --rank, --init,
// --ledger PATH, --run-id, --exchange IN OUT, --zero-loss, --freeze NAME. A refused setting exits 1 with
// the front door's message on stderr, after "private_train: ".
//
// Training mode: a synthetic task the model can learn (MLP: the class of a random linear teacher
// on x ~ N(0, I); transformer: the class of the first token), N examples; each step samples a
// Poisson logical batch with rate q, clips, noises and updates; rank 0 prints the step's loss on
// its rows, and ε at the end.
//
// Exchange mode (--exchange IN OUT), which tests/python/test_cpp_api.py uses to compare the C++
// and Python front doors: IN (torch.save of a dict) holds the model's "params" (name -> tensor)
// and the dataset "x", "y". Every rank takes one step, its loss multiplied by 0 with --zero-loss
// (leaving only the noise), and rank 0 writes the parameters after it to OUT (a dict, readable by
// torch.load). The step's batch is
//   - without "rows": step 0's Poisson sample of the dataset (the sampler the Python loader uses,
//     so the same seed gives the same batch), in micro-batches of --max-physical-batch-size;
//   - with "rows" (per rank, how many rows it takes, in order): the first sum(rows) examples,
//     each rank's share handed in as one own_batch micro-batch.
// With --freeze NAME, that parameter stops requiring grad after the backward, before the step
// (which must then refuse: Note [trained set] in src/dp/run.h).
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/serialize.h>
#include <torch/torch.h>

#include "experiments/cpp_api/models.h"
#include "src/comm/process_group.h"
#include "src/dp/privacy_engine.h"

namespace {

using dpzero::dp::MicroBatch;
using dpzero::dp::PrivacyEngine;
using dpzero::dp::PrivacyOptions;

struct Args {
  std::string model = "mlp";
  int64_t steps = 50;
  int64_t bands = 1;
  std::string strategy = "sqrt_prefix_sum";
  int64_t strategy_rows = 0;
  int64_t dataset_size = 2048;
  double sigma = 1.0, clip = 1.0, q = 0.05, lr = 0.5, delta = 1e-5;
  bool allow_no_noise = false;
  std::optional<int64_t> seed;       // unset: secure mode (Note [secure by default])
  std::optional<bool> secure_mode;
  int stage = 0;
  int64_t max_physical_batch_size = 0;
  std::string loss_reduction = "mean";
  std::optional<double> epsilon_budget, budget_delta;
  int world = 1, rank = 0;
  std::string init, ledger, run_id, exchange_in, exchange_out, freeze;
  bool zero_loss = false;
};

Args parse(int argc, char** argv) {
  Args a;
  auto need = [&](int& i) -> std::string {
    if (i + 1 >= argc) throw std::invalid_argument(std::string(argv[i]) + " needs a value");
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--model")
      a.model = need(i);
    else if (arg == "--steps")
      a.steps = std::stoll(need(i));
    else if (arg == "--dataset-size")
      a.dataset_size = std::stoll(need(i));
    else if (arg == "--sigma")
      a.sigma = std::stod(need(i));
    else if (arg == "--allow-no-noise")
      a.allow_no_noise = true;
    else if (arg == "--secure-mode") {
      const std::string v = need(i);
      if (v != "true" && v != "false")
        throw std::invalid_argument("--secure-mode must be true or false, got " + v);
      a.secure_mode = v == "true";
    } else if (arg == "--loss-reduction")
      a.loss_reduction = need(i);
    else if (arg == "--epsilon-budget")
      a.epsilon_budget = std::stod(need(i));
    else if (arg == "--budget-delta")
      a.budget_delta = std::stod(need(i));
    else if (arg == "--run-id")
      a.run_id = need(i);
    else if (arg == "--bands")
      a.bands = std::stoll(need(i));
    else if (arg == "--strategy")
      a.strategy = need(i);
    else if (arg == "--strategy-rows")
      a.strategy_rows = std::stoll(need(i));
    else if (arg == "--clip")
      a.clip = std::stod(need(i));
    else if (arg == "--q")
      a.q = std::stod(need(i));
    else if (arg == "--lr")
      a.lr = std::stod(need(i));
    else if (arg == "--delta")
      a.delta = std::stod(need(i));
    else if (arg == "--seed")
      a.seed = std::stoll(need(i));
    else if (arg == "--stage")
      a.stage = std::stoi(need(i));
    else if (arg == "--max-physical-batch-size")
      a.max_physical_batch_size = std::stoll(need(i));
    else if (arg == "--world")
      a.world = std::stoi(need(i));
    else if (arg == "--rank")
      a.rank = std::stoi(need(i));
    else if (arg == "--init")
      a.init = need(i);
    else if (arg == "--ledger")
      a.ledger = need(i);
    else if (arg == "--exchange") {
      a.exchange_in = need(i);
      a.exchange_out = need(i);
    } else if (arg == "--zero-loss")
      a.zero_loss = true;
    else if (arg == "--freeze")
      a.freeze = need(i);
    else
      throw std::invalid_argument("unknown argument " + arg);
  }
  if (a.model != "mlp" && a.model != "transformer")
    throw std::invalid_argument("--model must be mlp or transformer, got " + a.model);
  if (a.world > 1 && a.init.empty())
    throw std::invalid_argument("--world " + std::to_string(a.world) +
                                " needs --init tcp://HOST:PORT or file:///PATH");
  return a;
}

// The example's models; their sizes are the ones tests/python/test_cpp_api.py builds.
constexpr int64_t kFeatures = 64, kHidden = 32, kClasses = 10;  // MLP (sklearn digits' shape)
constexpr int64_t kVocab = 17, kLen = 16, kWidth = 32, kHeads = 2, kTokenClasses = 4;

std::shared_ptr<torch::nn::Module> make_model(const std::string& kind) {
  if (kind == "mlp") return dpzero::example::Mlp(kFeatures, kHidden, kClasses).ptr();
  return dpzero::example::Transformer(kVocab, kLen, kWidth, kHeads, kTokenClasses).ptr();
}

at::Tensor forward(const std::shared_ptr<torch::nn::Module>& model, const std::string& kind,
                   const at::Tensor& x) {
  if (kind == "mlp") return std::dynamic_pointer_cast<dpzero::example::MlpImpl>(model)->forward(x);
  return std::dynamic_pointer_cast<dpzero::example::TransformerImpl>(model)->forward(x);
}

PrivacyOptions options_of(const Args& a, int64_t dataset_size) {
  PrivacyOptions o;
  o.noise_multiplier = a.sigma;
  o.allow_no_noise = a.allow_no_noise;
  o.max_grad_norm = a.clip;
  o.sample_rate = a.q;
  o.dataset_size = dataset_size;
  if (a.max_physical_batch_size != 0) o.max_physical_batch_size = a.max_physical_batch_size;
  o.zero_stage = a.stage;
  o.optimizer.lr = a.lr;
  if (a.seed) o.seed = static_cast<uint64_t>(*a.seed);
  o.secure_mode = a.secure_mode;
  o.loss_reduction = a.loss_reduction;
  o.epsilon_budget = a.epsilon_budget;
  o.budget_delta = a.budget_delta;
  o.ledger_path = a.ledger;
  o.run_id = a.run_id;
  o.bands = a.bands;
  o.strategy = a.strategy;
  o.strategy_rows = a.strategy_rows;
  return o;
}

c10::intrusive_ptr<c10d::ProcessGroup> process_group(const Args& a) {
  if (a.world == 1) return {};
  const std::chrono::milliseconds timeout(120000);
  return dpzero::comm::make_process_group(
      "gloo", dpzero::comm::make_store(a.init, a.rank, a.world, timeout), a.rank, a.world, timeout);
}

// Note [C++ batch dimension]: the model keeps the examples on dim 0, one per row.
void check_batch_first(PrivacyEngine& engine, const std::shared_ptr<torch::nn::Module>& model,
                       const std::string& kind, const at::Tensor& x, const at::Tensor& y) {
  engine.check_batch_first([&](const at::Tensor& rows) {
    return torch::nn::functional::cross_entropy(
        forward(model, kind, x.index_select(0, rows)), y.index_select(0, rows),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  });
}

torch::IValue load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  return torch::pickle_load(bytes);
}

int exchange(const Args& a) {
  const c10::Dict<torch::IValue, torch::IValue> in = load(a.exchange_in).toGenericDict();
  const at::Tensor x = in.at("x").toTensor(), y = in.at("y").toTensor();
  auto model = make_model(a.model);
  {
    torch::NoGradGuard no_grad;
    const auto params = in.at("params").toGenericDict();
    for (auto& item : model->named_parameters()) {
      const std::string name = item.key();
      if (!params.contains(name)) throw std::invalid_argument("exchange: no value for " + name);
      item.value().copy_(params.at(name).toTensor());
    }
  }
  PrivacyEngine engine(model, options_of(a, x.size(0)), process_group(a));
  check_batch_first(engine, model, a.model, x, y);
  auto backward = [&](const at::Tensor& xs, const at::Tensor& ys) {
    at::Tensor loss = torch::cross_entropy_loss(forward(model, a.model, xs), ys);
    if (a.zero_loss) loss = loss * 0.0;
    loss.backward();
  };
  if (in.contains("rows")) {
    std::vector<int64_t> rows;  // a Python list of ints arrives as a generic list
    for (const torch::IValue& r : in.at("rows").toListRef()) rows.push_back(r.toInt());
    if (static_cast<int>(rows.size()) != a.world)
      throw std::invalid_argument("exchange: \"rows\" has " + std::to_string(rows.size()) +
                                  " entries for " + std::to_string(a.world) + " ranks");
    int64_t begin = 0, logical_size = 0;  // this rank's first row; every rank's rows
    for (int r = 0; r < a.world; ++r) {
      if (r < a.rank) begin += rows[r];
      logical_size += rows[r];
    }
    engine.own_batch(rows[a.rank], logical_size);
    backward(x.narrow(0, begin, rows[a.rank]), y.narrow(0, begin, rows[a.rank]));
  } else {
    for (const MicroBatch& mb : engine.sample()) {
      engine.hand_out(mb);
      backward(x.index_select(0, mb.indices()), y.index_select(0, mb.indices()));
    }
  }
  if (!a.freeze.empty()) {
    bool found = false;
    for (auto& item : model->named_parameters()) {
      if (item.key() != a.freeze) continue;
      item.value().requires_grad_(false);
      found = true;
    }
    if (!found) throw std::invalid_argument("--freeze: the model has no parameter " + a.freeze);
  }
  engine.step();
  c10::Dict<std::string, at::Tensor> out;
  for (auto& item : model->named_parameters()) out.insert(item.key(), engine.parameter(item.key()));
  if (a.rank == 0) {
    const std::vector<char> bytes = torch::pickle_save(out);
    std::ofstream file(a.exchange_out, std::ios::binary);
    file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!file) throw std::runtime_error("cannot write " + a.exchange_out);
  }
  return 0;
}

// The synthetic task: inputs and the labels a model can learn from them.
std::pair<at::Tensor, at::Tensor> synthetic(const std::string& kind, int64_t n) {
  torch::manual_seed(1234);  // the same data on every rank
  if (kind == "mlp") {
    const at::Tensor x = torch::randn({n, kFeatures});
    const at::Tensor teacher = torch::randn({kFeatures, kClasses});
    return {x, torch::matmul(x, teacher).argmax(1)};
  }
  const at::Tensor ids = torch::randint(kVocab, {n, kLen}, at::TensorOptions().dtype(at::kLong));
  return {ids, ids.select(1, 0) % kTokenClasses};
}

int train(const Args& a) {
  torch::manual_seed(1);  // the model's initialisation; the engine broadcasts rank 0's
  auto model = make_model(a.model);
  const auto [x, y] = synthetic(a.model, a.dataset_size);
  PrivacyEngine engine(model, options_of(a, a.dataset_size), process_group(a));
  if (a.rank == 0 && engine.seed()) {
    std::cout << "seed " << *engine.seed() << std::endl;  // to rerun it exactly
  }
  check_batch_first(engine, model, a.model, x, y);
  for (int64_t s = 0; s < a.steps; ++s) {
    double loss_sum = 0.0;
    int64_t seen = 0;
    for (const MicroBatch& mb : engine.sample()) {
      engine.hand_out(mb);
      const at::Tensor idx = mb.indices();
      const at::Tensor loss = torch::cross_entropy_loss(
          forward(model, a.model, x.index_select(0, idx)), y.index_select(0, idx));
      loss.backward();
      if (!mb.padding) {
        loss_sum += loss.item<double>() * static_cast<double>(mb.rows.size());
        seen += static_cast<int64_t>(mb.rows.size());
      }
    }
    const auto outcome = engine.step();
    if (a.rank == 0 && (s % 10 == 0 || s + 1 == a.steps))
      std::cout << "step " << outcome.step << "  loss on rank 0's rows (private, not covered by ε) "
                << (seen ? loss_sum / static_cast<double>(seen) : 0.0) << "  epsilon "
                << engine.epsilon(a.delta) << std::endl;
  }
  torch::NoGradGuard no_grad;
  const double accuracy =
      forward(model, a.model, x).argmax(1).eq(y).to(at::kDouble).mean().item<double>();
  if (a.rank == 0)
    std::cout << "trained " << a.steps << " steps on " << a.world << " rank(s): accuracy "
              << accuracy << ", epsilon " << engine.epsilon(a.delta) << " at delta " << a.delta
              << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args args = parse(argc, argv);
    return args.exchange_in.empty() ? train(args) : exchange(args);
  } catch (const std::exception& e) {
    std::cerr << "private_train: " << e.what() << std::endl;
    return 1;
  }
}
