// src/checkpoint/crc32.cpp — table-driven CRC-32/ISO-HDLC (crc32.h), one byte per table lookup.
#include "src/checkpoint/crc32.h"

#include <array>
#include <cstdio>

namespace dpzero::checkpoint {
namespace {

constexpr uint32_t kReflectedPolynomial = 0xEDB88320u;

// table[b] = the CRC register after shifting byte b through it (LSB first, reflected form).
std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t r = b;
    for (int bit = 0; bit < 8; ++bit) r = (r & 1u) ? (r >> 1) ^ kReflectedPolynomial : r >> 1;
    table[b] = r;
  }
  return table;
}

}  // namespace

uint32_t crc32_update(uint32_t crc, const void* data, std::size_t size) {
  static const std::array<uint32_t, 256> table = make_table();
  const auto* bytes = static_cast<const unsigned char*>(data);
  uint32_t r = ~crc;  // undo the previous final complement (and preset 0xFFFFFFFF for crc = 0)
  for (std::size_t i = 0; i < size; ++i) r = table[(r ^ bytes[i]) & 0xFFu] ^ (r >> 8);
  return ~r;
}

std::string crc32_hex(uint32_t crc) {
  char text[9];
  std::snprintf(text, sizeof(text), "%08x", crc);
  return text;
}

}  // namespace dpzero::checkpoint
