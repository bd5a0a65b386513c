// sdpa's kernels compiled once per program instead of in every translation unit that runs attention: build
// every translation unit with SDPA_EXTERN_TEMPLATES defined (for example
// `target_compile_definitions(app PRIVATE SDPA_EXTERN_TEMPLATES)`) and include this header in exactly one
// of them (with the same compiler flags as the others: the kernels live in the ABI namespace those flags
// select, sdpa/config.hpp). The forward, decoding and backward kernels and the matrix products, for float
// and double, each for every instruction-set path, are then instantiated in that one file; the others
// only call them, and compile in a fraction of the time. Without SDPA_EXTERN_TEMPLATES nothing changes:
// each translation unit instantiates what it uses, and including this header only adds the instances.
// SDPA_INSTANCES_SCALAR (float or double) defined before the include limits it to that type, so that two
// files can share the work (one per type) on a parallel build.
#pragma once

#include "sdpa/sdpa.hpp"
#include "sdpa/detail/instances.inc"

SDPA_NAMESPACE_BEGIN
#ifdef SDPA_INSTANCES_SCALAR
SDPA_DETAIL_INSTANCES_OF(template, SDPA_INSTANCES_SCALAR)
#else
SDPA_DETAIL_INSTANCES_OF(template, float)
SDPA_DETAIL_INSTANCES_OF(template, double)
#endif
SDPA_NAMESPACE_END
