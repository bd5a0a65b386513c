# Stands in for a broken oneDNN package (Debian's dnnl-config.cmake fails without the OpenCL headers):
# the consumer tests point dnnl_DIR here, so any configure that loads oneDNN's own CMake package fails.
message(FATAL_ERROR "oneDNN's CMake package was loaded: sdpa must find oneDNN without it")
