// The AMX path's switch, in every path's library (only the AVX-512 path's has the path itself): whether it
// can run in this process, and the row counts from which the Q4_K and Q6_K kernels' calls take it
// (set_min_rows returns the counts before; 0 turns a kernel's path off).

#include "amx.h"
#include "ops.h"
#include "simd.h"

#include <cstdint>
#include <string>
#include <vector>

MARSPEC_LIBRARY(m) {
  m.def("amx_available() -> bool", [] { return marspec_kernels::amx_permitted(); });
  m.def("amx_set_min_rows(int q4k, int q6k) -> int[]", [](int64_t q4k, int64_t q6k) {
    TORCH_CHECK(q4k >= 0 && q6k >= 0, "row counts must be >= 0");
    return std::vector<int64_t>{marspec_kernels::amx_min_rows_q4k.exchange(q4k),
                                marspec_kernels::amx_min_rows_q6k.exchange(q6k)};
  });
  m.def("path() -> str", [] { return std::string(marspec_simd::kPathName); });
}
