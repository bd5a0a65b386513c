// sdpa's kernels for float, compiled once for all of the test programs and examples (sdpa/instances.hpp).
#define SDPA_INSTANCES_SCALAR float
#include <sdpa/instances.hpp>
