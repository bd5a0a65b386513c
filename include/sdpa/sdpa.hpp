// The umbrella header of sdpa: PyTorch's multi-head ScaledDotProductAttention over Eigen tensors, with
// its Linear layer, init strategies, masks and counter-based random numbers.
#pragma once

#include "sdpa/cpu.hpp"
#include "sdpa/error.hpp"
#include "sdpa/init.hpp"
#include "sdpa/kernels/problem.hpp"
#include "sdpa/kernels/reference.hpp"
#include "sdpa/kernels/tiled.hpp"
#include "sdpa/kv_cache.hpp"
#include "sdpa/linear.hpp"
#include "sdpa/mask.hpp"
#include "sdpa/options.hpp"
#include "sdpa/parallel.hpp"
#include "sdpa/random.hpp"
#include "sdpa/scaled_dot_product_attention.hpp"
#include "sdpa/version.hpp"
