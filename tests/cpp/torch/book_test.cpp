// tests/cpp/torch/book_test.cpp — the clipping book's invariants (src/dp/book.h), on a real ZeRO
// engine (one rank, a Gloo group over a HashStore), each against a per-example reference computed
// with autograd in float64.
//
// The model: one unit holding W [3, 4] and V [2, 3] (Linear weights, no bias). W is called twice
// per example (a component of two parts, like a tied embedding and head), V once; flat clipping
// with C = 1 puts both in one group.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include "src/comm/process_group.h"
#include "src/dp/book.h"
#include "src/dp/dp_layers.h"
#include "src/dp/layer_ops.h"
#include "src/zero/flat_param.h"
#include "src/zero/state.h"
#include "tests/cpp/torch/ranks.h"  // (turns c10d's flight recorder off)

namespace dpzero::dp {
namespace {

constexpr int64_t kB = 5, kT = 3;
constexpr double kC = 1.0;

// One rank's engine over the two weights, stage 0, private: the book adds into its own buffer.
struct Engine {
  Engine() {
    auto store = c10::make_intrusive<c10d::HashStore>();
    auto pg = comm::make_process_group("gloo", store, 0, 1, std::chrono::seconds(60));
    w = torch::randn({3, 4}).requires_grad_();
    v = torch::randn({2, 3}).requires_grad_();
    zero::ZeroConfig config;
    state = std::make_unique<zero::ZeroState>(
        std::vector<zero::UnitSpec>{{"unit", {w, v}, {"w", "v"}, {0, 12}}}, 18, config, pg);
    state->set_private(true);
  }
  at::Tensor w, v;
  zero::UnitLayout layout{{{12, 0}, {6, 12}}, 1, /*alignment=*/4};
  std::unique_ptr<zero::ZeroState> state;

  // The book over W (called twice: component 0) and V (component 1), one flat group; with
  // `generic_v`, V takes the generic path (the caller reports its per-sample gradients).
  Book book(bool mean_loss = false, bool generic_v = false) {
    return Book(layers(generic_v), options(mean_loss), *state);
  }
  // The same, owned as a model's is (its backward queues finish_backward itself).
  std::shared_ptr<Book> shared_book() {
    auto book = std::make_shared<Book>(layers(false), options(false), *state);
    book->set_queue_finish(true);
    return book;
  }
  std::vector<BookLayer> layers(bool generic_v) {
    std::vector<BookLayer> layers;
    layers.push_back({"w",
                      linear_ops({true, false}, false),
                      {Slot{0, layout.flat_offsets()[0], 12, {3, 4}}, std::nullopt},
                      0,
                      0});
    if (generic_v) {
      layers.push_back({"v", nullptr, {Slot{0, layout.flat_offsets()[1], 6, {2, 3}}}, 1, 0});
    } else {
      layers.push_back({"v",
                        linear_ops({true, false}, false),
                        {Slot{0, layout.flat_offsets()[1], 6, {2, 3}}, std::nullopt},
                        1,
                        0});
    }
    return layers;
  }
  BookOptions options(bool mean_loss) {
    return BookOptions{
        {kC}, {2}, "flat", 0.01, mean_loss, {layout.padded_numel()}, {at::Device(at::kCPU)}};
  }
  // What the book added into the engine's gradient buffer (Note [private accumulator]).
  at::Tensor grad_w() { return state->grad_accumulator(0).narrow(0, 0, 12).view({3, 4}); }
  at::Tensor grad_v() {
    return state->grad_accumulator(0).narrow(0, layout.flat_offsets()[1], 6).view({2, 3});
  }
};

// One micro-batch's inputs and output gradients: W's two calls read x1, x2; V reads z.
struct Batch {
  at::Tensor x1 = torch::randn({kB, kT, 4}), x2 = torch::randn({kB, kT, 4}),
             z = torch::randn({kB, kT, 3});
  at::Tensor g1 = torch::randn({kB, kT, 3}) * 3, g2 = torch::randn({kB, kT, 3}) * 3,
             g3 = torch::randn({kB, kT, 2}) * 3;
};

// Runs the micro-batch through the book: three forward calls, their backwards, the end.
void run(Book& book, const Batch& x) {
  const int64_t p0 = book.on_forward(0), p1 = book.on_forward(0), p2 = book.on_forward(1);
  for (int64_t p : {p0, p1, p2}) book.set_verdict(p);
  const int64_t gen = book.generation();
  book.on_backward(gen, p2, x.z, x.g3);
  book.on_backward(gen, p0, x.x1, x.g1);
  book.on_backward(gen, p1, x.x2, x.g2);
  book.finish_backward();
}

// Per example i, with autograd in float64: each part's gradient (W's two calls separately).
struct Reference {
  at::Tensor w, v;   // expected clipped sums
  at::Tensor bound;  // [B] the certified norm's exact value: sqrt((|g_w1| + |g_w2|)^2 + |g_v|^2)
};

Reference reference(const Engine& e, const Batch& x, const at::Tensor& keep) {
  auto grad_of = [](const at::Tensor& param, const at::Tensor& in, const at::Tensor& g) {
    at::Tensor p = param.detach().to(at::kDouble).requires_grad_();
    at::Tensor loss = (at::matmul(in.to(at::kDouble), p.t()) * g.to(at::kDouble)).sum();
    return torch::autograd::grad({loss}, {p})[0];
  };
  Reference ref{torch::zeros({3, 4}, at::kDouble), torch::zeros({2, 3}, at::kDouble),
                torch::zeros({kB}, at::kDouble)};
  for (int64_t i = 0; i < kB; ++i) {
    const at::Tensor a = grad_of(e.w, x.x1[i], x.g1[i]), b = grad_of(e.w, x.x2[i], x.g2[i]),
                     c = grad_of(e.v, x.z[i], x.g3[i]);
    const double n =
        std::hypot(a.norm().item<double>() + b.norm().item<double>(), c.norm().item<double>());
    ref.bound[i] = n;
    if (!keep[i].item<bool>()) continue;
    const double factor = std::min(1.0, kC / (n + 1e-6));  // privacy/clipping.h, flat
    ref.w += factor * (a + b);
    ref.v += factor * c;
  }
  return ref;
}

// The engine's buffer holds the reference's clipped sums for W and V.
void expect_reference_sums(Engine& e, const Reference& ref) {
  EXPECT_TRUE(torch::allclose(e.grad_w().to(at::kDouble), ref.w, 1e-5, 1e-6))
      << e.grad_w() << ref.w;
  EXPECT_TRUE(torch::allclose(e.grad_v().to(at::kDouble), ref.v, 1e-5, 1e-6))
      << e.grad_v() << ref.v;
}

// Every trained parameter is clipped exactly once per sample, W shared by two calls included: the
// sums equal the per-example reference whose factor bounds the sum of W's two parts' norms
// (Note [certified group norms]). Mutations tried: W's parts as two components (sqrt of the sum of
// squares, too small a bound) and a clipped sum added twice both fail here.
TEST(Book, EveryParameterIsClippedOncePerSampleSharedOnesIncluded) {
  torch::manual_seed(1);
  Engine e;
  Book book = e.book();
  Batch x;
  run(book, x);
  const Reference ref = reference(e, x, torch::ones({kB}, at::kBool));
  ASSERT_TRUE((ref.bound > kC * 1.5).all().item<bool>()) << "every sample must be clipped";
  expect_reference_sums(e, ref);
  const StepStats stats = book.take_stats();
  EXPECT_EQ(stats.samples, kB);
  EXPECT_EQ(stats.dropped, 0);
  EXPECT_EQ(stats.micro_batches, 1);
}

// Note [shared inputs]: W's two calls reading the very same input tensor have their weight norms
// computed together (one linear_sq_norms_multi); the sums are the reference's all the same.
// dests() views each slot of the unit's flat buffer as its parameter's shape: a slot whose
// shape does not hold exactly its elements would view a neighbour's gradient. Refused at
// construction, naming the layer.
TEST(Book, ASlotWhoseShapeDoesNotMatchItsSizeIsRefused) {
  Engine e;
  std::vector<BookLayer> layers = e.layers(false);
  layers[1].slots[0]->shape = {3, 3};  // 9 elements for a slot of 6
  try {
    Book book(std::move(layers), e.options(false), *e.state);
    FAIL() << "a slot of 6 elements with shape [3, 3] was accepted";
  } catch (const c10::Error& err) {
    EXPECT_NE(std::string(err.what()).find("layer 'v' has a slot of 6 elements with shape [3, 3]"),
              std::string::npos)
        << err.what();
  }
  Book fine(e.layers(false), e.options(false), *e.state);  // the true shapes are accepted
}

TEST(Book, CallsOnOneInputAreClippedLikeTheReference) {
  torch::manual_seed(7);
  Engine e;
  Book book = e.book();
  Batch x;
  x.x2 = x.x1;
  run(book, x);
  const Reference ref = reference(e, x, torch::ones({kB}, at::kBool));
  expect_reference_sums(e, ref);
}

// Note [norms when their input is done]: W [3, 4] (clipping group 0, C = 1) and U [2, 4] (group 1,
// C = 0.5) are each called on x and on y, so that neither group is clipped alone. Noted at the
// forward, x's two calls, one of each group, get their weight norms in one op as soon as both
// have reported, before either group completes; y's are computed as before (W's when its group
// completes, U's when it reports last). The sets only decide which calls share one op, so the
// clipped sums are bitwise those of the book that notes nothing. A call whose reported A is not
// the tensor it noted (a copy) leaves its set and waits for its group: the same sums again.
// Mutation tried: handing a set's norms out in the wrong order fails (each group's factors then
// come from the other's norms).
TEST(Book, NormsOfAFinishedInputAreTheGroupsOwn) {
  torch::manual_seed(8);
  const at::Tensor x = torch::randn({kB, kT, 4}), y = torch::randn({kB, kT, 4});
  const std::vector<at::Tensor> g = {torch::randn({kB, kT, 3}) * 3, torch::randn({kB, kT, 2}),
                                     torch::randn({kB, kT, 3}), torch::randn({kB, kT, 2}) * 2};
  auto sums = [&](int noting) {  // 0: nothing noted; 1: every call; 2: one call's A a copy
    auto store = c10::make_intrusive<c10d::HashStore>();
    auto pg = comm::make_process_group("gloo", store, 0, 1, std::chrono::seconds(60));
    const at::Tensor w = torch::randn({3, 4}).requires_grad_(), u = torch::randn({2, 4});
    const zero::UnitLayout layout({{12, 0}, {8, 12}}, 1, /*alignment=*/4);
    zero::ZeroState state({{"unit", {w, u.requires_grad_()}, {"w", "u"}, {0, 12}}}, 20,
                          zero::ZeroConfig{}, pg);
    state.set_private(true);
    std::vector<BookLayer> layers;
    layers.push_back({"w", linear_ops({true, false}, false),
                      {Slot{0, layout.flat_offsets()[0], 12, {3, 4}}, std::nullopt}, 0, 0});
    layers.push_back({"u", linear_ops({true, false}, false),
                      {Slot{0, layout.flat_offsets()[1], 8, {2, 4}}, std::nullopt}, 1, 1});
    Book book(std::move(layers),
              BookOptions{{1.0, 0.5}, {1, 1}, "flat", 0.01, false, {layout.padded_numel()},
                          {at::Device(at::kCPU)}},
              state);
    // W on x, U on x, W on y, U on y; reported in that order.
    const std::vector<int64_t> parts = {book.on_forward(0), book.on_forward(1),
                                        book.on_forward(0), book.on_forward(1)};
    const std::vector<at::Tensor> inputs = {x, x, y, y};
    for (int64_t p : parts) book.set_verdict(p);
    const int64_t gen = book.generation();
    if (noting > 0) {
      for (size_t i = 0; i < parts.size(); ++i) book.note_input(gen, parts[i], inputs[i]);
    }
    for (size_t i = 0; i < parts.size(); ++i) {
      book.on_backward(gen, parts[i], noting == 2 && i == 1 ? x.clone() : inputs[i], g[i]);
    }
    book.finish_backward();
    return state.grad_accumulator(0).clone();
  };
  const at::Tensor none = sums(0);
  ASSERT_GT(none.abs().sum().item<double>(), 0.0);
  for (int noting : {1, 2}) {
    EXPECT_TRUE(torch::equal(sums(noting), none)) << "noting " << noting;
  }
}

// The generic path: V's per-sample gradients reported directly (begin_backward, take_rows,
// report_per_sample) are clipped in the same group as W's kernel parts; a report whose rows are
// not the part's is refused.
TEST(Book, GenericPathPerSampleGradientsAreClippedInTheSameGroup) {
  torch::manual_seed(8);
  Engine e;
  Book book = e.book(/*mean_loss=*/false, /*generic_v=*/true);
  Batch x;
  // V's per-sample gradients G3_i^T z_i: [B, 2, 3].
  const at::Tensor per_sample = at::einsum("bto,bti->boi", {x.g3, x.z});
  const int64_t p0 = book.on_forward(0), p1 = book.on_forward(0), p2 = book.on_forward(1);
  for (int64_t p : {p0, p1, p2}) book.set_verdict(p);
  const int64_t gen = book.generation();
  book.begin_backward(gen, p2);
  EXPECT_EQ(book.take_rows(p2, kB), 1);
  EXPECT_THROW(book.report_per_sample(p2, {per_sample.narrow(0, 0, 1)}), PrivacyError);
  book.discard();

  const int64_t q0 = book.on_forward(0), q1 = book.on_forward(0), q2 = book.on_forward(1);
  for (int64_t p : {q0, q1, q2}) book.set_verdict(p);
  const int64_t now = book.generation();
  book.begin_backward(now, q2);
  EXPECT_EQ(book.take_rows(q2, kB), 1);
  book.report_per_sample(q2, {per_sample});
  book.on_backward(now, q0, x.x1, x.g1);
  book.on_backward(now, q1, x.x2, x.g2);
  book.finish_backward();
  const Reference ref = reference(e, x, torch::ones({kB}, at::kBool));
  expect_reference_sums(e, ref);
}

// Strict isolation's one part (the whole model on the generic path, alone in its group) reports
// its per-sample gradients in pieces of rows (report_per_sample_rows): each piece is clipped and
// summed at once, and the sums equal the per-example reference, as one report of every row does.
// Rows out of order, past the part's end, or a part that shares its group are refused.
TEST(Book, PiecesOfAPartAloneInItsGroupAreClippedLikeTheWhole) {
  torch::manual_seed(21);
  Engine e;
  const std::vector<BookLayer> whole{
      {"model",
       nullptr,
       {Slot{0, e.layout.flat_offsets()[0], 12, {3, 4}},
       Slot{0, e.layout.flat_offsets()[1], 6, {2, 3}}},
       0,
       0}};
  const BookOptions options{
      {kC}, {1}, "flat", 0.01, false, {e.layout.padded_numel()}, {at::Device(at::kCPU)}};
  const at::Tensor gw = torch::randn({kB, 3, 4}) * 2, gv = torch::randn({kB, 2, 3}) * 2;
  const at::Tensor norms = (gw.flatten(1).pow(2).sum(1) + gv.flatten(1).pow(2).sum(1)).sqrt();
  const at::Tensor factors = (kC / (norms + 1e-6)).clamp_max(1.0);
  const at::Tensor want_w = (gw * factors.view({-1, 1, 1})).sum(0);
  const at::Tensor want_v = (gv * factors.view({-1, 1, 1})).sum(0);
  ASSERT_TRUE((norms > kC).all().item<bool>()) << "every sample must be clipped";

  Book book(whole, options, *e.state);
  const int64_t p = book.on_forward(0);
  book.set_verdict(p);
  book.begin_backward(book.generation(), p);
  EXPECT_EQ(book.take_rows(p, kB), 1);
  EXPECT_THROW(book.report_per_sample_rows(p, 2, {gw.narrow(0, 2, 2), gv.narrow(0, 2, 2)}),
               c10::Error);  // rows 0-1 first
  for (const auto& [begin, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {2, 2}, {4, 1}}) {
    book.report_per_sample_rows(p, begin, {gw.narrow(0, begin, n), gv.narrow(0, begin, n)});
  }
  book.finish_backward();
  EXPECT_TRUE(torch::allclose(e.grad_w(), want_w, 1e-5, 1e-6)) << e.grad_w() << want_w;
  EXPECT_TRUE(torch::allclose(e.grad_v(), want_v, 1e-5, 1e-6)) << e.grad_v() << want_v;
  EXPECT_EQ(book.take_stats().samples, kB);

  // A generic part that shares its group with kernel parts reports all its rows at once.
  Book shared = e.book(/*mean_loss=*/false, /*generic_v=*/true);
  const int64_t q0 = shared.on_forward(0), q1 = shared.on_forward(0), q2 = shared.on_forward(1);
  for (int64_t q : {q0, q1, q2}) shared.set_verdict(q);
  shared.begin_backward(shared.generation(), q2);
  shared.take_rows(q2, kB);
  EXPECT_THROW(shared.report_per_sample_rows(q2, 0, {gv.narrow(0, 0, 2)}), c10::Error);
}

// Forwards on two micro-batches of the loader back-propagated together (forward A, the loader
// hands out B, forward B, one backward) are refused: row i of both would be clipped as one
// example. Mutation tried: no hand-out stamp (the backward is accepted).
TEST(Book, PartsOfAnEarlierMicroBatchAreRefused) {
  torch::manual_seed(13);
  Engine e;
  Book book = e.book();
  Batch x;
  book.set_expected_rows(kB);
  const int64_t a = book.on_forward(1);
  book.set_verdict(a);
  book.set_expected_rows(kB);  // the loader hands out the next micro-batch
  const int64_t b = book.on_forward(1);
  book.set_verdict(b);
  const int64_t gen = book.generation();
  book.on_backward(gen, b, x.z, x.g3);
  try {
    book.on_backward(gen, a, x.z, x.g3);
    ADD_FAILURE() << "parts of two micro-batches were clipped together";
  } catch (const PrivacyError& err) {
    EXPECT_NE(std::string(err.what()).find("of an earlier micro-batch"), std::string::npos)
        << err.what();
  }
  EXPECT_TRUE(book.error().has_value());
}

// A forward after a backward that began but never finished (an exception elsewhere in it) is
// refused: the clipped sums it already added would be counted again.
TEST(Book, ForwardAfterAStoppedBackwardIsRefused) {
  torch::manual_seed(9);
  Engine e;
  Book book = e.book();
  Batch x;
  const int64_t p = book.on_forward(1);
  book.on_forward(0);
  book.set_verdict(p);
  book.on_backward(book.generation(), p, x.z, x.g3);
  EXPECT_THROW(book.on_forward(0), PrivacyError);
  book.discard();
  EXPECT_NO_THROW(book.on_forward(0));
}

// Under a mean loss autograd delivers G / B: the book clips the per-sample gradients B g_i
// (Note [mean loss]), so the same sums come out as for the sum loss (the step divides by the
// expected batch size later). Mutation tried: no scaling (the sums shrink by B).
TEST(Book, MeanLossClipsThePerSampleGradientsOfTheSum) {
  torch::manual_seed(2);
  Engine e;
  Book book = e.book(/*mean_loss=*/true);
  Batch x;
  for (at::Tensor* g : {&x.g1, &x.g2, &x.g3}) (*g)[0].mul_(0.02);  // sample 0 is not clipped
  Batch scaled = x;
  for (at::Tensor* g : {&scaled.g1, &scaled.g2, &scaled.g3}) *g = *g / kB;
  run(book, scaled);
  const Reference ref = reference(e, x, torch::ones({kB}, at::kBool));
  ASSERT_LT(ref.bound[0].item<double>(), kC);
  ASSERT_GT(ref.bound[1].item<double>(), kC);
  expect_reference_sums(e, ref);
}

// A padding micro-batch (Note [padding batches]) contributes exact zeros, whatever its G holds,
// and counts no samples. Mutation tried: not replacing G by zeros (the clipped G reaches the
// buffer).
TEST(Book, PaddingBatchContributesExactZeros) {
  torch::manual_seed(3);
  Engine e;
  Book book = e.book();
  book.set_padding(true);
  Batch x;
  x.g3[0].fill_(1e30);
  run(book, x);
  EXPECT_TRUE(torch::equal(e.grad_w(), torch::zeros({3, 4})));
  EXPECT_TRUE(torch::equal(e.grad_v(), torch::zeros({2, 3})));
  const StepStats stats = book.take_stats();
  EXPECT_EQ(stats.samples, 0);
  EXPECT_EQ(stats.dropped, 0);
  EXPECT_EQ(stats.micro_batches, 1);
}

// A sample whose gradient holds a NaN is dropped (factor 0: none of its parameters gets anything
// from it, in either layer) and counted; the other samples are clipped as usual. Mutation tried:
// not counting the dropped mask (dropped = 0).
TEST(Book, NanSampleIsDroppedAndCounted) {
  torch::manual_seed(4);
  Engine e;
  Book book = e.book();
  Batch x;
  x.g2[2][1][0] = std::numeric_limits<float>::quiet_NaN();  // sample 2, W's second call
  run(book, x);
  at::Tensor keep = torch::ones({kB}, at::kBool);
  keep[2] = false;
  Batch clean = x;
  clean.g2 = x.g2.clone();
  clean.g2[2].zero_();  // the reference skips sample 2; its other rows are finite
  const Reference ref = reference(e, clean, keep);
  EXPECT_FALSE(torch::isnan(e.grad_w()).any().item<bool>());
  expect_reference_sums(e, ref);
  const StepStats stats = book.take_stats();
  EXPECT_EQ(stats.samples, kB);
  EXPECT_EQ(stats.dropped, 1);
}

// The step's one read (Note [host reads of a step]): read_checks returns each check's flags in
// order and reads the dropped count with them, which take_stats then reports without a read of
// its own, once; a float verdict fails when nonzero (0.5 and NaN too). Mutations tried: flags of
// one check given to another; the count lost or counted twice; a float cast to an integer.
TEST(Book, ReadChecksReadsTheFlagsAndTheDroppedCountTogether) {
  torch::manual_seed(4);
  Engine e;
  Book book = e.book();
  Batch x;
  x.g2[1][0][0] = std::numeric_limits<float>::infinity();
  run(book, x);
  const auto read = book.read_checks(
      {torch::tensor({false, true, false}), torch::zeros({}, at::kBool),
       torch::tensor({0, 3}, at::kInt).view({1, 2}),
       torch::tensor({0.0, 0.5, std::numeric_limits<double>::quiet_NaN()})});
  ASSERT_EQ(read.size(), 4u);
  EXPECT_EQ(read[0], (std::vector<bool>{false, true, false}));
  EXPECT_EQ(read[1], (std::vector<bool>{false}));
  EXPECT_EQ(read[2], (std::vector<bool>{false, true}));
  EXPECT_EQ(read[3], (std::vector<bool>{false, true, true}));  // 0.5 and NaN failed
  EXPECT_EQ(book.take_stats().dropped, 1);
  EXPECT_EQ(book.take_stats().dropped, 0);  // a new step
  EXPECT_TRUE(book.read_checks({}).empty());
}

// A second backward through the same forward, and a part without a verdict on which of its rows
// are examples, are refused before anything is clipped.
TEST(Book, RefusesASecondBackwardAndAPartWithoutAVerdict) {
  torch::manual_seed(5);
  Engine e;
  Book book = e.book();
  Batch x;
  const int64_t p0 = book.on_forward(0);
  const int64_t gen = book.generation();
  try {
    book.on_backward(gen, p0, x.x1, x.g1);
    ADD_FAILURE() << "a part without a verdict was clipped";
  } catch (const PrivacyError& err) {
    EXPECT_NE(std::string(err.what()).find("layer 'w' has no verdict"), std::string::npos)
        << err.what();
  }
  book.discard();
  const int64_t p1 = book.on_forward(1);
  book.set_verdict(p1);
  book.on_backward(book.generation(), p1, x.z, x.g3);
  EXPECT_THROW(book.on_backward(book.generation(), p1, x.z, x.g3), PrivacyError);
  const int64_t old = book.generation();
  book.finish_backward();
  EXPECT_THROW(book.on_backward(old, p1, x.z, x.g3), PrivacyError);
}

// Rows that disagree with the micro-batch's are refused, naming the layer and both counts.
TEST(Book, RefusesRowsThatAreNotTheMicroBatchs) {
  torch::manual_seed(6);
  Engine e;
  Book book = e.book();
  book.set_expected_rows(kB + 1);
  Batch x;
  const int64_t p = book.on_forward(1);
  book.set_verdict(p);
  try {
    book.on_backward(book.generation(), p, x.z, x.g3);
    ADD_FAILURE() << "no error";
  } catch (const PrivacyError& err) {
    EXPECT_NE(std::string(err.what())
                  .find("layer 'v' saw a batch of 5 rows in a micro-batch of "
                        "6 examples"),
              std::string::npos)
        << err.what();
  }
}

// ---- DP layers as autograd functions (src/dp/dp_layers.h)
// ----------------------------------------

// The model's calls through dp_linear: autograd's input gradients are the plain layers', the
// weights get no .grad, and the book (finishing in the engine's final callback) holds the same
// clipped sums as the reference. Mutation tried: the node reporting G / 2 fails (sample 0 is
// not clipped, so the scale shows).
TEST(DPLayers, LinearCallsGiveAutogradsInputGradientAndTheBookItsSums) {
  torch::manual_seed(10);
  Engine e;
  std::shared_ptr<Book> book = e.shared_book();
  Batch x;
  for (at::Tensor* g : {&x.g1, &x.g2, &x.g3}) (*g)[0].mul_(0.02);  // sample 0 is not clipped
  std::vector<at::Tensor> inputs = {x.x1.clone().requires_grad_(), x.x2.clone().requires_grad_(),
                                    x.z.clone().requires_grad_()};
  const int64_t p0 = book->on_forward(0), p1 = book->on_forward(0), p2 = book->on_forward(1);
  for (int64_t p : {p0, p1, p2}) book->set_verdict(p);
  const int64_t gen = book->generation();
  const at::Tensor y1 = dp_linear(inputs[0], e.w, at::Tensor(), false, {book, gen, p0, {}});
  const at::Tensor y2 = dp_linear(inputs[1], e.w, at::Tensor(), false, {book, gen, p1, {}});
  const at::Tensor y3 = dp_linear(inputs[2], e.v, at::Tensor(), false, {book, gen, p2, {}});
  const at::Tensor loss = (y1 * x.g1).sum() + (y2 * x.g2).sum() + (y3 * x.g3).sum();
  loss.backward();
  EXPECT_FALSE(e.w.grad().defined());
  EXPECT_FALSE(e.v.grad().defined());
  EXPECT_TRUE(torch::allclose(inputs[0].grad(), at::matmul(x.g1, e.w.detach()), 1e-6, 1e-6));
  EXPECT_TRUE(torch::allclose(inputs[2].grad(), at::matmul(x.g3, e.v.detach()), 1e-6, 1e-6));
  EXPECT_FALSE(book->open());  // the final callback closed the micro-batch
  const Reference ref = reference(e, x, torch::ones({kB}, at::kBool));
  ASSERT_LT(ref.bound[0].item<double>(), kC);
  expect_reference_sums(e, ref);
  EXPECT_EQ(book->take_stats().micro_batches, 1);
}

// An nn.LayerNorm call through dp_layer_norm: autograd's input gradient is F.layer_norm's, and
// the book's sums for its weight and bias are the per-example reference's (flat clipping, C = 1,
// sample 0 unclipped). Mutation tried: the node computing the input gradient without the
// weight (a wrong input gradient) fails.
TEST(DPLayers, LayerNormCallGivesAutogradsInputGradientAndTheBookItsSums) {
  torch::manual_seed(12);
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto pg = comm::make_process_group("gloo", store, 0, 1, std::chrono::seconds(60));
  at::Tensor gamma = (torch::randn({4}) + 1).requires_grad_(),
             beta = torch::randn({4}).requires_grad_();
  zero::ZeroState state({{"ln", {gamma, beta}, {"weight", "bias"}, {0, 4}}}, 8, zero::ZeroConfig{},
                        pg);
  state.set_private(true);
  const zero::UnitLayout layout({{4, 0}, {4, 4}}, 1, 4);
  std::vector<BookLayer> layers;
  layers.push_back(
      {"ln",
       norm_ops({true, true}, false, 1e-5, 1),
       {Slot{0, layout.flat_offsets()[0], 4, {4}}, Slot{0, layout.flat_offsets()[1], 4, {4}}},
       0,
       0});
  auto book = std::make_shared<Book>(
      std::move(layers),
      BookOptions{{kC}, {1}, "flat", 0.01, false, {layout.padded_numel()}, {at::Device(at::kCPU)}},
      state);
  book->set_queue_finish(true);
  const at::Tensor x = torch::randn({kB, kT, 4}).requires_grad_();
  at::Tensor g = torch::randn({kB, kT, 4}) * 3;
  g[0].mul_(0.01);
  const int64_t p = book->on_forward(0);
  book->set_verdict(p);
  const at::Tensor y = dp_layer_norm(x, {4}, gamma, beta, 1e-5, {book, book->generation(), p, {}});
  (y * g).sum().backward();
  // Reference: autograd through at::layer_norm, per example, in float64.
  const at::Tensor xr = x.detach().to(at::kDouble).requires_grad_();
  at::layer_norm(xr, {4}, gamma.detach().to(at::kDouble), beta.detach().to(at::kDouble), 1e-5)
      .mul(g.to(at::kDouble))
      .sum()
      .backward();
  EXPECT_TRUE(torch::allclose(x.grad().to(at::kDouble), xr.grad(), 1e-5, 1e-6));
  at::Tensor want_w = torch::zeros({4}, at::kDouble), want_b = torch::zeros({4}, at::kDouble);
  for (int64_t i = 0; i < kB; ++i) {
    const at::Tensor w = gamma.detach().to(at::kDouble).requires_grad_();
    const at::Tensor b = beta.detach().to(at::kDouble).requires_grad_();
    const at::Tensor loss = at::layer_norm(x[i].detach().to(at::kDouble), {4}, w, b, 1e-5)
                                .mul(g[i].to(at::kDouble))
                                .sum();
    const auto grads = torch::autograd::grad({loss}, {w, b});
    const double n =
        std::sqrt(grads[0].square().sum().item<double>() + grads[1].square().sum().item<double>());
    if (i == 0) ASSERT_LT(n, kC);
    const double factor = std::min(1.0, kC / (n + 1e-6));
    want_w += factor * grads[0];
    want_b += factor * grads[1];
  }
  const at::Tensor buf = state.grad_accumulator(0);
  EXPECT_TRUE(torch::allclose(buf.narrow(0, layout.flat_offsets()[0], 4).to(at::kDouble), want_w,
                              1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(buf.narrow(0, layout.flat_offsets()[1], 4).to(at::kDouble), want_b,
                              1e-5, 1e-6));
  EXPECT_FALSE(gamma.grad().defined());
}

// A call that may not be clipped (a refusal) runs its forward, but its backward is refused and
// the refusal recorded as the book's error.
TEST(DPLayers, ARefusedCallsBackwardIsRefusedAndRecorded) {
  torch::manual_seed(11);
  Engine e;
  std::shared_ptr<Book> book = e.shared_book();
  Batch x;
  const at::Tensor y =
      dp_linear(x.z, e.v, at::Tensor(), false, {book, 0, -1, std::string("outside the model")});
  EXPECT_THROW((y * x.g3).sum().backward(), std::exception);
  ASSERT_TRUE(book->error().has_value());
  EXPECT_EQ(*book->error(), "outside the model");
}

}  // namespace
}  // namespace dpzero::dp
