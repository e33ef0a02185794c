# libFuzzer targets (spec/fuzz/fuzz_<name>.c) and a CTest test fuzz.<name>
# for each: configure with clang and -DMOONBOX_FUZZ=ON (scripts/test.sh does,
# in build-fuzz), build the target `fuzz`, run `ctest -L fuzz`. Each test
# runs its fuzzer for MOONBOX_FUZZ_SECONDS (60) with -seed=1 on a fresh copy
# of spec/fuzz/corpus/<name>/ in <build>/fuzz/<name>/ (the source tree is
# never written), under ASan and UBSan: a crash, a leak, undefined behaviour,
# a failed property check or a timeout fails the test. docs/testing.md.
#
# This file is also the test's runner (cmake -P, below): it resets the
# corpus copy, runs the fuzzer, keeps its log and final stats in the work
# directory and fails on a non-zero exit.
if(CMAKE_SCRIPT_MODE_FILE)
  # -DFUZZER= -DSEEDS= -DWORK= -DSECONDS= [-DARGS=a,b] (extra fuzzer flags)
  string(REPLACE "," ";" ARGS "${ARGS}")
  file(REMOVE_RECURSE "${WORK}")
  file(MAKE_DIRECTORY "${WORK}/corpus" "${WORK}/artifacts")
  if(EXISTS "${SEEDS}")
    file(GLOB seeds "${SEEDS}/*")
    if(seeds)
      file(COPY ${seeds} DESTINATION "${WORK}/corpus")
    endif()
  endif()
  execute_process(
    COMMAND "${FUZZER}" -max_total_time=${SECONDS} -seed=1 -print_final_stats=1 -timeout=10
      -artifact_prefix=${WORK}/artifacts/ ${ARGS} "${WORK}/corpus"
    WORKING_DIRECTORY "${WORK}"
    RESULT_VARIABLE rc OUTPUT_VARIABLE log ERROR_VARIABLE log)
  file(WRITE "${WORK}/log.txt" "${log}")
  string(REGEX MATCHALL "(stat::[a-z_]+: *[0-9]+|Done [0-9]+ runs in [0-9]+ second\\(s\\))" stats "${log}")
  string(REPLACE ";" "\n" stats "${stats}")
  file(WRITE "${WORK}/stats.txt" "${stats}\n")
  if(NOT rc STREQUAL "0")
    file(GLOB artifacts "${WORK}/artifacts/*")
    message("${log}")
    message(FATAL_ERROR "fuzzer exited with ${rc}; reproduce with: ${FUZZER} ${artifacts}")
  endif()
  message("${stats}")
  return()
endif()

option(MOONBOX_FUZZ "Build the libFuzzer targets of spec/fuzz/ (clang only) and their fuzz.* tests" OFF)
if(NOT MOONBOX_FUZZ)
  return()
endif()
if(NOT CMAKE_C_COMPILER_ID STREQUAL "Clang")
  message(FATAL_ERROR "MOONBOX_FUZZ needs clang (-DCMAKE_C_COMPILER=clang; `scripts/install-deps.sh test` installs it with libclang-rt-14-dev, the libFuzzer runtime)")
endif()
if(MOONBOX_SANITIZE)
  message(FATAL_ERROR "MOONBOX_FUZZ and MOONBOX_SANITIZE are separate builds: the fuzz targets bring their own sanitizers")
endif()
set(MOONBOX_FUZZ_SECONDS 60 CACHE STRING "How long each fuzz.* test runs its fuzzer")
set(MOONBOX_FUZZ_RUNNER "${CMAKE_CURRENT_LIST_FILE}")
add_custom_target(fuzz)

# moonbox_fuzz(<name> [SOURCES src/...] [LIBS target...] [ARGS -flag=...]):
# spec/fuzz/fuzz_<name>.c linked with SOURCES (compiled into the fuzzer with
# its instrumentation), seeds in spec/fuzz/corpus/<name>/.
function(moonbox_fuzz name)
  cmake_parse_arguments(F "" "" "SOURCES;LIBS;ARGS" ${ARGN})
  set(t fuzz_${name})
  add_executable(${t} ${CMAKE_SOURCE_DIR}/spec/fuzz/fuzz_${name}.c ${F_SOURCES})
  target_include_directories(${t} PRIVATE ${CMAKE_SOURCE_DIR}/src ${CMAKE_BINARY_DIR}/include)
  target_compile_options(${t} PRIVATE -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
    -fno-omit-frame-pointer -g)
  target_link_options(${t} PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_libraries(${t} PRIVATE ${F_LIBS})
  set_target_properties(${t} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/fuzz)
  add_dependencies(fuzz ${t})
  string(REPLACE ";" "," args "${F_ARGS}")
  add_test(NAME fuzz.${name}
    COMMAND ${CMAKE_COMMAND} -DFUZZER=$<TARGET_FILE:${t}> -DSEEDS=${CMAKE_SOURCE_DIR}/spec/fuzz/corpus/${name}
      -DWORK=${CMAKE_BINARY_DIR}/fuzz/${name} -DSECONDS=${MOONBOX_FUZZ_SECONDS} "-DARGS=${args}"
      -P ${MOONBOX_FUZZ_RUNNER})
  math(EXPR timeout "${MOONBOX_FUZZ_SECONDS} + 120")
  set_tests_properties(fuzz.${name} PROPERTIES LABELS fuzz TIMEOUT ${timeout}
    ENVIRONMENT "UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1;ASAN_OPTIONS=detect_leaks=1")
endfunction()

moonbox_fuzz(base64 SOURCES src/codec_pure.c)
moonbox_fuzz(text SOURCES src/codec_pure.c)
# the HTTP API's JSON codec (api_json.lua over Debian's lua-cjson), run in
# an embedded LuaJIT on the source tree's Lua modules; no leak check, as
# LSan cannot see pointers held in LuaJIT's heap (spec/fuzz/fuzz_json.c)
moonbox_fuzz(json SOURCES src/codec_pure.c LIBS PkgConfig::LUAJIT ARGS -detect_leaks=0)
target_compile_definitions(fuzz_json PRIVATE MOONBOX_LUA_DIR="${CMAKE_SOURCE_DIR}/lua")
# the connection layer's pure half (src/http/proto.h: no Lua, no libuv),
# registered once its files land (issue 29)
if(EXISTS ${CMAKE_SOURCE_DIR}/spec/fuzz/fuzz_http_head.c AND EXISTS ${CMAKE_SOURCE_DIR}/src/http/head.c)
  moonbox_fuzz(http_head SOURCES src/http/head.c)
endif()
if(EXISTS ${CMAKE_SOURCE_DIR}/spec/fuzz/fuzz_ws_frame.c AND EXISTS ${CMAKE_SOURCE_DIR}/src/http/ws.c)
  # Debian 12's libwslay-dev ships no libwslay.pc: the header and library, found directly
  find_path(FUZZ_WSLAY_INCLUDE wslay/wslay.h)
  find_library(FUZZ_WSLAY_LIB wslay)
  if(FUZZ_WSLAY_INCLUDE AND FUZZ_WSLAY_LIB)
    moonbox_fuzz(ws_frame SOURCES src/http/ws.c LIBS ${FUZZ_WSLAY_LIB})
    target_include_directories(fuzz_ws_frame PRIVATE ${FUZZ_WSLAY_INCLUDE})
  else()
    message(WARNING "fuzz_ws_frame left out: no libwslay (apt-get install libwslay-dev)")
  endif()
endif()
