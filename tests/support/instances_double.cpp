// sdpa's kernels for double, compiled once for all of the test programs and examples (sdpa/instances.hpp).
#define SDPA_INSTANCES_SCALAR double
#include <sdpa/instances.hpp>
