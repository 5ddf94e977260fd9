// accounting/ledger.h — the privacy ledger: an append-only JSON-lines file holding every private
// step's (q, sigma, C, noise, who sampled it), made durable before the optimizer update
// (design.md §2 step 7), from which epsilon is recomputed exactly on reload.
//
// Note [ledger format]
// Line 1 is the header, every further line one record of consecutive steps, each a JSON object
// followed by '\n' (format 2):
//   {"kind":"header","format":2,"run_id":"...","dataset_size":N,"created":"2025-01-31T12:00:00Z",
//    "settings":{...free JSON object: accountant, delta, ...; "bands", when present, an integer
//    >= 1 that phases() reads: Note [amplified banded accounting] in accounting/banded.h; with
//    it "strategy", "strategy_rows" and "strategy_coefficients", which ε does not read: Note
//    [run strategy] in src/dp/run.h}}
//   {"kind":"steps","first_step":a,"last_step":b,"q":..,"sigma":..,"max_grad_norm":..,
//    "noise":true,"sampling":"poisson"}
// A ledger holds what epsilon is computed from and nothing that depends on the training data, so
// it can be released with the model (design.md §3 "Released figures"): the realised batch sizes
// and the counts of dropped (NaN/Inf) samples are data-dependent diagnostics, kept apart by the
// caller.
// "sampling" says who drew the step's batch: "poisson", dpzero's sampler, or "caller", the
// ledgered opt-out for callers who Poisson-sample at q themselves (PrivacyEngine.own_batch).
// Format 1 records also held "batch_sizes" (one per step) and "dropped_samples"; they are read
// (and checked) but not kept, and a format-1 ledger takes no further appends. Doubles are written
// in the shortest form that reads back bit for bit, so a reloaded ledger reproduces epsilon
// exactly. Step numbers may repeat: a step replayed after a crash is charged again, never
// forgotten, so records are neither required to increase nor deduplicated.
//
// Note [torn tail]
// append() writes a record with one write() on an O_APPEND descriptor and fsyncs before it
// returns; the optimizer update runs only after that (design.md §2 step 7). A crash can still
// leave a prefix of the last line on disk: a last line without its '\n', or one that is not
// JSON, is a torn tail. Its step's noisy gradient was never applied to the model, so discarding
// it loses no privacy cost; the step is replayed (and charged) on resume. open() therefore
// either refuses such a file (TornTailPolicy::kError, the default: the error names path, line and
// bytes) or cuts it back to the last complete record and reports what it cut (kTruncate,
// torn_tail()). A damaged line that is not the last one is never a crash artefact and is always an
// error. Only one writer may hold a ledger (an exclusive flock() from create()/open() until the
// Ledger is destroyed), so truncation can never cut a line a live writer is still appending;
// readers that must not disturb a live writer use open_read_only().
#pragma once

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "accounting/types.h"

namespace dpzero::accounting {

// A ledger that cannot be created, opened, parsed or appended to. The message names the path and,
// for content errors, the 1-based line number and the offending bytes.
class LedgerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct LedgerHeader {
  std::string run_id;        // non-empty; open() can insist on it (expected_run_id)
  int64_t dataset_size = 0;  // N > 0; no realised batch can exceed it
  std::string created;       // ISO-8601 UTC ("2025-01-31T12:00:00Z"); create() fills it if empty
  nlohmann::ordered_json settings = nlohmann::ordered_json::object();  // free JSON object
  int64_t format = 2;        // the file's format (Note [ledger format]); create() writes kFormat
};

// Steps first_step..last_step (inclusive), all with the same q, sigma and clip norm.
struct LedgerRecord {
  int64_t first_step = 0;
  int64_t last_step = 0;
  double q = 0.0;              // Poisson sample rate, in [0, 1]
  double sigma = 0.0;          // noise multiplier, >= 0 (0 = no noise: epsilon is unbounded)
  double max_grad_norm = 0.0;  // clip norm C, >= 0
  bool noise = true;           // false: no noise was added (epsilon is unbounded)
  std::string sampling = "poisson";  // "poisson" (dpzero's sampler) or "caller" (own_batch)

  int64_t steps() const { return last_step - first_step + 1; }
};

// The header's "bands" setting (1 when absent): the run's noise is banded with that many bands
// (Note [amplified banded accounting] in accounting/banded.h). Throws std::invalid_argument
// naming the value unless it is an integer >= 1.
int64_t header_bands(const LedgerHeader& header);

enum class TornTailPolicy {
  kError,     // a torn last line is a LedgerError (default)
  kTruncate,  // cut the file back to the last complete record; torn_tail() returns the cut bytes
};

class Ledger {
 public:
  static constexpr int kFormat = 2;

  // Creates `path` and any missing folders above it (never overwrites: an existing file is a
  // LedgerError naming the path), writes the header, fsyncs the file and its directory. Throws std::invalid_argument for a bad header
  // (empty run_id, dataset_size <= 0, settings not a JSON object). Holds the writer lock.
  static Ledger create(const std::string& path, const LedgerHeader& header);

  // Opens an existing ledger for appending: parses and validates every line (Note [torn tail]).
  // A non-empty expected_run_id must equal the header's run_id (the error names both). Holds the
  // writer lock; a second writer gets a LedgerError.
  static Ledger open(const std::string& path, TornTailPolicy policy = TornTailPolicy::kError,
                     const std::string& expected_run_id = "");

  // A read-only snapshot for reports, safe next to a live writer: takes no lock and never
  // modifies the file. A torn last line (possibly one being written right now) is left out of
  // records() and reported by torn_tail(); every other error is thrown as by open().
  // append() on it throws.
  static Ledger open_read_only(const std::string& path, const std::string& expected_run_id = "");

  Ledger(Ledger&& other) noexcept;
  Ledger& operator=(Ledger&& other) noexcept;
  Ledger(const Ledger&) = delete;
  Ledger& operator=(const Ledger&) = delete;
  ~Ledger();

  // Validates (std::invalid_argument naming field and value), then writes one line with a single
  // write() and fsyncs before returning. On a failed or short write the partial bytes are cut
  // off again; if that or the fsync fails, the ledger refuses further appends (LedgerError):
  // whether the record reached the disk is unknown, so the step must not be applied.
  void append(const LedgerRecord& record);

  // Releases the file and the writer lock now (the destructor does too); append() then throws.
  // Whoever shares this Ledger (a private step, src/dp/private_step.h) can no longer append:
  // its steps are refused before their update.
  void close() noexcept;
  bool closed() const { return !read_only_ && fd_ < 0; }

  const std::string& path() const { return path_; }
  const LedgerHeader& header() const { return header_; }
  const std::vector<LedgerRecord>& records() const { return records_; }
  bool read_only() const { return read_only_; }

  // Steps charged so far: the sum of steps() over all records (replayed steps count again).
  int64_t total_steps() const;

  // Steps recorded with noise == false or sigma == 0. Their privacy loss is unbounded, so any
  // accountant must report epsilon = +inf for a ledger with has_unnoised_steps().
  int64_t unnoised_steps() const;
  bool has_unnoised_steps() const { return unnoised_steps() > 0; }

  // The run as accountant phases: consecutive records with the same (q, sigma) merged, in file
  // order. Throws LedgerError when has_unnoised_steps() (no phase can express them; the caller
  // must report epsilon = +inf instead of silently skipping them). A banded run (header_bands()
  // > 1) is one phase of its equivalent DP-SGD steps (Note [amplified banded accounting] in
  // accounting/banded.h); a LedgerError if its records differ in q or sigma.
  std::vector<Phase> phases() const;

  // One more than the last step any record holds (0 for none): the rows a banded run spans.
  int64_t rows() const;

  // What open(kTruncate) cut off or open_read_only() left out: the bytes of the torn last line
  // (without the newline, if any) and its 1-based line number; "" and 0 when there was none.
  const std::string& torn_tail() const { return torn_tail_; }
  int64_t torn_tail_line() const { return torn_tail_line_; }

 private:
  Ledger() = default;
  void close_fd() noexcept;

  std::string path_;
  int fd_ = -1;            // O_APPEND descriptor holding the flock; -1 when read-only
  bool read_only_ = false;
  bool broken_ = false;    // a failed append left the file in an unknown state
  int64_t size_ = 0;       // bytes of complete lines on disk (where a failed append truncates to)
  LedgerHeader header_;
  std::vector<LedgerRecord> records_;
  std::string torn_tail_;
  int64_t torn_tail_line_ = 0;
  // append() and close() may come from different threads (a private step appends with Python's
  // GIL released): a close never interleaves with a write and its fsync. Each object has its own;
  // a move does not carry it.
  std::mutex write_mutex_;
};

}  // namespace dpzero::accounting
