// Registers the dnnl_sgemm reference cases (sgemm_case.cpp, built when oneDNN is found).
#pragma once

namespace sdpa_bench {

void register_sgemm_cases();

}  // namespace sdpa_bench
