// The instruction-set level these kernels were built for (-DGEMEL_ISA) and the extensions the
// compiler could use, so a test or `gemel info` can check which build a process runs.
#include <torch/library.h>

#include <string>

#ifndef GEMEL_ISA
#define GEMEL_ISA "unknown"
#endif

namespace {

std::string kernel_isa() {
  std::string out = GEMEL_ISA;
#if defined(__AVX2__)
  out += " avx2";
#endif
#if defined(__AVXVNNI__)
  out += " avxvnni";
#endif
#if defined(__AVX512F__)
  out += " avx512f";
#endif
#if defined(__AVX512VNNI__)
  out += " avx512vnni";
#endif
#if defined(__AVX512BF16__)
  out += " avx512bf16";
#endif
#if defined(__AMX_TILE__)
  out += " amx";
#endif
#if defined(__ARM_NEON)
  out += " neon";
#endif
#if defined(__ARM_FEATURE_DOTPROD)
  out += " neondot";
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gemel, m) { m.def("kernel_isa() -> str", &kernel_isa); }
