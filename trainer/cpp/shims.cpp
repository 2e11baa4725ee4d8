// Every shim in one translation unit. Each includes libtorch's headers, which take gcc about 20 s
// to parse; compiled one by one the nine shims took 183 s of a fresh build (the longest step of
// CI's), compiled as one 29 s. Their helpers share one anonymous namespace here: two shims may
// not define the same internal name.
#include "tcpstore_shim.cpp"
#include "rng_shim.cpp"
#include "grad_shim.cpp"
#include "autocast_shim.cpp"
#include "recompute_shim.cpp"
#include "varlen_shim.cpp"
#include "function_shim.cpp"
#include "memory_shim.cpp"
#include "event_shim.cpp"
