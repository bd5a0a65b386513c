// The one place sdpa includes Eigen. sdpa needs Eigen's ThreadPoolDevice, which the Tensor module defines
// only under EIGEN_USE_THREADS: it is defined here unless the consumer already did (docs/options.md tells them
// to, on the command line); an earlier inclusion of the Tensor module without it is completed by the
// second inclusion here. The intrinsics come first, through detail/intrinsics.hpp, so that GCC 12's false
// warnings inside them stay silenced wherever Eigen's packets are inlined.
#pragma once

#include "sdpa/detail/intrinsics.hpp"

#ifndef EIGEN_USE_THREADS
#define EIGEN_USE_THREADS
#endif
#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#if !defined(EIGEN_CXX11_TENSOR_TENSOR_DEVICE_THREAD_POOL_H)
#error "sdpa: Eigen::ThreadPoolDevice is missing: define EIGEN_USE_THREADS before including Eigen's Tensor module"
#endif
