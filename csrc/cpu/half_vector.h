// ringreduce CPU: the lanes of the host loops (csrc/cpu/host_loops.inc): loads that widen float16 /
// bfloat16 to float32, stores that narrow, rounding through a 16-bit type, and float32 arithmetic,
// bit for bit the scalar functors of csrc/core/functors.h, in three instruction sets.
//
// Note [Vector half conversions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A lane type L has a register type L::V of L::kWidth float32 values and, for T = float, Half,
// BFloat16: load (widen: halfBitsToFloat, bf16BitsToFloat), store (narrow: floatToHalfBits,
// floatToBf16Bits), round<T> (roundTo<float, T>), combine<op> (Combine<op>::apply), div and mul.
// * PortableLane: one value, the scalar conversions written without branches (every case computed
//   and masked, so the compiler cannot sink a float operation into a branch), which a loop over
//   elements vectorizes with the baseline instruction set.
// * Avx2Lane (x86): 8 values. bfloat16 by the same integer arithmetic; float16 by F16C's vcvtph2ps /
//   vcvtps2ph (round to nearest even, subnormals, overflow to infinity: as the scalar code), with
//   NaNs set to the scalar code's bits: vcvtps2ph keeps a NaN's payload where floatToHalfBits gives
//   0x7e00 with the sign, and vcvtph2ps quiets a signalling NaN where halfBitsToFloat keeps its bits.
//   MAX/MIN as Combine's (a != a || a > b) ? a : b, compared unordered / ordered.
// * Avx512Lane (x86): 16 values, Avx2Lane's arithmetic with AVX-512's masks where Avx2Lane blends
//   (the NaN lanes, MAX/MIN's winner) and vpmovdw where it packs and extracts; float16's narrowing
//   sets NaN lanes to the canonical quiet NaN before vcvtps2ph (one masked operation) instead of
//   fixing the 16-bit result.
// * loadQuieting (float16 only): Note [Quieting half loads].
// * Paired bfloat16 (Note [Paired bfloat16 lanes]): the vector lanes also load and store 2 x kWidth
//   bfloat16 values as two registers, for the loops whose operands are all bfloat16.
// Everything is always inlined; each vector lane's functions only into functions compiled for its
// instruction set (Note [Host loop instruction sets] in host_isa.h).
//
// Note [Quieting half loads]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// load(const Half*)'s fix-up (a signalling NaN's quiet bit cleared again after vcvtph2ps) costs about
// as much as the rest of a float16 step (bench_host_loops, shm-avg-2: 2.8-3.0 us with it and 1.9-2.2
// us without at 64 KiB, bfloat16's time). It matters only where a widened value can reach a float32
// result unchanged: MAX/MIN into float32, and a conversion to float32 without a predivide. Everywhere
// else the value goes through float32 arithmetic, which quiets a signalling NaN exactly as vcvtph2ps
// does (same bits), or is narrowed to 16 bits, whose NaNs are canonical: there the loops load with
// loadQuieting, vcvtph2ps alone (host_loops.inc, quietingLoads; the portable lane quiets the same way,
// so every instruction set reduces the same operands). What may differ from the scalar functors is a
// signalling NaN meeting another NaN in SUM/AVG/PRODUCT: x86 may return the signalling operand
// (quieted) where the functor sees one, and returns the first operand where both are quiet, so the
// result's sign may differ; it is a NaN either way, and the 16-bit result is the canonical 0x7e00 with
// one of the two signs (tests/cpp/test_host_loops.cpp allows exactly that).
#pragma once

#include <cstdint>
#include <type_traits>

#include "../core/common.h"
#include "../core/functors.h"

#if defined(__x86_64__) || defined(__i386__)
// GCC 12 warns -Wmaybe-uninitialized inside its own AVX-512 intrinsics (their _mm512_undefined_*
// operands; GCC bug 105593, fixed in 13), from the header's lines: silenced for those lines only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#define RR_HOST_AVX2 1
#else
#define RR_HOST_AVX2 0
#endif

#define RR_CPU_INLINE inline __attribute__((always_inline))
#define RR_AVX2_INLINE inline __attribute__((target("avx2,f16c"), always_inline))
#define RR_AVX512_INLINE \
  inline __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c"), always_inline))

namespace rr {

template <typename T>
struct IsSixteenBit : std::integral_constant<bool, std::is_same<T, Half>::value || std::is_same<T, BFloat16>::value> {};

namespace halfvec {

RR_CPU_INLINE uint32_t maskIf(bool c) { return 0u - static_cast<uint32_t>(c); }

// halfBitsToFloat without branches.
RR_CPU_INLINE float widenHalf(uint16_t h) {
  const uint32_t x = h;
  const uint32_t sign = (x & 0x8000u) << 16;
  const uint32_t e = x & 0x7c00u;
  const uint32_t body = (x & 0x7fffu) << 13;              // exponent << 23 | mantissa << 13
  const uint32_t special = body | 0x7f800000u;             // exponent 0x1f: inf, NaN (its bits kept)
  const uint32_t normal = body + 0x38000000u;              // exponent + 112
  // zero or subnormal: mantissa * 2^-24, exact in float, its sign set (as -magnitude does)
  const uint32_t subnormal =
      bitCast<uint32_t>(static_cast<float>(static_cast<int32_t>(x & 0x3ffu)) * 5.9604644775390625e-8f);
  const uint32_t is_special = maskIf(e == 0x7c00u), is_sub = maskIf(e == 0);
  return bitCast<float>(sign | (special & is_special) | (subnormal & is_sub) | (normal & ~(is_special | is_sub)));
}

// floatToHalfBits without branches: its three cases, each computed, one kept (compared as int32:
// magnitudes are below 2^31).
RR_CPU_INLINE uint16_t narrowHalf(float value) {
  const uint32_t bits = bitCast<uint32_t>(value);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t mag = bits ^ sign;
  const int32_t m = static_cast<int32_t>(mag);
  const uint32_t big = 0x7c00u | (maskIf(m > 0x7f800000) & 0x200u);                // >= 65536: inf, or NaN 0x7e00
  const uint32_t small = bitCast<uint32_t>(bitCast<float>(mag) + 0.5f) - 0x3f000000u;  // below 2^-14
  const uint32_t normal = (mag + 0xc8000fffu + ((mag >> 13) & 1u)) >> 13;
  const uint32_t is_big = maskIf(m >= 0x47800000), is_small = maskIf(m < 0x38800000);
  const uint32_t out = (big & is_big) | (small & is_small) | (normal & ~(is_big | is_small));
  return static_cast<uint16_t>(out | (sign >> 16));
}

RR_CPU_INLINE float widenBf16(uint16_t b) { return bitCast<float>(static_cast<uint32_t>(b) << 16); }

// floatToBf16Bits without a branch.
RR_CPU_INLINE uint16_t narrowBf16(float value) {
  const uint32_t bits = bitCast<uint32_t>(value);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t is_nan = maskIf(static_cast<int32_t>(bits & 0x7fffffffu) > 0x7f800000);
  return static_cast<uint16_t>((0x7fc0u & is_nan) | (rounded & ~is_nan));
}

}  // namespace halfvec

// Note [Paired bfloat16 lanes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A bfloat16 is the high 16 bits of its float32, so a register of 2 x kWidth bfloat16 values widens
// in place: the even-indexed elements are each 32-bit lane shifted left by 16 (`lo`), the odd ones
// the lane with its low 16 bits cleared (`hi`). Element 2i sits in lane i of lo and element 2i + 1
// in lane i of hi, for every operand alike, so lane-wise arithmetic on (lo, hi) is the arithmetic of
// each element; the store rounds both registers as round<BFloat16> does and takes the high 16 bits
// of each lane back into element order (a 16-bit blend). Neither direction crosses a 128-bit lane,
// and a pair costs 2 operations to widen and 2 (a shift and a blend) to pack, where two registers
// of kWidth cost 2 widening moves and 2 shifts in, and 2 narrowing moves out. kPairs says whether a
// lane type has them (the portable lane does not: its loop is vectorized by the compiler).

struct PortableLane {
  using V = float;
  static constexpr int64_t kWidth = 1;
  static constexpr bool kPairs = false;

  RR_CPU_INLINE static V splat(float f) { return f; }
  RR_CPU_INLINE static V load(const float* p) { return *p; }
  RR_CPU_INLINE static V load(const Half* p) { return halfvec::widenHalf(p->bits); }
  RR_CPU_INLINE static V load(const BFloat16* p) { return halfvec::widenBf16(p->bits); }
  // Note [Quieting half loads]: vcvtph2ps's result, a NaN's quiet bit (0x200) set before widening,
  // so that every instruction set reduces the same operands.
  RR_CPU_INLINE static V loadQuieting(const Half* p) {
    const uint16_t h = p->bits;
    return halfvec::widenHalf(static_cast<uint16_t>(h | (halfvec::maskIf((h & 0x7fffu) > 0x7c00u) & 0x200u)));
  }
  RR_CPU_INLINE static void store(float* p, V v) { *p = v; }
  RR_CPU_INLINE static void store(Half* p, V v) { p->bits = halfvec::narrowHalf(v); }
  RR_CPU_INLINE static void store(BFloat16* p, V v) { p->bits = halfvec::narrowBf16(v); }
  template <typename T>
  RR_CPU_INLINE static V round(V v) {
    if constexpr (std::is_same<T, Half>::value) return halfvec::widenHalf(halfvec::narrowHalf(v));
    else if constexpr (std::is_same<T, BFloat16>::value) return halfvec::widenBf16(halfvec::narrowBf16(v));
    else return v;
  }
  template <RedOp op>
  RR_CPU_INLINE static V combine(V a, V b) {
    return Combine<op>::apply(a, b);
  }
  RR_CPU_INLINE static V div(V a, V b) { return a / b; }
  RR_CPU_INLINE static V mul(V a, V b) { return a * b; }
};

#if RR_HOST_AVX2
struct Avx2Lane {
  using V = __m256;
  static constexpr int64_t kWidth = 8;

  RR_AVX2_INLINE static __m256i c(uint32_t v) { return _mm256_set1_epi32(static_cast<int32_t>(v)); }
  RR_AVX2_INLINE static V splat(float f) { return _mm256_set1_ps(f); }

  RR_AVX2_INLINE static V load(const float* p) { return _mm256_loadu_ps(p); }
  RR_AVX2_INLINE static V load(const BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // vcvtph2ps quiets a signalling NaN (sets bit 22); halfBitsToFloat keeps it clear. Lanes whose
  // input has exponent 0x1f and a clear quiet bit (a signalling NaN, or an infinity, whose bit 22 is
  // clear anyway) get bit 22 cleared.
  RR_AVX2_INLINE static V load(const Half* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i quiet_clear = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7e00)), _mm_set1_epi16(0x7c00));
    const __m256i bit22 = _mm256_and_si256(_mm256_cvtepi16_epi32(quiet_clear), c(0x00400000u));
    return _mm256_andnot_ps(_mm256_castsi256_ps(bit22), _mm256_cvtph_ps(h));
  }
  // Note [Quieting half loads]: vcvtph2ps alone, a signalling NaN quieted.
  RR_AVX2_INLINE static V loadQuieting(const Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }

  RR_AVX2_INLINE static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  // floatToBf16Bits's result in the high 16 bits of each lane (the low 16 bits are not cleared):
  // round to nearest even, NaN lanes 0x7fc0.
  RR_AVX2_INLINE static __m256i bf16High(V v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), c(1));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(bits, c(0x7fff)), odd);
    return _mm256_blendv_epi8(r, c(0x7fc00000u), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
  // floatToBf16Bits on 8 lanes, packed to 16 bits.
  RR_AVX2_INLINE static void store(BFloat16* p, V v) {
    const __m256i r = _mm256_srli_epi32(bf16High(v), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(r),
                                                                      _mm256_extracti128_si256(r, 1)));
  }
  // Note [Paired bfloat16 lanes]: 16 values, elements 2i in lo, 2i + 1 in hi.
  static constexpr bool kPairs = true;
  RR_AVX2_INLINE static void loadPair(const BFloat16* p, V& lo, V& hi) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(x, c(0xffff0000u)));
  }
  RR_AVX2_INLINE static void storePair(BFloat16* p, V lo, V hi) {
    const __m256i x = _mm256_blend_epi16(_mm256_srli_epi32(bf16High(lo), 16), bf16High(hi), 0xaa);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
  }
  // vcvtps2ph rounds to nearest even; a NaN result (exponent 0x1f, mantissa not 0, from NaN inputs
  // only) keeps its sign and quiet bit and loses its payload: 0x7e00 | sign, as floatToHalfBits.
  RR_AVX2_INLINE static __m128i halfBits(V v) {
    const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    const __m128i nan = _mm_cmpgt_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x7c00));
    return _mm_andnot_si128(_mm_and_si128(nan, _mm_set1_epi16(0x01ff)), h);
  }
  RR_AVX2_INLINE static void store(Half* p, V v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), halfBits(v)); }

  // roundTo<float, T>: a NaN becomes the widened canonical NaN, 0x7fc00000 for bfloat16
  // (floatToBf16Bits drops the sign) and sign | 0x7fc00000 for float16.
  template <typename T>
  RR_AVX2_INLINE static V round(V v) {
    if constexpr (std::is_same<T, BFloat16>::value) {
      return _mm256_castsi256_ps(_mm256_and_si256(bf16High(v), c(0xffff0000u)));
    } else if constexpr (std::is_same<T, Half>::value) {
      const __m256 r = _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
      const __m256 canonical = _mm256_or_ps(_mm256_and_ps(v, _mm256_castsi256_ps(c(0x80000000u))),
                                            _mm256_castsi256_ps(c(0x7fc00000u)));
      return _mm256_blendv_ps(r, canonical, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    } else {
      return v;
    }
  }

  template <RedOp op>
  RR_AVX2_INLINE static V combine(V a, V b) {
    if constexpr (op == RedOp::kSum || op == RedOp::kAvg) {
      return _mm256_add_ps(a, b);
    } else if constexpr (op == RedOp::kProduct) {
      return _mm256_mul_ps(a, b);
    } else {  // (a != a || a > b) ? a : b, and < for MIN
      const __m256 wins = _mm256_cmp_ps(a, b, op == RedOp::kMax ? _CMP_GT_OQ : _CMP_LT_OQ);
      return _mm256_blendv_ps(b, a, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), wins));
    }
  }
  RR_AVX2_INLINE static V div(V a, V b) { return _mm256_div_ps(a, b); }
  RR_AVX2_INLINE static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
};

struct Avx512Lane {
  using V = __m512;
  static constexpr int64_t kWidth = 16;

  RR_AVX512_INLINE static __m512i c(uint32_t v) { return _mm512_set1_epi32(static_cast<int32_t>(v)); }
  RR_AVX512_INLINE static __m512i bits(V v) { return _mm512_castps_si512(v); }
  RR_AVX512_INLINE static __mmask16 nans(V v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
  RR_AVX512_INLINE static V splat(float f) { return _mm512_set1_ps(f); }
  RR_AVX512_INLINE static V widen(__m256i h) { return _mm512_cvtph_ps(h); }
  RR_AVX512_INLINE static __m256i narrow(V v) { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT); }

  RR_AVX512_INLINE static V load(const float* p) { return _mm512_loadu_ps(p); }
  RR_AVX512_INLINE static V load(const BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // As Avx2Lane's: bit 22 cleared where the input has exponent 0x1f and a clear quiet bit.
  RR_AVX512_INLINE static V load(const Half* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __mmask16 quiet_clear =
        _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, _mm256_set1_epi16(0x7e00)), _mm256_set1_epi16(0x7c00));
    const __m512i x = _mm512_castps_si512(widen(h));
    return _mm512_castsi512_ps(_mm512_mask_and_epi32(x, quiet_clear, x, c(~0x00400000u)));
  }
  // Note [Quieting half loads]: vcvtph2ps alone, a signalling NaN quieted.
  RR_AVX512_INLINE static V loadQuieting(const Half* p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }

  RR_AVX512_INLINE static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  // As Avx2Lane's: floatToBf16Bits's result in the high 16 bits of each lane.
  RR_AVX512_INLINE static __m512i bf16High(V v) {
    const __m512i b = bits(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), c(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, c(0x7fff)), odd);
    return _mm512_mask_mov_epi32(r, nans(v), c(0x7fc00000u));
  }
  RR_AVX512_INLINE static void store(BFloat16* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16High(v), 16)));
  }
  // Note [Paired bfloat16 lanes]: 32 values, elements 2i in lo, 2i + 1 in hi.
  static constexpr bool kPairs = true;
  RR_AVX512_INLINE static void loadPair(const BFloat16* p, V& lo, V& hi) {
    const __m512i x = _mm512_loadu_si512(p);
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    hi = _mm512_castsi512_ps(_mm512_and_si512(x, c(0xffff0000u)));
  }
  RR_AVX512_INLINE static void storePair(BFloat16* p, V lo, V hi) {
    const __m512i x = _mm512_mask_blend_epi16(0xaaaaaaaau, _mm512_srli_epi32(bf16High(lo), 16), bf16High(hi));
    _mm512_storeu_si512(p, x);
  }
  // NaN lanes set to their sign | 0x7fc00000, a quiet NaN without payload, which vcvtps2ph narrows to
  // floatToHalfBits's 0x7e00 | sign (one masked ternary-logic operation: (v & sign) | 0x7fc00000).
  RR_AVX512_INLINE static V halfNansCanonical(V v) {
    return _mm512_castsi512_ps(_mm512_mask_ternarylogic_epi32(bits(v), nans(v), c(0x80000000u), c(0x7fc00000u), 0xea));
  }
  RR_AVX512_INLINE static __m256i halfBits(V v) { return narrow(halfNansCanonical(v)); }
  RR_AVX512_INLINE static void store(Half* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), halfBits(v));
  }

  template <typename T>
  RR_AVX512_INLINE static V round(V v) {
    if constexpr (std::is_same<T, BFloat16>::value) {
      return _mm512_castsi512_ps(_mm512_and_si512(bf16High(v), c(0xffff0000u)));
    } else if constexpr (std::is_same<T, Half>::value) {
      return widen(narrow(halfNansCanonical(v)));  // a NaN: sign | 0x7fc00000, as roundTo's
    } else {
      return v;
    }
  }

  template <RedOp op>
  RR_AVX512_INLINE static V combine(V a, V b) {
    if constexpr (op == RedOp::kSum || op == RedOp::kAvg) {
      return _mm512_add_ps(a, b);
    } else if constexpr (op == RedOp::kProduct) {
      return _mm512_mul_ps(a, b);
    } else {  // (a != a || a > b) ? a : b, and < for MIN
      const __mmask16 wins = _mm512_cmp_ps_mask(a, b, op == RedOp::kMax ? _CMP_GT_OQ : _CMP_LT_OQ) | nans(a);
      return _mm512_mask_blend_ps(wins, b, a);
    }
  }
  RR_AVX512_INLINE static V div(V a, V b) { return _mm512_div_ps(a, b); }
  RR_AVX512_INLINE static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
};
#endif

}  // namespace rr
