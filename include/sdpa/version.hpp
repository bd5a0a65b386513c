// The library's version, kept equal to project(sdpa VERSION ...) in CMakeLists.txt.
#pragma once

#define SDPA_VERSION_MAJOR 0
#define SDPA_VERSION_MINOR 1
#define SDPA_VERSION_PATCH 0
