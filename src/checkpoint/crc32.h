// src/checkpoint/crc32.h — CRC-32 of a byte string, the checksum a checkpoint manifest records for
// each file it names (Note [checkpoint commit] in checkpoint.h).
//
// The algorithm is CRC-32/ISO-HDLC, the CRC of ISO 3309 / ITU-T V.42 that gzip (RFC 1952 §8),
// zlib's crc32() and PNG (ISO/IEC 15948, Annex D) use: the reflected generator polynomial
// 0xEDB88320 (x^32 + x^26 + x^23 + x^22 + x^16 + x^12 + x^11 + x^10 + x^8 + x^7 + x^5 + x^4 +
// x^2 + x + 1, bit-reversed), register preset to 0xFFFFFFFF, result complemented. Its published
// check value is crc32("123456789") = 0xCBF43926, and Python's zlib.crc32 computes the same
// function, so a manifest can be verified with the standard library alone. A CRC detects every
// burst error up to 32 bits and all but 2^-32 of random damage (a torn or truncated write, a
// flipped sector); it is not a defence against deliberate tampering.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dpzero::checkpoint {

// Continues a CRC over `size` more bytes: crc32_update(crc32_update(0, a), b) == crc32(a + b).
// Start from 0.
uint32_t crc32_update(uint32_t crc, const void* data, std::size_t size);

inline uint32_t crc32(const void* data, std::size_t size) { return crc32_update(0, data, size); }

// Eight lower-case hex digits, the form the manifest stores ("cbf43926").
std::string crc32_hex(uint32_t crc);

}  // namespace dpzero::checkpoint
