// The umbrella header of sdpa: PyTorch's multi-head ScaledDotProductAttention over Eigen tensors, the
// functional attention core under it (sdpa::attention), rotary embeddings, its Linear layer, init
// strategies, masks, counter-based random numbers and the run-time choice of instruction set.
#pragma once

#include "sdpa/attention.hpp"
#include "sdpa/cache/kv_cache.hpp"
#include "sdpa/cache/paged_kv_cache.hpp"
#include "sdpa/compute.hpp"
#include "sdpa/cpu.hpp"
#include "sdpa/error.hpp"
#include "sdpa/flex.hpp"
#include "sdpa/head_norm.hpp"
#include "sdpa/init.hpp"
#include "sdpa/kernels/problem.hpp"
#include "sdpa/kernels/reference.hpp"
#include "sdpa/kernels/tiled.hpp"
#include "sdpa/latent_attention.hpp"
#include "sdpa/linear.hpp"
#include "sdpa/mask.hpp"
#include "sdpa/merge.hpp"
#include "sdpa/options.hpp"
#include "sdpa/parallel.hpp"
#include "sdpa/random.hpp"
#include "sdpa/rotary.hpp"
#include "sdpa/scaled_dot_product_attention.hpp"
#include "sdpa/storage.hpp"
#include "sdpa/version.hpp"
