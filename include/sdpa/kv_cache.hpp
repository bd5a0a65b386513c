// The include path of earlier releases: the cache (sdpa/cache/kv_cache.hpp) with the module whose decoding entry
// points use it (sdpa/scaled_dot_product_attention.hpp, sdpa/module/decoding.hpp).
#pragma once

#include "sdpa/cache/kv_cache.hpp"
#include "sdpa/scaled_dot_product_attention.hpp"
