// tests/cpp/accounting/ledger_test.cpp — the privacy ledger on real files in a temporary
// directory: format, round trip, exact epsilon on reload, torn tails (a crash simulated by writing
// a partial line), corrupt lines, run ids, the writer lock and record validation.
#include <gtest/gtest.h>

#include <utility>

#include "tests/cpp/common/error_message.h"

#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "accounting/ledger.h"
#include "accounting/rdp.h"

namespace dpzero::accounting {
namespace {

namespace fs = std::filesystem;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void append_raw(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::app);
  out << bytes;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

LedgerRecord make_record(int64_t first, int64_t last, double q, double sigma, bool noise = true) {
  LedgerRecord r;
  r.first_step = first;
  r.last_step = last;
  r.q = q;
  r.sigma = sigma;
  r.max_grad_norm = 1.0;
  r.noise = noise;
  return r;
}

void expect_same_record(const LedgerRecord& a, const LedgerRecord& b) {
  EXPECT_EQ(a.first_step, b.first_step);
  EXPECT_EQ(a.last_step, b.last_step);
  EXPECT_EQ(a.q, b.q);  // bit for bit: doubles are written in round-trip form
  EXPECT_EQ(a.sigma, b.sigma);
  EXPECT_EQ(a.max_grad_norm, b.max_grad_norm);
  EXPECT_EQ(a.noise, b.noise);
  EXPECT_EQ(a.sampling, b.sampling);
}

template <typename F>
std::string invalid_argument_message(F&& f) {
  return testing::error_message<std::invalid_argument>(std::forward<F>(f));
}

class LedgerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "dpzero_ledger_XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    path_ = (fs::path(dir_) / "privacy.ledger.jsonl").string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  LedgerHeader header(const std::string& run_id = "run-42") const {
    LedgerHeader h;
    h.run_id = run_id;
    h.dataset_size = 1000;
    h.settings = {{"accountant", "rdp"}, {"delta", 1e-5}, {"note", "unit test"}};
    return h;
  }

  // A ledger with a header and three records, closed again.
  void write_three_records() {
    Ledger ledger = Ledger::create(path_, header());
    ledger.append(make_record(0, 9, 0.04, 1.1));
    ledger.append(make_record(10, 19, 0.04, 1.1));
    ledger.append(make_record(20, 24, 0.05, 0.9));
  }

  std::string dir_;
  std::string path_;
};

TEST_F(LedgerTest, CreateWritesTheHeaderLine) {
  { Ledger ledger = Ledger::create(path_, header()); }
  const std::vector<std::string> lines = lines_of(read_file(path_));
  ASSERT_EQ(lines.size(), 1u);
  const nlohmann::json h = nlohmann::json::parse(lines[0]);
  EXPECT_EQ(h.at("kind"), "header");
  EXPECT_EQ(h.at("format"), 2);
  EXPECT_EQ(h.at("run_id"), "run-42");
  EXPECT_EQ(h.at("dataset_size"), 1000);
  EXPECT_TRUE(std::regex_match(h.at("created").get<std::string>(),
                               std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")))
      << h.at("created");
  EXPECT_EQ(h.at("settings").at("accountant"), "rdp");
  EXPECT_EQ(h.at("settings").at("delta"), 1e-5);
  EXPECT_EQ(read_file(path_).back(), '\n');
}

// SOURCE_DATE_EPOCH (reproducible builds' convention) fixes the creation time, so equal runs
// write equal files; a value that is not a count of seconds is refused, naming it, and no file
// is left.
TEST_F(LedgerTest, SourceDateEpochFixesTheCreationTime) {
  ::setenv("SOURCE_DATE_EPOCH", "1700000000", 1);
  { Ledger ledger = Ledger::create(path_, header()); }
  EXPECT_EQ(Ledger::open_read_only(path_).header().created, "2023-11-14T22:13:20Z");
  fs::remove(path_);
  ::setenv("SOURCE_DATE_EPOCH", "yesterday", 1);
  try {
    Ledger::create(path_, header());
    ADD_FAILURE() << "a SOURCE_DATE_EPOCH of 'yesterday' was taken";
  } catch (const LedgerError& e) {
    EXPECT_NE(std::string(e.what()).find("got 'yesterday'"), std::string::npos) << e.what();
  }
  ::unsetenv("SOURCE_DATE_EPOCH");
  EXPECT_FALSE(fs::exists(path_));
}

TEST_F(LedgerTest, AppendWritesOneCompleteLinePerRecord) {
  Ledger ledger = Ledger::create(path_, header());
  LedgerRecord r = make_record(0, 2, 0.04, 1.1);
  r.sampling = "caller";
  ledger.append(r);
  // Read back with an independent reader while the ledger is still open: append is durable.
  const std::string text = read_file(path_);
  ASSERT_EQ(text.back(), '\n');
  const std::vector<std::string> lines = lines_of(text);
  ASSERT_EQ(lines.size(), 2u);
  const nlohmann::json j = nlohmann::json::parse(lines[1]);
  EXPECT_EQ(j.at("kind"), "steps");
  EXPECT_EQ(j.at("first_step"), 0);
  EXPECT_EQ(j.at("last_step"), 2);
  EXPECT_EQ(j.at("q"), 0.04);
  EXPECT_EQ(j.at("sigma"), 1.1);
  EXPECT_EQ(j.at("max_grad_norm"), 1.0);
  EXPECT_EQ(j.at("noise"), true);
  EXPECT_EQ(j.at("sampling"), "caller");
  // Nothing that depends on the training data (Note [ledger format]).
  EXPECT_EQ(j.size(), 8u) << j.dump();
  EXPECT_EQ(ledger.records().size(), 1u);
  EXPECT_EQ(ledger.total_steps(), 3);
}

TEST_F(LedgerTest, RoundTripKeepsEveryFieldBitForBit) {
  std::vector<LedgerRecord> written = {make_record(0, 4, 0.1 + 0.2, 1.0 / 3.0),
                                       make_record(5, 5, 1e-7, 123.456789012345678),
                                       make_record(6, 8, 0.0, 2.0)};
  written[0].max_grad_norm = 0.7;
  written[1].sampling = "caller";
  {
    Ledger ledger = Ledger::create(path_, header());
    for (const LedgerRecord& r : written) ledger.append(r);
  }
  const Ledger reopened = Ledger::open(path_, TornTailPolicy::kError, "run-42");
  EXPECT_EQ(reopened.header().run_id, "run-42");
  EXPECT_EQ(reopened.header().dataset_size, 1000);
  EXPECT_EQ(reopened.header().settings, header().settings);
  EXPECT_FALSE(reopened.header().created.empty());
  ASSERT_EQ(reopened.records().size(), written.size());
  for (std::size_t i = 0; i < written.size(); ++i) {
    SCOPED_TRACE(i);
    expect_same_record(reopened.records()[i], written[i]);
  }
  EXPECT_EQ(reopened.total_steps(), 5 + 1 + 3);
  EXPECT_TRUE(reopened.torn_tail().empty());
  EXPECT_EQ(reopened.torn_tail_line(), 0);
}

TEST_F(LedgerTest, ReloadRecomputesEpsilonExactly) {
  // Heterogeneous run: a warm-up phase, a main phase written as two records (merged), a change
  // of sigma, a replayed step range after a "crash" (charged again), and a return to the first
  // setting (a new phase: only consecutive records merge).
  {
    Ledger ledger = Ledger::create(path_, header());
    ledger.append(make_record(0, 99, 0.01, 2.0));
    ledger.append(make_record(100, 599, 0.04, 1.1));
    ledger.append(make_record(600, 999, 0.04, 1.1));
    ledger.append(make_record(1000, 1199, 0.04, 0.9));
    ledger.append(make_record(1100, 1199, 0.04, 0.9));  // replay of steps 1100..1199
    ledger.append(make_record(1200, 1209, 0.01, 2.0));
  }
  const std::vector<Phase> expected = {
      {0.01, 2.0, 100}, {0.04, 1.1, 900}, {0.04, 0.9, 300}, {0.01, 2.0, 10}};
  const Ledger reopened = Ledger::open(path_);
  const std::vector<Phase> phases = reopened.phases();
  ASSERT_EQ(phases.size(), expected.size());
  for (std::size_t i = 0; i < phases.size(); ++i) {
    EXPECT_EQ(phases[i].q, expected[i].q) << i;
    EXPECT_EQ(phases[i].sigma, expected[i].sigma) << i;
    EXPECT_EQ(phases[i].steps, expected[i].steps) << i;
  }
  EXPECT_EQ(reopened.total_steps(), 1310);

  RdpAccountant from_ledger;
  for (const Phase& p : phases) from_ledger.add(p);
  RdpAccountant direct;
  for (const Phase& p : expected) direct.add(p);
  EXPECT_EQ(from_ledger.epsilon(1e-5).epsilon, direct.epsilon(1e-5).epsilon);  // bit-identical
  EXPECT_EQ(from_ledger.rdp(), direct.rdp());
  EXPECT_GT(direct.epsilon(1e-5).epsilon, 0.0);
}

TEST_F(LedgerTest, AppendAfterReopenContinuesTheFile) {
  write_three_records();
  {
    Ledger ledger = Ledger::open(path_);
    ledger.append(make_record(25, 29, 0.05, 0.9));
  }
  const Ledger reopened = Ledger::open_read_only(path_);
  ASSERT_EQ(reopened.records().size(), 4u);
  EXPECT_EQ(reopened.records().back().first_step, 25);
  EXPECT_EQ(lines_of(read_file(path_)).size(), 5u);
}

TEST_F(LedgerTest, CreateRefusesToOverwrite) {
  write_three_records();
  const std::string before = read_file(path_);
  const std::string message = testing::error_message<LedgerError>([&] { Ledger::create(path_, header("other")); });
  EXPECT_NE(message.find(path_), std::string::npos) << message;
  EXPECT_NE(message.find("overwrite"), std::string::npos) << message;
  EXPECT_EQ(read_file(path_), before);
  // Any existing file, not only a ledger.
  const std::string other = (fs::path(dir_) / "notes.txt").string();
  append_raw(other, "hello\n");
  EXPECT_THROW(Ledger::create(other, header()), LedgerError);
  EXPECT_EQ(read_file(other), "hello\n");
}

TEST_F(LedgerTest, TornTailWithoutNewlineIsAnErrorByDefault) {
  write_three_records();
  const std::string partial = R"({"kind":"steps","first_step":25,"last_step":29,"q":0.0)";
  append_raw(path_, partial);  // a crash in the middle of the fourth record's write
  const std::string before = read_file(path_);
  const std::string message = testing::error_message<LedgerError>([&] { Ledger::open(path_); });
  EXPECT_NE(message.find(path_), std::string::npos) << message;
  EXPECT_NE(message.find("line 5"), std::string::npos) << message;
  EXPECT_NE(message.find("torn"), std::string::npos) << message;
  EXPECT_NE(message.find(R"("first_step":25)"), std::string::npos) << message;  // the bytes
  EXPECT_EQ(read_file(path_), before);  // kError never modifies the file
}

TEST_F(LedgerTest, TornTailIsTruncatedAndReported) {
  write_three_records();
  const std::string complete = read_file(path_);
  const std::string partial = R"({"kind":"steps","first_step":25,"last_st)";
  append_raw(path_, partial);
  {
    Ledger ledger = Ledger::open(path_, TornTailPolicy::kTruncate, "run-42");
    EXPECT_EQ(ledger.torn_tail(), partial);
    EXPECT_EQ(ledger.torn_tail_line(), 5);
    EXPECT_EQ(ledger.records().size(), 3u);
    EXPECT_EQ(read_file(path_), complete);  // cut back to the last complete record
    // The replayed step is appended after the cut and the file is whole again.
    ledger.append(make_record(25, 29, 0.05, 0.9));
  }
  const Ledger reopened = Ledger::open(path_);
  EXPECT_TRUE(reopened.torn_tail().empty());
  ASSERT_EQ(reopened.records().size(), 4u);
  EXPECT_EQ(reopened.records().back().first_step, 25);
}

TEST_F(LedgerTest, UnparsableLastLineIsATornTail) {
  write_three_records();
  const std::string complete = read_file(path_);
  append_raw(path_, std::string("{\"kind\":\"st\0\0\0", 14) + "\n");
  EXPECT_NE(testing::error_message<LedgerError>([&] { Ledger::open(path_); }).find("line 5"), std::string::npos);
  const Ledger ledger = Ledger::open(path_, TornTailPolicy::kTruncate);
  EXPECT_EQ(ledger.torn_tail(), std::string("{\"kind\":\"st\0\0\0", 14));
  EXPECT_EQ(read_file(path_), complete);
}

TEST_F(LedgerTest, CorruptMiddleLineIsAlwaysAnError) {
  write_three_records();
  std::vector<std::string> lines = lines_of(read_file(path_));
  ASSERT_EQ(lines.size(), 4u);
  lines[2] = lines[2].substr(0, lines[2].size() / 2);  // line 3 cut in half, later lines intact
  std::string text;
  for (const std::string& line : lines) text += line + "\n";
  { std::ofstream(path_, std::ios::binary | std::ios::trunc) << text; }
  for (const TornTailPolicy policy : {TornTailPolicy::kError, TornTailPolicy::kTruncate}) {
    const std::string message = testing::error_message<LedgerError>([&] { Ledger::open(path_, policy); });
    EXPECT_NE(message.find("line 3"), std::string::npos) << message;
    EXPECT_NE(message.find("corrupt"), std::string::npos) << message;
  }
  EXPECT_THROW(Ledger::open_read_only(path_), LedgerError);
  EXPECT_EQ(read_file(path_), text);
}

TEST_F(LedgerTest, OtherRunIdIsRejected) {
  write_three_records();
  const std::string message =
      testing::error_message<LedgerError>([&] { Ledger::open(path_, TornTailPolicy::kError, "run-7"); });
  EXPECT_NE(message.find("\"run-42\""), std::string::npos) << message;
  EXPECT_NE(message.find("\"run-7\""), std::string::npos) << message;
  EXPECT_THROW(Ledger::open_read_only(path_, "run-7"), LedgerError);
  // A torn tail of another run's ledger is not truncated.
  append_raw(path_, "{\"kind\"");
  const std::string before = read_file(path_);
  EXPECT_THROW(Ledger::open(path_, TornTailPolicy::kTruncate, "run-7"), LedgerError);
  EXPECT_EQ(read_file(path_), before);
}

TEST_F(LedgerTest, InvalidRecordIsRejectedOnAppendAndNothingIsWritten) {
  Ledger ledger = Ledger::create(path_, header());
  const std::string before = read_file(path_);
  LedgerRecord bad_q = make_record(0, 1, 1.5, 1.0);
  EXPECT_NE(invalid_argument_message([&] { ledger.append(bad_q); }).find("got 1.5"),
            std::string::npos);
  LedgerRecord bad_sigma = make_record(0, 1, 0.1, -0.5);
  EXPECT_NE(invalid_argument_message([&] { ledger.append(bad_sigma); }).find("got -0.5"),
            std::string::npos);
  LedgerRecord backwards = make_record(5, 5, 0.1, 1.0);
  backwards.last_step = 3;
  EXPECT_NE(invalid_argument_message([&] { ledger.append(backwards); }).find("last_step"),
            std::string::npos);
  LedgerRecord bad_sampling = make_record(0, 3, 0.1, 1.0);
  bad_sampling.sampling = "uniform";
  EXPECT_NE(invalid_argument_message([&] { ledger.append(bad_sampling); }).find("\"uniform\""),
            std::string::npos);
  EXPECT_EQ(read_file(path_), before);
  EXPECT_TRUE(ledger.records().empty());
}

TEST_F(LedgerTest, InvalidRecordInTheFileNamesItsLine) {
  write_three_records();
  // Valid JSON, invalid value, as the last line: a validation error, not a torn tail.
  append_raw(path_,
             R"({"kind":"steps","first_step":25,"last_step":25,"q":1.5,"sigma":1.0,)"
             R"("max_grad_norm":1.0,"noise":true,"sampling":"poisson"})"
             "\n");
  for (const TornTailPolicy policy : {TornTailPolicy::kError, TornTailPolicy::kTruncate}) {
    const std::string message = testing::error_message<LedgerError>([&] { Ledger::open(path_, policy); });
    EXPECT_NE(message.find("line 5"), std::string::npos) << message;
    EXPECT_NE(message.find("got 1.5"), std::string::npos) << message;
  }
}

TEST_F(LedgerTest, MissingFieldOrWrongKindNamesTheLine) {
  { Ledger ledger = Ledger::create(path_, header()); }
  append_raw(path_, R"({"kind":"steps","first_step":0,"last_step":0,"q":0.1,"sigma":1.0,)"
                    R"("noise":true,"sampling":"poisson"})"
                    "\n");
  std::string message = testing::error_message<LedgerError>([&] { Ledger::open(path_); });
  EXPECT_NE(message.find("line 2"), std::string::npos) << message;
  EXPECT_NE(message.find("max_grad_norm"), std::string::npos) << message;

  fs::remove(path_);
  { Ledger ledger = Ledger::create(path_, header()); }
  append_raw(path_, R"({"kind":"pause","steps":3})" "\n");
  message = testing::error_message<LedgerError>([&] { Ledger::open(path_); });
  EXPECT_NE(message.find("\"pause\""), std::string::npos) << message;
}

// A format-1 ledger (an older dpzero's, with realised batch sizes and dropped counts) is read and
// checked, keeps none of those fields, and takes no further appends.
TEST_F(LedgerTest, FormatOneLedgersAreReadWithoutTheirDataDependentFields) {
  const std::string header1 = R"({"kind":"header","format":1,"run_id":"old","dataset_size":50,)"
                              R"("created":"2025-01-01T00:00:00Z","settings":{}})"
                              "\n";
  append_raw(path_, header1 +
                        R"({"kind":"steps","first_step":0,"last_step":1,"q":0.1,"sigma":1.0,)"
                        R"("max_grad_norm":2.0,"batch_sizes":[3,4],"noise":true})"
                        "\n"
                        R"({"kind":"steps","first_step":2,"last_step":2,"q":0.1,"sigma":1.0,)"
                        R"("max_grad_norm":2.0,"batch_sizes":[5],"noise":true,)"
                        R"("dropped_samples":2})"
                        "\n");
  {
    Ledger ledger = Ledger::open(path_);
    EXPECT_EQ(ledger.header().format, 1);
    ASSERT_EQ(ledger.records().size(), 2u);
    EXPECT_EQ(ledger.records()[0].sampling, "poisson");
    EXPECT_EQ(ledger.total_steps(), 3);
    const std::string before = read_file(path_);
    const std::string message =
        testing::error_message<LedgerError>([&] { ledger.append(make_record(3, 3, 0.1, 1.0)); });
    EXPECT_NE(message.find("format 1"), std::string::npos) << message;
    EXPECT_EQ(read_file(path_), before);
  }
  // Their old checks still hold: one batch size per step, each in [0, N].
  fs::remove(path_);
  append_raw(path_, header1 +
                        R"({"kind":"steps","first_step":0,"last_step":1,"q":0.1,"sigma":1.0,)"
                        R"("max_grad_norm":2.0,"batch_sizes":[3],"noise":true})"
                        "\n");
  std::string message = testing::error_message<LedgerError>([&] { Ledger::open_read_only(path_); });
  EXPECT_NE(message.find("1 entries for 2 steps"), std::string::npos) << message;
  fs::remove(path_);
  append_raw(path_, header1 +
                        R"({"kind":"steps","first_step":0,"last_step":0,"q":0.1,"sigma":1.0,)"
                        R"("max_grad_norm":2.0,"batch_sizes":[51],"noise":true})"
                        "\n");
  message = testing::error_message<LedgerError>([&] { Ledger::open_read_only(path_); });
  EXPECT_NE(message.find("got 51"), std::string::npos) << message;
}

// Note [ledger format]: a format-2 record carrying realised batch sizes or dropped counts (data
// the ledger must not release) is an error naming the field and the line.
TEST_F(LedgerTest, FormatTwoRecordsRefuseDataDependentFields) {
  for (const char* extra : {R"("batch_sizes":[3])", R"("dropped_samples":0)"}) {
    fs::remove(path_);
    { Ledger ledger = Ledger::create(path_, header()); }
    append_raw(path_, std::string(R"({"kind":"steps","first_step":0,"last_step":0,"q":0.1,)") +
                          R"("sigma":1.0,"max_grad_norm":2.0,"noise":true,"sampling":"poisson",)" +
                          extra + "}\n");
    const std::string message = testing::error_message<LedgerError>([&] { Ledger::open(path_); });
    EXPECT_NE(message.find("line 2"), std::string::npos) << message;
    EXPECT_NE(message.find(std::string(extra).substr(1, 11)), std::string::npos) << message;
    EXPECT_NE(message.find("not covered by epsilon"), std::string::npos) << message;
  }
}

TEST_F(LedgerTest, EmptyFileTornHeaderAndUnknownFormatAreErrors) {
  append_raw(path_, "");
  EXPECT_NE(testing::error_message<LedgerError>([&] { Ledger::open(path_); }).find("empty"), std::string::npos);
  append_raw(path_, R"({"kind":"header","format":1,"run)");
  for (const TornTailPolicy policy : {TornTailPolicy::kError, TornTailPolicy::kTruncate}) {
    const std::string message = testing::error_message<LedgerError>([&] { Ledger::open(path_, policy); });
    EXPECT_NE(message.find("header"), std::string::npos) << message;
    EXPECT_NE(message.find("line 1"), std::string::npos) << message;
  }
  fs::remove(path_);
  append_raw(path_, R"({"kind":"header","format":3,"run_id":"r","dataset_size":5,)"
                    R"("created":"2025-01-01T00:00:00Z","settings":{}})"
                    "\n");
  EXPECT_NE(testing::error_message<LedgerError>([&] { Ledger::open(path_); }).find("format 3"),
            std::string::npos);
  EXPECT_NE(testing::error_message<LedgerError>([&] { Ledger::open((fs::path(dir_) / "missing").string()); })
                .find("missing"),
            std::string::npos);
}

TEST_F(LedgerTest, BadHeaderIsRejectedOnCreate) {
  LedgerHeader h = header();
  h.run_id.clear();
  EXPECT_NE(invalid_argument_message([&] { Ledger::create(path_, h); }).find("run_id"),
            std::string::npos);
  h = header();
  h.dataset_size = 0;
  EXPECT_NE(invalid_argument_message([&] { Ledger::create(path_, h); }).find("got 0"),
            std::string::npos);
  h = header();
  h.settings = nlohmann::ordered_json::array({1, 2});
  EXPECT_NE(invalid_argument_message([&] { Ledger::create(path_, h); }).find("[1,2]"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(path_));
}

TEST_F(LedgerTest, ReplayedStepsAreChargedAgain) {
  {
    Ledger ledger = Ledger::create(path_, header());
    ledger.append(make_record(0, 9, 0.04, 1.1));
    ledger.append(make_record(5, 9, 0.04, 1.1));  // resumed from a checkpoint at step 5
    ledger.append(make_record(10, 14, 0.04, 1.1));
  }
  const Ledger ledger = Ledger::open(path_);
  EXPECT_EQ(ledger.total_steps(), 20);
  const std::vector<Phase> phases = ledger.phases();
  ASSERT_EQ(phases.size(), 1u);
  EXPECT_EQ(phases[0].steps, 20);
}

TEST_F(LedgerTest, UnnoisedStepsMakeEpsilonUnbounded) {
  {
    Ledger ledger = Ledger::create(path_, header());
    ledger.append(make_record(0, 9, 0.04, 1.1));
    ledger.append(make_record(10, 12, 0.04, 0.0, /*noise=*/false));
    ledger.append(make_record(13, 13, 0.04, 0.0, /*noise=*/true));  // sigma 0: no noise either
  }
  const Ledger ledger = Ledger::open(path_);
  EXPECT_TRUE(ledger.has_unnoised_steps());
  EXPECT_EQ(ledger.unnoised_steps(), 4);
  EXPECT_EQ(ledger.total_steps(), 14);
  const std::string message = testing::error_message<LedgerError>([&] { ledger.phases(); });
  EXPECT_NE(message.find("unbounded"), std::string::npos) << message;
  EXPECT_NE(message.find("line 3"), std::string::npos) << message;

  fs::remove(path_);
  Ledger clean = Ledger::create(path_, header());
  clean.append(make_record(0, 9, 0.04, 1.1));
  EXPECT_FALSE(clean.has_unnoised_steps());
  EXPECT_EQ(clean.phases().size(), 1u);
}

TEST_F(LedgerTest, OnlyOneWriterButReadersAreWelcome) {
  write_three_records();
  Ledger writer = Ledger::open(path_);
  const std::string message = testing::error_message<LedgerError>([&] { Ledger::open(path_); });
  EXPECT_NE(message.find("another writer"), std::string::npos) << message;
  const Ledger reader = Ledger::open_read_only(path_, "run-42");
  EXPECT_TRUE(reader.read_only());
  EXPECT_EQ(reader.records().size(), 3u);
  writer = Ledger::open_read_only(path_);  // releases the lock
  EXPECT_NO_THROW(Ledger::open(path_));
}

// close() releases the lock at once (a private step sharing the ledger may outlive its owner's
// handle), and a closed ledger refuses appends, leaving the file as it was.
TEST_F(LedgerTest, ClosedLedgerReleasesTheLockAndRefusesAppends) {
  write_three_records();
  Ledger writer = Ledger::open(path_);
  writer.close();
  EXPECT_TRUE(writer.closed());
  const std::string before = read_file(path_);
  const std::string message =
      testing::error_message<LedgerError>([&] { writer.append(make_record(25, 25, 0.1, 1.0)); });
  EXPECT_NE(message.find("is closed"), std::string::npos) << message;
  EXPECT_EQ(read_file(path_), before);
  EXPECT_NO_THROW(Ledger::open(path_));
}

TEST_F(LedgerTest, ReadOnlySnapshotReportsTornTailWithoutTouchingTheFile) {
  write_three_records();
  append_raw(path_, R"({"kind":"steps","first)");
  const std::string before = read_file(path_);
  Ledger reader = Ledger::open_read_only(path_);
  EXPECT_EQ(reader.records().size(), 3u);
  EXPECT_EQ(reader.torn_tail(), R"({"kind":"steps","first)");
  EXPECT_EQ(reader.torn_tail_line(), 5);
  EXPECT_EQ(read_file(path_), before);
  EXPECT_NE(testing::error_message<LedgerError>([&] { reader.append(make_record(25, 25, 0.1, 1.0)); })
                .find("read-only"),
            std::string::npos);
}

TEST_F(LedgerTest, MovedLedgerKeepsAppending) {
  Ledger first = Ledger::create(path_, header());
  Ledger second = std::move(first);
  second.append(make_record(0, 0, 0.1, 1.0));
  EXPECT_EQ(second.records().size(), 1u);
  EXPECT_EQ(lines_of(read_file(path_)).size(), 2u);
}

}  // namespace
}  // namespace dpzero::accounting
