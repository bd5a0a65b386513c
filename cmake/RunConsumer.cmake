# ctest driver for one consumer project: optionally installs sdpa into a fresh prefix, then configures,
# builds and runs the consumer. Variables: MODE (find_package | add_subdirectory | fetch_content |
# warnings), SDPA_SOURCE_DIR, SDPA_BINARY_DIR, WORK_DIR; optional CONSUMER_ARGS (a ;-list, passed to the
# consumer's configure: sdpa's options, a compiler, flags), and POISON_DIR, a directory whose
# dnnl-config.cmake fails the configure if anything loads it (sdpa must not need oneDNN's CMake package).
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
# Built at -O0 unless CONSUMER_ARGS say otherwise (the warnings builds do): these projects check the ways
# in (packages, targets, options), which no optimisation level changes.
set(args -DSDPA_SOURCE_DIR=${SDPA_SOURCE_DIR} -DCMAKE_BUILD_TYPE= -DCMAKE_CXX_FLAGS=-O0 ${CONSUMER_ARGS})
if(POISON_DIR)
  list(APPEND args -Ddnnl_DIR=${POISON_DIR})
endif()
if(MODE STREQUAL "find_package")
  execute_process(COMMAND ${CMAKE_COMMAND} --install ${SDPA_BINARY_DIR} --prefix ${WORK_DIR}/prefix
                  RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "installing sdpa failed: ${rc}")
  endif()
  list(APPEND args -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix)
endif()
foreach(step configure build run)
  if(step STREQUAL "configure")
    set(cmd ${CMAKE_COMMAND} -S ${SDPA_SOURCE_DIR}/tests/consumers/${MODE} -B ${WORK_DIR}/build ${args})
  elseif(step STREQUAL "build")
    set(cmd ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
  else()
    set(cmd ${WORK_DIR}/build/consumer)
  endif()
  execute_process(COMMAND ${cmd} RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "consumer ${MODE}: ${step} failed: ${rc}")
  endif()
endforeach()
