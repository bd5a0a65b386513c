// main() of the test binaries that link sdpa::onednn (tests/CMakeLists.txt, ONEDNN): their float
// projections go through sdpa's own products, unless SDPA_TEST_BACKEND=onednn (ctest's "onednn."
// registrations of the same binary), so that one build checks both backends.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "sdpa/kernels/projection.hpp"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
#ifdef SDPA_USE_ONEDNN
  const char* backend = std::getenv("SDPA_TEST_BACKEND");
  sdpa::set_onednn_projections(backend != nullptr && std::strcmp(backend, "onednn") == 0);
#endif
  return RUN_ALL_TESTS();
}
