# Finds what sdpa's oneDNN backend needs (dnnl.h, libdnnl and the OpenMP runtime it runs on) without
# loading oneDNN's own CMake package. Debian's dnnl-config.cmake calls find_package(OpenCL REQUIRED) for
# a GPU runtime sdpa never uses, which stops the whole configure (even under QUIET) on a machine without
# the OpenCL headers; sdpa only calls dnnl_sgemm on the CPU, so a header and a library are enough.
# Used by sdpa's own CMakeLists.txt and, for the `onednn` component, by the installed sdpaConfig.cmake.
#
#   sdpa_find_onednn(<found-var> <reason-var>)
# Sets <found-var> to TRUE and defines the GLOBAL imported target sdpa::onednn_runtime when everything is
# there; otherwise sets it to FALSE and <reason-var> to what was missing. Never fails the configure.
include_guard(GLOBAL)

function(sdpa_find_onednn found_var reason_var)
  set(${found_var} FALSE PARENT_SCOPE)
  if(TARGET sdpa::onednn_runtime)
    set(${found_var} TRUE PARENT_SCOPE)
    return()
  endif()
  find_path(SDPA_DNNL_INCLUDE_DIR dnnl.h DOC "Directory of oneDNN's dnnl.h (sdpa::onednn)")
  find_library(SDPA_DNNL_LIBRARY NAMES dnnl DOC "oneDNN's library (sdpa::onednn)")
  mark_as_advanced(SDPA_DNNL_INCLUDE_DIR SDPA_DNNL_LIBRARY)
  if(NOT SDPA_DNNL_INCLUDE_DIR OR NOT SDPA_DNNL_LIBRARY)
    set(${reason_var} "oneDNN's dnnl.h or libdnnl was not found (Debian: libdnnl-dev)" PARENT_SCOPE)
    return()
  endif()
  # oneDNN runs on OpenMP; sdpa pins it to the calling thread through the runtime's omp_set_num_threads,
  # so it links the runtime library (never -fopenmp, which would also thread Eigen's own products).
  find_package(OpenMP QUIET COMPONENTS CXX)
  if(NOT OpenMP_CXX_FOUND)
    set(${reason_var} "no OpenMP runtime was found for the compiler ${CMAKE_CXX_COMPILER_ID} (GCC: libgomp)"
        PARENT_SCOPE)
    return()
  endif()
  # The probe that a broken install would fail: dnnl.h compiles and dnnl_sgemm links.
  set(probe_dir ${CMAKE_BINARY_DIR}/CMakeFiles/sdpa_onednn_probe)
  file(WRITE ${probe_dir}/probe.cpp
       "#include <dnnl.h>\nint main() { float a = 1, b = 1, c = 0;\n"
       "  return dnnl_sgemm('N', 'N', 1, 1, 1, 1.0f, &a, 1, &b, 1, 0.0f, &c, 1) == dnnl_success ? 0 : 1; }\n")
  try_compile(probe_ok ${probe_dir}/build ${probe_dir}/probe.cpp
              CMAKE_FLAGS "-DINCLUDE_DIRECTORIES=${SDPA_DNNL_INCLUDE_DIR}"
              LINK_LIBRARIES ${SDPA_DNNL_LIBRARY} ${OpenMP_CXX_LIBRARIES}
              OUTPUT_VARIABLE probe_output)
  if(NOT probe_ok)
    set(${reason_var} "a program calling dnnl_sgemm did not build against ${SDPA_DNNL_LIBRARY}" PARENT_SCOPE)
    return()
  endif()
  add_library(sdpa::onednn_runtime INTERFACE IMPORTED GLOBAL)
  set_target_properties(sdpa::onednn_runtime PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${SDPA_DNNL_INCLUDE_DIR}"
    INTERFACE_LINK_LIBRARIES "${SDPA_DNNL_LIBRARY};${OpenMP_CXX_LIBRARIES}")
  set(${found_var} TRUE PARENT_SCOPE)
endfunction()
