// accounting/ledger.cpp — the privacy ledger: JSON-lines (de)serialisation, validation, durable
// single-write appends, torn-tail detection and truncation (Note [torn tail] in ledger.h).
#include "accounting/ledger.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "accounting/banded.h"

namespace dpzero::accounting {
namespace {

using Json = nlohmann::ordered_json;

std::string errno_text(int error) { return std::string(std::strerror(error)); }

// The bytes of a line as printable text, between backquotes: printable ASCII as is, a backslash
// doubled, every other byte as \xNN; long lines are cut after 200 bytes.
std::string show_bytes(const std::string& bytes) {
  constexpr std::size_t kMaxShown = 200;
  static const char kHex[] = "0123456789abcdef";
  std::string out = "`";
  for (std::size_t i = 0; i < bytes.size() && i < kMaxShown; ++i) {
    const unsigned char c = static_cast<unsigned char>(bytes[i]);
    if (c == '\\') {
      out += "\\\\";
    } else if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xf];
    }
  }
  out += '`';
  if (bytes.size() > kMaxShown) out += "... (" + std::to_string(bytes.size()) + " bytes in all)";
  return out;
}

// The header's creation time: now, or SOURCE_DATE_EPOCH's (the reproducible-builds convention,
// https://reproducible-builds.org/specs/source-date-epoch/) when it is set, so that two equal runs
// write byte-identical ledgers. A value that is not a decimal count of seconds is refused.
std::string utc_now_iso8601() {
  std::time_t now = std::time(nullptr);
  if (const char* epoch = std::getenv("SOURCE_DATE_EPOCH"); epoch && *epoch) {
    const std::string text = epoch;
    if (text.size() > 12 || text.find_first_not_of("0123456789") != std::string::npos)
      throw LedgerError("SOURCE_DATE_EPOCH must be a count of seconds since 1970 (digits only), "
                        "got '" + text + "'");
    now = static_cast<std::time_t>(std::stoll(text));
  }
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buffer[32];
  std::strftime(buffer, sizeof(buffer), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buffer;
}

// Throws std::invalid_argument naming the field and value.
void validate_record(const LedgerRecord& r) {
  if (r.first_step < 0) {
    throw std::invalid_argument("first_step must be >= 0, got " + std::to_string(r.first_step));
  }
  if (r.last_step < r.first_step) {
    throw std::invalid_argument("last_step must be >= first_step, got last_step " +
                                std::to_string(r.last_step) + " < first_step " +
                                std::to_string(r.first_step));
  }
  if (!(r.q >= 0.0 && r.q <= 1.0)) {
    throw std::invalid_argument("sample rate q must be in [0, 1], got " + format_double(r.q));
  }
  if (!(r.sigma >= 0.0 && std::isfinite(r.sigma))) {
    throw std::invalid_argument("noise multiplier sigma must be >= 0 and finite, got " +
                                format_double(r.sigma));
  }
  if (!(r.max_grad_norm >= 0.0 && std::isfinite(r.max_grad_norm))) {
    throw std::invalid_argument("max_grad_norm must be >= 0 and finite, got " +
                                format_double(r.max_grad_norm));
  }
  if (r.sampling != "poisson" && r.sampling != "caller") {
    throw std::invalid_argument("sampling must be \"poisson\" or \"caller\", got \"" +
                                r.sampling + "\"");
  }
}

void validate_header(const LedgerHeader& h) {
  if (h.run_id.empty()) throw std::invalid_argument("ledger header run_id must not be empty");
  if (h.dataset_size <= 0) {
    throw std::invalid_argument("ledger header dataset_size must be > 0, got " +
                                std::to_string(h.dataset_size));
  }
  if (!h.settings.is_object()) {
    throw std::invalid_argument("ledger header settings must be a JSON object, got " +
                                h.settings.dump());
  }
  header_bands(h);  // a "bands" setting must be an integer >= 1
}

Json header_to_json(const LedgerHeader& h) {
  Json j = Json::object();
  j["kind"] = "header";
  j["format"] = Ledger::kFormat;
  j["run_id"] = h.run_id;
  j["dataset_size"] = h.dataset_size;
  j["created"] = h.created;
  j["settings"] = h.settings;
  return j;
}

Json record_to_json(const LedgerRecord& r) {
  Json j = Json::object();
  j["kind"] = "steps";
  j["first_step"] = r.first_step;
  j["last_step"] = r.last_step;
  j["q"] = r.q;
  j["sigma"] = r.sigma;
  j["max_grad_norm"] = r.max_grad_norm;
  j["noise"] = r.noise;
  j["sampling"] = r.sampling;
  return j;
}

// Field access with errors that name the field and what was found instead.
const Json& field(const Json& j, const char* name) {
  const auto it = j.find(name);
  if (it == j.end()) throw std::invalid_argument(std::string("missing field \"") + name + "\"");
  return *it;
}

int64_t int_field(const Json& value, const char* name) {
  if (value.is_number_unsigned()) {
    const uint64_t u = value.get<uint64_t>();
    if (u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return static_cast<int64_t>(u);
    }
  } else if (value.is_number_integer()) {
    return value.get<int64_t>();
  }
  throw std::invalid_argument(std::string("field \"") + name +
                              "\" must be a 64-bit integer, got " + value.dump());
}

int64_t int_field(const Json& j, const char* name, std::optional<int64_t> fallback) {
  if (fallback && j.find(name) == j.end()) return *fallback;
  return int_field(field(j, name), name);
}

double number_field(const Json& j, const char* name) {
  const Json& value = field(j, name);
  if (!value.is_number()) {
    throw std::invalid_argument(std::string("field \"") + name + "\" must be a number, got " +
                                value.dump());
  }
  return value.get<double>();
}

std::string string_field(const Json& j, const char* name) {
  const Json& value = field(j, name);
  if (!value.is_string()) {
    throw std::invalid_argument(std::string("field \"") + name + "\" must be a string, got " +
                                value.dump());
  }
  return value.get<std::string>();
}

LedgerHeader header_from_json(const Json& j) {
  if (!j.is_object()) throw std::invalid_argument("header must be a JSON object, got " + j.dump());
  const std::string kind = string_field(j, "kind");
  if (kind != "header") {
    throw std::invalid_argument("first line must be the header (kind \"header\"), got kind \"" +
                                kind + "\"");
  }
  const int64_t format = int_field(field(j, "format"), "format");
  if (format != 1 && format != Ledger::kFormat) {
    throw std::invalid_argument("unsupported ledger format " + std::to_string(format) +
                                " (this build reads formats 1 and " +
                                std::to_string(Ledger::kFormat) + ")");
  }
  LedgerHeader h;
  h.format = format;
  h.run_id = string_field(j, "run_id");
  h.dataset_size = int_field(field(j, "dataset_size"), "dataset_size");
  h.created = string_field(j, "created");
  h.settings = field(j, "settings");
  validate_header(h);
  return h;
}

// Format 1 (Note [ledger format]) also held each step's realised batch size and the count of
// dropped samples; they are still checked on read (a damaged old ledger stays an error), then
// left out: nothing data-dependent is kept in, or released from, a ledger.
void validate_format1_extras(const Json& j, const LedgerRecord& r, int64_t dataset_size) {
  const Json& sizes = field(j, "batch_sizes");
  if (!sizes.is_array()) {
    throw std::invalid_argument("field \"batch_sizes\" must be an array, got " + sizes.dump());
  }
  // Compared unsigned: last - first + 1 cannot overflow there.
  const uint64_t steps =
      static_cast<uint64_t>(r.last_step) - static_cast<uint64_t>(r.first_step) + 1;
  if (r.last_step >= r.first_step && sizes.size() != steps) {
    throw std::invalid_argument("batch_sizes has " + std::to_string(sizes.size()) +
                                " entries for " + std::to_string(steps) + " steps (" +
                                std::to_string(r.first_step) + ".." +
                                std::to_string(r.last_step) + ")");
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const int64_t b = int_field(sizes[i], "batch_sizes");
    if (b < 0 || b > dataset_size) {
      throw std::invalid_argument(
          "batch size of step " + std::to_string(r.first_step + static_cast<int64_t>(i)) +
          " must be in [0, dataset_size = " + std::to_string(dataset_size) + "], got " +
          std::to_string(b));
    }
  }
  if (int_field(j, "dropped_samples", int64_t{0}) < 0) {
    throw std::invalid_argument("dropped_samples must be >= 0, got " +
                                j["dropped_samples"].dump());
  }
}

LedgerRecord record_from_json(const Json& j, const LedgerHeader& header) {
  if (!j.is_object()) throw std::invalid_argument("record must be a JSON object, got " + j.dump());
  const std::string kind = string_field(j, "kind");
  if (kind != "steps") {
    throw std::invalid_argument("unknown record kind \"" + kind + "\" (expected \"steps\")");
  }
  LedgerRecord r;
  r.first_step = int_field(field(j, "first_step"), "first_step");
  r.last_step = int_field(field(j, "last_step"), "last_step");
  r.q = number_field(j, "q");
  r.sigma = number_field(j, "sigma");
  r.max_grad_norm = number_field(j, "max_grad_norm");
  const Json& noise = field(j, "noise");
  if (!noise.is_boolean()) {
    throw std::invalid_argument("field \"noise\" must be true or false, got " + noise.dump());
  }
  r.noise = noise.get<bool>();
  if (header.format == 1) {
    validate_format1_extras(j, r, header.dataset_size);
  } else {
    for (const char* name : {"batch_sizes", "dropped_samples"}) {
      if (j.find(name) != j.end()) {
        throw std::invalid_argument(std::string("field \"") + name +
                                    "\" does not belong in a format-2 ledger: it depends on the "
                                    "training data and is not covered by epsilon");
      }
    }
    r.sampling = string_field(j, "sampling");
  }
  validate_record(r);
  return r;
}

// Everything open() learns from the bytes of a ledger.
struct ParsedLedger {
  LedgerHeader header;
  std::vector<LedgerRecord> records;
  int64_t complete_size = 0;  // bytes up to and including the last complete, valid line
  std::string torn_tail;      // bytes of a torn last line (without '\n')
  std::string torn_reason;
  int64_t torn_line = 0;
};

std::string line_prefix(const std::string& path, int64_t line) {
  return "ledger " + path + " line " + std::to_string(line) + ": ";
}

ParsedLedger parse_ledger(const std::string& path, const std::string& content) {
  if (content.empty()) {
    throw LedgerError("ledger " + path + " is empty: it has no header line");
  }
  ParsedLedger parsed;
  std::size_t pos = 0;
  int64_t line_no = 0;
  while (pos < content.size()) {
    ++line_no;
    const std::size_t newline = content.find('\n', pos);
    const bool complete = newline != std::string::npos;
    const std::size_t end = complete ? newline : content.size();
    const std::string line = content.substr(pos, end - pos);
    const bool last = !complete || newline + 1 == content.size();

    std::optional<Json> json;
    std::string parse_error;
    try {
      json = Json::parse(line);
    } catch (const Json::parse_error& e) {
      parse_error = e.what();
    }
    if (!complete || !json) {
      const std::string reason =
          !complete ? "incomplete last line (no trailing newline)" : "unparsable line (" + parse_error + ")";
      if (!last) {
        throw LedgerError(line_prefix(path, line_no) + "corrupt " + reason + " before the end of " +
                          "the file: " + show_bytes(line));
      }
      if (line_no == 1) {
        throw LedgerError(line_prefix(path, line_no) + "the header is torn, " + reason +
                          "; the ledger cannot be recovered: " + show_bytes(line));
      }
      parsed.torn_tail = line;
      parsed.torn_reason = reason;
      parsed.torn_line = line_no;
      break;
    }
    try {
      if (line_no == 1) {
        parsed.header = header_from_json(*json);
      } else {
        parsed.records.push_back(record_from_json(*json, parsed.header));
      }
    } catch (const std::invalid_argument& e) {
      throw LedgerError(line_prefix(path, line_no) + e.what() + ": " + show_bytes(line));
    } catch (const nlohmann::json::exception& e) {
      throw LedgerError(line_prefix(path, line_no) + e.what() + ": " + show_bytes(line));
    }
    pos = newline + 1;
    parsed.complete_size = static_cast<int64_t>(pos);
  }
  return parsed;
}

void check_run_id(const std::string& path, const LedgerHeader& header,
                  const std::string& expected_run_id) {
  if (!expected_run_id.empty() && header.run_id != expected_run_id) {
    throw LedgerError("ledger " + path + " belongs to run \"" + header.run_id +
                      "\", expected run \"" + expected_run_id + "\"");
  }
}

std::string read_all(int fd, const std::string& path) {
  std::string content;
  char buffer[1 << 16];
  off_t offset = 0;
  for (;;) {
    const ssize_t n = ::pread(fd, buffer, sizeof(buffer), offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw LedgerError("cannot read ledger " + path + ": " + errno_text(errno));
    }
    if (n == 0) break;
    content.append(buffer, static_cast<std::size_t>(n));
    offset += n;
  }
  return content;
}

void fsync_or_throw(int fd, const std::string& what) {
  if (::fsync(fd) != 0) throw LedgerError("cannot fsync " + what + ": " + errno_text(errno));
}

// fsync the directory holding `path`, so that a newly created file's directory entry is durable.
void fsync_parent_directory(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw LedgerError("cannot open directory " + dir + " to fsync it: " + errno_text(errno));
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (rc != 0) throw LedgerError("cannot fsync directory " + dir + ": " + errno_text(error));
}

void lock_or_throw(int fd, const std::string& path) {
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    if (error == EWOULDBLOCK) {
      throw LedgerError("ledger " + path + " is held by another writer (flock); only one process "
                        "may append to a ledger. Read it with open_read_only, or give this run "
                        "its own ledger path");
    }
    throw LedgerError("cannot lock ledger " + path + ": " + errno_text(error));
  }
}

// One write() of the whole line; false (errno set, or 0 for a short write) when it did not land.
bool write_line(int fd, const std::string& line) {
  for (;;) {
    const ssize_t n = ::write(fd, line.data(), line.size());
    if (n < 0 && errno == EINTR) continue;  // interrupted before writing anything
    if (n == static_cast<ssize_t>(line.size())) return true;
    if (n >= 0) errno = 0;
    return false;
  }
}

}  // namespace

Ledger Ledger::create(const std::string& path, const LedgerHeader& header) {
  LedgerHeader h = header;
  if (h.settings.is_null()) h.settings = Json::object();
  if (h.created.empty()) h.created = utc_now_iso8601();
  validate_header(h);

  // The ledger's folders are created as `mkdir -p` would (a run directory named by the user need
  // not exist yet), and each new folder's entry is synced in its parent: a crash must not take a
  // ledger whose steps were applied with the folder that held it.
  std::vector<std::string> made;  // new folders, innermost first
  for (std::filesystem::path dir = std::filesystem::path(path).parent_path();
       !dir.empty() && !std::filesystem::exists(dir); dir = dir.parent_path()) {
    made.push_back(dir.string());
  }
  if (!made.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(made.front(), ec);
    if (ec) throw LedgerError("cannot create the folder of ledger " + path + ": " + ec.message());
    for (auto it = made.rbegin(); it != made.rend(); ++it) fsync_parent_directory(*it);
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int error = errno;
    if (error == EEXIST) {
      throw LedgerError("refusing to overwrite existing ledger " + path +
                        " (open it to continue its run, or choose another path)");
    }
    throw LedgerError("cannot create ledger " + path + ": " + errno_text(error));
  }
  Ledger ledger;
  ledger.path_ = path;
  ledger.fd_ = fd;
  ledger.header_ = h;
  ledger.header_.format = kFormat;
  const std::string line = header_to_json(h).dump() + "\n";
  try {
    lock_or_throw(fd, path);
    if (!write_line(fd, line)) {
      throw LedgerError("cannot write the header of ledger " + path + ": " +
                        (errno ? errno_text(errno) : std::string("short write")));
    }
    fsync_or_throw(fd, "ledger " + path);
    fsync_parent_directory(path);
  } catch (...) {
    ledger.close_fd();
    ::unlink(path.c_str());  // a half-created ledger would block the retry
    throw;
  }
  ledger.size_ = static_cast<int64_t>(line.size());
  return ledger;
}

Ledger Ledger::open(const std::string& path, TornTailPolicy policy,
                    const std::string& expected_run_id) {
  const int fd = ::open(path.c_str(), O_RDWR | O_APPEND | O_CLOEXEC);
  if (fd < 0) throw LedgerError("cannot open ledger " + path + ": " + errno_text(errno));
  Ledger ledger;
  ledger.path_ = path;
  ledger.fd_ = fd;  // closed by ~Ledger on any throw below
  lock_or_throw(fd, path);
  ParsedLedger parsed = parse_ledger(path, read_all(fd, path));
  check_run_id(path, parsed.header, expected_run_id);
  if (parsed.torn_line != 0) {
    if (policy == TornTailPolicy::kError) {
      throw LedgerError(line_prefix(path, parsed.torn_line) + "torn tail, " + parsed.torn_reason +
                        ", probably a crash during append: " + show_bytes(parsed.torn_tail) +
                        ". Open it with the torn-tail truncation option (truncate_torn_tail in "
                        "Python, TornTailPolicy::kTruncate in C++) to cut it off: its step was "
                        "never applied and is charged again when replayed");
    }
    if (::ftruncate(fd, static_cast<off_t>(parsed.complete_size)) != 0) {
      throw LedgerError("cannot truncate the torn tail of ledger " + path + ": " +
                        errno_text(errno));
    }
    fsync_or_throw(fd, "ledger " + path);
  }
  ledger.size_ = parsed.complete_size;
  ledger.header_ = std::move(parsed.header);
  ledger.records_ = std::move(parsed.records);
  ledger.torn_tail_ = std::move(parsed.torn_tail);
  ledger.torn_tail_line_ = parsed.torn_line;
  return ledger;
}

Ledger Ledger::open_read_only(const std::string& path, const std::string& expected_run_id) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw LedgerError("cannot open ledger " + path + ": " + errno_text(errno));
  std::string content;
  try {
    content = read_all(fd, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  ParsedLedger parsed = parse_ledger(path, content);
  check_run_id(path, parsed.header, expected_run_id);
  Ledger ledger;
  ledger.path_ = path;
  ledger.read_only_ = true;
  ledger.size_ = parsed.complete_size;
  ledger.header_ = std::move(parsed.header);
  ledger.records_ = std::move(parsed.records);
  ledger.torn_tail_ = std::move(parsed.torn_tail);
  ledger.torn_tail_line_ = parsed.torn_line;
  return ledger;
}

Ledger::Ledger(Ledger&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      read_only_(other.read_only_),
      broken_(other.broken_),
      size_(other.size_),
      header_(std::move(other.header_)),
      records_(std::move(other.records_)),
      torn_tail_(std::move(other.torn_tail_)),
      torn_tail_line_(other.torn_tail_line_) {}

Ledger& Ledger::operator=(Ledger&& other) noexcept {
  if (this != &other) {
    close_fd();
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    read_only_ = other.read_only_;
    broken_ = other.broken_;
    size_ = other.size_;
    header_ = std::move(other.header_);
    records_ = std::move(other.records_);
    torn_tail_ = std::move(other.torn_tail_);
    torn_tail_line_ = other.torn_tail_line_;
  }
  return *this;
}

Ledger::~Ledger() { close_fd(); }

void Ledger::close_fd() noexcept {
  if (fd_ >= 0) {
    ::close(fd_);  // also releases the flock
    fd_ = -1;
  }
}

void Ledger::close() noexcept {
  std::lock_guard<std::mutex> lock(write_mutex_);
  close_fd();
}

void Ledger::append(const LedgerRecord& record) {
  std::lock_guard<std::mutex> lock(write_mutex_);
  if (read_only_) throw LedgerError("ledger " + path_ + " was opened read-only; cannot append");
  if (!broken_ && fd_ < 0) throw LedgerError("ledger " + path_ + " is closed; reopen it");
  if (broken_ || fd_ < 0) {
    throw LedgerError("ledger " + path_ + " refuses appends after a failed write; reopen it");
  }
  validate_record(record);
  if (header_.format != kFormat) {
    throw LedgerError("ledger " + path_ + " is in format " + std::to_string(header_.format) +
                      " (written by an older dpzero, with realised batch sizes); this build "
                      "appends format " + std::to_string(kFormat) +
                      " records only: start a new ledger for further steps");
  }
  const std::string line = record_to_json(record).dump() + "\n";
  if (!write_line(fd_, line)) {
    const std::string why = errno ? errno_text(errno) : std::string("short write");
    // Cut off whatever part of the line landed, so the file still ends with a complete record.
    if (::ftruncate(fd_, static_cast<off_t>(size_)) != 0 || ::fsync(fd_) != 0) broken_ = true;
    throw LedgerError("cannot append to ledger " + path_ + ": " + why);
  }
  if (::fsync(fd_) != 0) {
    broken_ = true;  // after a failed fsync the record may or may not be durable
    throw LedgerError("cannot fsync ledger " + path_ + ": " + errno_text(errno));
  }
  size_ += static_cast<int64_t>(line.size());
  records_.push_back(record);
}

int64_t Ledger::total_steps() const {
  int64_t total = 0;
  for (const LedgerRecord& r : records_) total += r.steps();
  return total;
}

int64_t Ledger::unnoised_steps() const {
  int64_t total = 0;
  for (const LedgerRecord& r : records_) {
    if (!r.noise || r.sigma == 0.0) total += r.steps();
  }
  return total;
}

int64_t header_bands(const LedgerHeader& h) {
  const auto it = h.settings.find("bands");
  if (it == h.settings.end()) return 1;
  if (!it->is_number_integer() || it->get<int64_t>() < 1) {
    throw std::invalid_argument("ledger header setting bands must be an integer >= 1, got " +
                                it->dump());
  }
  return it->get<int64_t>();
}

int64_t Ledger::rows() const {
  int64_t rows = 0;
  for (const LedgerRecord& r : records_) rows = std::max(rows, r.last_step + 1);
  return rows;
}

std::vector<Phase> Ledger::phases() const {
  std::vector<Phase> phases;
  const int64_t bands = header_bands(header_);
  for (std::size_t i = 0; i < records_.size(); ++i) {
    const LedgerRecord& r = records_[i];
    if (!r.noise || r.sigma == 0.0) {
      throw LedgerError(line_prefix(path_, static_cast<int64_t>(i) + 2) + "steps " +
                        std::to_string(r.first_step) + ".." + std::to_string(r.last_step) +
                        " ran without noise (noise = " + (r.noise ? "true" : "false") +
                        ", sigma = " + format_double(r.sigma) +
                        "); epsilon is unbounded (+inf) and no phase can express it. Check "
                        "has_unnoised_steps() before accounting");
    }
    if (!phases.empty() && phases.back().q == r.q && phases.back().sigma == r.sigma) {
      phases.back().steps += r.steps();
    } else {
      phases.push_back(Phase{r.q, r.sigma, r.steps()});
    }
  }
  if (bands > 1 && !phases.empty()) {  // Note [amplified banded accounting]
    if (phases.size() > 1) {
      throw LedgerError(path_ + ": a ledger of " + std::to_string(bands) +
                        " bands holds steps at sigma=" + format_double(phases[0].sigma) +
                        ", q=" + format_double(phases[0].q) + " and at sigma=" +
                        format_double(phases[1].sigma) + ", q=" + format_double(phases[1].q) +
                        "; the amplified banded accounting covers one sigma and q only");
    }
    phases[0].steps = banded_equivalent_steps(rows(), bands);
  }
  return phases;
}

}  // namespace dpzero::accounting
