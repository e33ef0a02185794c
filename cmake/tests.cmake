# Tests: busted specs under LuaJIT with the loadable core, luacheck, the
# examples and the embedding program. One CTest test per spec file.
# luajit, busted, luacheck and node are needed by the tests only: without
# one of them configure still succeeds and says which test groups it left out.
find_program(LUAJIT_BIN luajit)
find_program(BUSTED_BIN busted)
find_program(LUACHECK_BIN luacheck)
find_program(NODE_BIN node)
set(MOONBOX_SKIPPED_TESTS "")
macro(moonbox_skip group why)
  list(APPEND MOONBOX_SKIPPED_TESTS "${group} (${why})")
endmacro()

set(MOONBOX_TEST_ENV
  "MOONBOX_BUILD_DIR=${CMAKE_BINARY_DIR}"
  "MOONBOX_SOURCE_DIR=${CMAKE_SOURCE_DIR}"
  "MOONBOX_BIN=$<TARGET_FILE:moonbox_cli>")
if(MOONBOX_SANITIZE)
  # luajit itself is not instrumented: preload the sanitizer runtimes so the
  # instrumented core.so can be loaded into it.
  execute_process(COMMAND ${CMAKE_C_COMPILER} -print-file-name=libasan.so
    OUTPUT_VARIABLE ASAN_LIB OUTPUT_STRIP_TRAILING_WHITESPACE)
  execute_process(COMMAND ${CMAKE_C_COMPILER} -print-file-name=libubsan.so
    OUTPUT_VARIABLE UBSAN_LIB OUTPUT_STRIP_TRAILING_WHITESPACE)
  list(APPEND MOONBOX_TEST_ENV
    "LD_PRELOAD=${ASAN_LIB}:${UBSAN_LIB}"
    # a small quarantine: the load spec measures RSS, and ASan's default
    # keeps 256 MB of freed memory in it
    "ASAN_OPTIONS=detect_leaks=0:abort_on_error=0:halt_on_error=1:quarantine_size_mb=16"
    "UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1")
endif()

file(GLOB_RECURSE SPEC_FILES RELATIVE ${CMAKE_SOURCE_DIR} CONFIGURE_DEPENDS
  ${CMAKE_SOURCE_DIR}/spec/*_spec.lua)
if(NOT LUAJIT_BIN OR NOT BUSTED_BIN)
  moonbox_skip("spec.*, spec.*.no-namespaces, unprivileged.*" "needs luajit and busted: apt-get install luajit lua-busted")
  set(SPEC_FILES "")
endif()
foreach(spec ${SPEC_FILES})
  string(REGEX REPLACE "^spec/|_spec\\.lua$" "" name ${spec})
  string(REPLACE "/" "." name ${name})
  add_test(NAME spec.${name}
    COMMAND ${LUAJIT_BIN} ${BUSTED_BIN} --helper=spec/helper.lua -o utfTerminal ${spec}
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(spec.${name} PROPERTIES ENVIRONMENT "${MOONBOX_TEST_ENV}" TIMEOUT 600)
endforeach()
# The load spec keeps both cores busy for a minute: beside it, specs that
# wait a few seconds for a shell (terminal, process) time out.
# Every fake internet of spec/network uses the same addresses: one at a time.
if(TEST spec.network.egress)
  set_tests_properties(spec.network.egress PROPERTIES RESOURCE_LOCK fake_internet)
endif()
if(TEST spec.server.load)
  set_tests_properties(spec.server.load PROPERTIES RUN_SERIAL TRUE)
endif()

# The suites that depend on how a sandbox is isolated run a second time
# without namespaces (the default, "auto", uses them where the kernel can).
if(SPEC_FILES)
foreach(spec spec/session/session_spec.lua spec/process/process_spec.lua spec/files/files_spec.lua spec/code/code_spec.lua
        spec/terminal/terminal_spec.lua spec/security/containment_spec.lua spec/contract_spec.lua
        spec/session/spawn_builtin_spec.lua spec/security/fail_closed_spec.lua spec/security/file_race_spec.lua
        spec/hostile/session_spec.lua spec/security/spawn_spec_spec.lua spec/sandbox/sandbox_spec.lua
        spec/security/disk_quota_spec.lua)
  string(REGEX REPLACE "^spec/|_spec\\.lua$" "" name ${spec})
  string(REPLACE "/" "." name ${name})
  add_test(NAME spec.${name}.no-namespaces
    COMMAND ${LUAJIT_BIN} ${BUSTED_BIN} --helper=spec/helper.lua -o utfTerminal ${spec}
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(spec.${name}.no-namespaces PROPERTIES
    ENVIRONMENT "${MOONBOX_TEST_ENV};MOONBOX_TEST_ISOLATION=none" TIMEOUT 600)
endforeach()
endif()

# A subset again as an unprivileged user (when the tests run as root): no
# cgroup delegation, so trees are tracked through /proc and the runtime is a
# child subreaper ("proc" kill mode, docs/sessions.md).
find_program(RUNUSER_BIN runuser)
execute_process(COMMAND id -u OUTPUT_VARIABLE BUILD_UID OUTPUT_STRIP_TRAILING_WHITESPACE)
if(SPEC_FILES AND RUNUSER_BIN AND BUILD_UID STREQUAL "0" AND NOT MOONBOX_SANITIZE)
  foreach(spec spec/session/session_spec.lua spec/process/process_spec.lua spec/terminal/terminal_spec.lua
          spec/security/containment_spec.lua spec/security/isolation_spec.lua spec/session/spawn_builtin_spec.lua
          spec/security/root_identity_spec.lua spec/security/fail_closed_spec.lua spec/core/fs_tree_spec.lua
          spec/core/procscan_spec.lua spec/core/sys_spec.lua spec/core/udp_spec.lua
          spec/security/file_race_spec.lua spec/server/security_spec.lua spec/hostile/session_spec.lua
          spec/security/seccomp_spec.lua spec/security/spawn_spec_spec.lua spec/security/disk_quota_spec.lua
          spec/images/store_spec.lua spec/images/sandbox_spec.lua
          spec/images/user_spec.lua spec/images/code_spec.lua)
    string(REGEX REPLACE "^spec/|_spec\\.lua$" "" name ${spec})
    string(REPLACE "/" "." name ${name})
    add_test(NAME unprivileged.${name}
      COMMAND sh ${CMAKE_SOURCE_DIR}/spec/run-unprivileged.sh ${CMAKE_BINARY_DIR} ${spec})
    set_tests_properties(unprivileged.${name} PROPERTIES TIMEOUT 600)
  endforeach()
  # egress (pasta+nftables): root builds the spec's "internet" first
  add_test(NAME unprivileged.network.egress
    COMMAND sh ${CMAKE_SOURCE_DIR}/spec/network/run-unprivileged.sh ${CMAKE_BINARY_DIR})
  # both egress specs build the same fake internet (fixed test addresses)
  set_tests_properties(unprivileged.network.egress PROPERTIES TIMEOUT 600 RESOURCE_LOCK fake_internet)
  # and without namespaces: the runtime's shells are non-dumpable, so
  # /proc refuses their environment to an unprivileged runtime for good
  foreach(spec spec/session/session_spec.lua spec/process/process_spec.lua spec/hostile/session_spec.lua
          spec/sandbox/sandbox_spec.lua)
    string(REGEX REPLACE "^spec/|_spec\\.lua$" "" name ${spec})
    string(REPLACE "/" "." name ${name})
    add_test(NAME unprivileged.${name}.no-namespaces
      COMMAND sh ${CMAKE_SOURCE_DIR}/spec/run-unprivileged.sh ${CMAKE_BINARY_DIR} ${spec})
    set_tests_properties(unprivileged.${name}.no-namespaces PROPERTIES
      ENVIRONMENT "MOONBOX_TEST_ISOLATION=none" TIMEOUT 600)
  endforeach()
endif()

if(LUACHECK_BIN)
  add_test(NAME luacheck COMMAND ${LUACHECK_BIN} --no-color lua spec examples bench
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
else()
  moonbox_skip("luacheck" "apt-get install lua-check")
endif()

# The C follows .clang-format: the check fails on any drift (fix with
# `clang-format -i` on the files it names). Debian 12's clang-format 14 is
# the reference (`scripts/install-deps.sh test` installs it); another major version
# may format differently, so it is preferred where both are installed.
find_program(CLANG_FORMAT_BIN NAMES clang-format-14 clang-format)
if(CLANG_FORMAT_BIN)
  file(GLOB_RECURSE FORMAT_FILES CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/*.c ${CMAKE_SOURCE_DIR}/src/*.h
    ${CMAKE_SOURCE_DIR}/examples/*.c)
  add_test(NAME format-check COMMAND ${CLANG_FORMAT_BIN} --dry-run --Werror ${FORMAT_FILES}
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
else()
  moonbox_skip("format-check" "apt-get install clang-format")
endif()

# The session shell's start-up script is bash in a file of its own
# (share/shell/prelude.bash, loaded by lua/moonbox/session/shell.lua): it must parse,
# and shellcheck must find nothing in it (its few exceptions say why).
find_program(BASH_BIN bash)
find_program(SHELLCHECK_BIN shellcheck)
if(BASH_BIN)
  add_test(NAME prelude_bash.syntax COMMAND ${BASH_BIN} -n ${CMAKE_SOURCE_DIR}/share/shell/prelude.bash)
endif()
if(SHELLCHECK_BIN)
  add_test(NAME prelude_bash.shellcheck COMMAND ${SHELLCHECK_BIN} ${CMAKE_SOURCE_DIR}/share/shell/prelude.bash)
  # and the project's own shell scripts (build, tests, deploy, CI)
  file(GLOB SHELL_SCRIPTS CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/scripts/*.sh ${CMAKE_SOURCE_DIR}/spec/*.sh
    ${CMAKE_SOURCE_DIR}/spec/network/*.sh
    ${CMAKE_SOURCE_DIR}/deploy/*/*.sh ${CMAKE_SOURCE_DIR}/cmake/deb/*.sh)
  add_test(NAME shellcheck COMMAND ${SHELLCHECK_BIN} ${SHELL_SCRIPTS} ${CMAKE_SOURCE_DIR}/.ci/run)
  # the bash completion the package ships
  add_test(NAME completion.shellcheck COMMAND ${SHELLCHECK_BIN} -s bash ${CMAKE_SOURCE_DIR}/share/completion/moonbox.bash)
else()
  moonbox_skip("prelude_bash.shellcheck shellcheck completion.shellcheck" "apt-get install shellcheck")
endif()

# Every example runs and must print what it promises (spec/examples.sh).
file(GLOB EXAMPLE_FILES RELATIVE ${CMAKE_SOURCE_DIR} CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/examples/*.lua)
foreach(example ${EXAMPLE_FILES})
  get_filename_component(name ${example} NAME_WE)
  add_test(NAME example.${name}
    COMMAND sh ${CMAKE_SOURCE_DIR}/spec/run-example.sh $<TARGET_FILE:moonbox_cli> ${example}
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(example.${name} PROPERTIES ENVIRONMENT "${MOONBOX_TEST_ENV}" TIMEOUT 300)
endforeach()

# share/page/vendor/ is @xterm/xterm as share/page/package-lock.json pins it
# (compared with the npm cache `scripts/install-deps.sh test` fills)
if(NODE_BIN AND EXISTS "${MOONBOX_PAGE_DEPS}/node_modules/@xterm/xterm/package.json" AND NOT MOONBOX_SANITIZE)
  add_test(NAME page.vendor
    COMMAND sh ${CMAKE_SOURCE_DIR}/spec/page-vendor-test.sh ${CMAKE_SOURCE_DIR} ${MOONBOX_PAGE_DEPS})
  set_tests_properties(page.vendor PROPERTIES PASS_REGULAR_EXPRESSION "page-vendor-test: ok")
elseif(NOT MOONBOX_SANITIZE)
  moonbox_skip("page.vendor" "needs node and the npm cache of scripts/install-deps.sh test")
endif()

# The page of `moonbox serve` in headless Debian chromium, driven by
# playwright-core (from the npm cache `scripts/install-deps.sh test` fills): type
# `echo hi` in the terminal, see hi, keep a screenshot.
find_program(CHROMIUM_BIN chromium)
if(MOONBOX_SANITIZE)
elseif(NODE_BIN AND CHROMIUM_BIN AND EXISTS "${MOONBOX_PAGE_DEPS}/node_modules/playwright-core")
  add_test(NAME page.terminal
    COMMAND ${NODE_BIN} ${CMAKE_SOURCE_DIR}/spec/server/page_test.js $<TARGET_FILE:moonbox_cli>
      ${MOONBOX_PAGE_DEPS}/node_modules ${CMAKE_BINARY_DIR}/test-output/page)
  set_tests_properties(page.terminal PROPERTIES TIMEOUT 180)
  # an exposed port: a page served in a sandbox, loaded through the proxy
  # (both URL forms), fetching a file and talking to a WebSocket echo
  add_test(NAME page.ports
    COMMAND ${NODE_BIN} ${CMAKE_SOURCE_DIR}/spec/server/ports_page_test.js $<TARGET_FILE:moonbox_cli>
      ${MOONBOX_PAGE_DEPS}/node_modules ${CMAKE_BINARY_DIR}/test-output/ports)
  set_tests_properties(page.ports PROPERTIES TIMEOUT 180)
else()
  moonbox_skip("page.terminal page.ports" "needs node, chromium and the npm cache of scripts/install-deps.sh test")
endif()

# The seed's published client (@cloudflare/sandbox, pinned in
# spec/compat/package-lock.json) drives `moonbox serve` through the container
# protocol (docs/compat.md). A fixture installs it with `npm ci` into
# <build>/compat; the default build target never touches the network.
find_program(NODE_BIN node)
find_program(NPM_BIN npm)
if(NODE_BIN AND NPM_BIN AND NOT MOONBOX_SANITIZE)
  add_test(NAME compat.npm_ci
    COMMAND sh -c "mkdir -p \"$0\" && cp \"$1/package.json\" \"$1/package-lock.json\" \"$0/\" && cd \"$0\" && ${NPM_BIN} ci --no-audit --no-fund"
      ${CMAKE_BINARY_DIR}/compat ${CMAKE_SOURCE_DIR}/spec/compat)
  # (the fake internet routes 203.0.113.0/24 machine-wide: where a
  # machine's registry or proxy lives there, npm must not run beside it)
  set_tests_properties(compat.npm_ci PROPERTIES FIXTURES_SETUP compat_modules TIMEOUT 300
    RESOURCE_LOCK fake_internet)
  add_test(NAME compat.client
    COMMAND ${NODE_BIN} --import ${CMAKE_SOURCE_DIR}/spec/compat/register.mjs
      --test ${CMAKE_SOURCE_DIR}/spec/compat/client.test.mjs
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(compat.client PROPERTIES FIXTURES_REQUIRED compat_modules TIMEOUT 300
    ENVIRONMENT "MOONBOX_BIN=$<TARGET_FILE:moonbox_cli>;COMPAT_NODE_MODULES=${CMAKE_BINARY_DIR}/compat/node_modules")
endif()

# The official MCP TypeScript SDK (@modelcontextprotocol/sdk, pinned in
# spec/mcp/package-lock.json) drives `moonbox mcp` (stdio) and /mcp of
# `moonbox serve` (streamable HTTP; docs/mcp.md). Installed like compat's
# client: a fixture runs `npm ci` into <build>/mcp.
if(NODE_BIN AND NPM_BIN AND NOT MOONBOX_SANITIZE)
  add_test(NAME mcp.npm_ci
    COMMAND sh -c "mkdir -p \"$0\" && cp \"$1/package.json\" \"$1/package-lock.json\" \"$0/\" && cd \"$0\" && ${NPM_BIN} ci --no-audit --no-fund"
      ${CMAKE_BINARY_DIR}/mcp ${CMAKE_SOURCE_DIR}/spec/mcp)
  set_tests_properties(mcp.npm_ci PROPERTIES FIXTURES_SETUP mcp_modules TIMEOUT 300 RESOURCE_LOCK fake_internet)
  add_test(NAME mcp.client
    COMMAND ${NODE_BIN} --test ${CMAKE_SOURCE_DIR}/spec/mcp/client.test.mjs
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(mcp.client PROPERTIES FIXTURES_REQUIRED mcp_modules TIMEOUT 600
    ENVIRONMENT "MOONBOX_BIN=$<TARGET_FILE:moonbox_cli>;MCP_NODE_MODULES=${CMAKE_BINARY_DIR}/mcp/node_modules")
else()
  moonbox_skip("mcp.client" "needs node and npm")
endif()

# Backups and checkChanges again without namespaces and as nobody.
foreach(spec spec/files/backup_spec.lua spec/files/changes_spec.lua)
  string(REGEX REPLACE "^spec/|_spec\\.lua$" "" name ${spec})
  string(REPLACE "/" "." name ${name})
  add_test(NAME spec.${name}.no-namespaces
    COMMAND ${LUAJIT_BIN} ${BUSTED_BIN} --helper=spec/helper.lua -o utfTerminal ${spec}
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(spec.${name}.no-namespaces PROPERTIES
    ENVIRONMENT "${MOONBOX_TEST_ENV};MOONBOX_TEST_ISOLATION=none" TIMEOUT 600)
  if(RUNUSER_BIN AND BUILD_UID STREQUAL "0" AND NOT MOONBOX_SANITIZE)
    add_test(NAME unprivileged.${name}
      COMMAND sh ${CMAKE_SOURCE_DIR}/spec/run-unprivileged.sh ${CMAKE_BINARY_DIR} ${spec})
    set_tests_properties(unprivileged.${name} PROPERTIES TIMEOUT 600)
  endif()
endforeach()

add_test(NAME example.embed COMMAND $<TARGET_FILE:embed_example>)
set_tests_properties(example.embed PROPERTIES ENVIRONMENT "${MOONBOX_TEST_ENV}"
  PASS_REGULAR_EXPRESSION "hello from a task on the host loop\npending tasks: 0")

# `cmake --install` to a prefix that is then moved works on its own, with the
# source and build trees hidden: the quickstart, the embedding example built
# with pkg-config, the spawn builtin in a session shell, plain luajit.
# (not in the sanitizer build: plain luajit cannot load its instrumented core.so)
if(NOT MOONBOX_SANITIZE)
  add_test(NAME install.relocated
    COMMAND sh ${CMAKE_SOURCE_DIR}/spec/install-test.sh ${CMAKE_SOURCE_DIR} ${CMAKE_BINARY_DIR})
  set_tests_properties(install.relocated PROPERTIES TIMEOUT 300 PASS_REGULAR_EXPRESSION "install-test: ok")
endif()

# `cpack -G DEB` for /usr (a second build in <build>/package-test), the
# package's fields, files and Depends, and the quickstart from it unpacked;
# as root also `apt-get install ./moonbox_*.deb` on this machine, the
# quickstart from /usr, and `apt-get remove` (not done, with the reason
# printed, where moonbox or any file of the package is there already).
find_program(DPKG_DEB_BIN dpkg-deb)
if(DPKG_DEB_BIN AND NOT MOONBOX_SANITIZE)
  add_test(NAME install.deb
    COMMAND sh ${CMAKE_SOURCE_DIR}/spec/package-test.sh ${CMAKE_SOURCE_DIR} ${CMAKE_BINARY_DIR}/package-test
      ${MOONBOX_PAGE_DEPS})
  # alone: while the package is installed in /usr, no other test may find it there
  set_tests_properties(install.deb PROPERTIES TIMEOUT 1200 PASS_REGULAR_EXPRESSION "package-test: ok"
    RUN_SERIAL TRUE)
elseif(NOT MOONBOX_SANITIZE)
  moonbox_skip("install.deb" "needs dpkg-deb")
endif()

# The bash completion the package ships, completing as a user's Tab would
# (spec/completion-test.sh, with Debian's bash-completion)
if(EXISTS /usr/share/bash-completion/bash_completion AND BASH_BIN AND NOT MOONBOX_SANITIZE)
  add_test(NAME completion.bash
    COMMAND sh ${CMAKE_SOURCE_DIR}/spec/completion-test.sh ${CMAKE_SOURCE_DIR} ${CMAKE_BINARY_DIR}/completion-test)
  set_tests_properties(completion.bash PROPERTIES PASS_REGULAR_EXPRESSION "completion-test: ok")
elseif(NOT MOONBOX_SANITIZE)
  moonbox_skip("completion.bash" "needs bash-completion (scripts/install-deps.sh test installs it)")
endif()

# The container image without a registry (spec/image-test.sh): a Debian 12
# base made by mmdebstrap from Debian's mirror, deploy/Dockerfile built on it
# with buildah (vfs storage, chroot isolation), the quickstart run in the
# image. As root only; a few minutes (it compiles moonbox in the image).
find_program(BUILDAH_BIN buildah)
find_program(MMDEBSTRAP_BIN mmdebstrap)
if(MOONBOX_SANITIZE)
elseif(BUILDAH_BIN AND MMDEBSTRAP_BIN AND BUILD_UID STREQUAL "0")
  add_test(NAME image.quickstart
    COMMAND sh ${CMAKE_SOURCE_DIR}/spec/image-test.sh ${CMAKE_SOURCE_DIR} ${CMAKE_BINARY_DIR}/image-test
      ${CMAKE_BINARY_DIR})
  set_tests_properties(image.quickstart PROPERTIES TIMEOUT 2400 PASS_REGULAR_EXPRESSION "image-test: ok"
    RUN_SERIAL TRUE)
else()
  moonbox_skip("image.quickstart" "needs root, buildah and mmdebstrap (scripts/install-deps.sh test installs them)")
endif()

# moonbox-<version>-1.rockspec loads, agrees with the project, and builds as
# luarocks builds it (luarocks itself where installed) into a private tree
# from which plain luajit requires moonbox.
if(LUAJIT_BIN AND NOT MOONBOX_SANITIZE)
  add_test(NAME install.rockspec
    COMMAND sh ${CMAKE_SOURCE_DIR}/spec/rockspec-test.sh ${CMAKE_SOURCE_DIR} ${CMAKE_BINARY_DIR}/rockspec-test)
  set_tests_properties(install.rockspec PROPERTIES TIMEOUT 900 PASS_REGULAR_EXPRESSION "rockspec-test: ok")
elseif(NOT MOONBOX_SANITIZE)
  moonbox_skip("install.rockspec" "needs luajit")
endif()

# deploy/: the routing tier for real (three `moonbox serve` behind nginx with
# the shipped consistent-hashing config, spec/deploy/routing_test.py; skipped,
# exit 77, only when nginx is not installed) and the Kubernetes manifests
# (syntax and the fields docs/scaling.md relies on, with python3-yaml).
find_program(PYTHON3_BIN NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
find_program(PYTHON3_BIN python3)
if(PYTHON3_BIN AND NOT MOONBOX_SANITIZE)
  add_test(NAME deploy.routing COMMAND ${PYTHON3_BIN} ${CMAKE_SOURCE_DIR}/spec/deploy/routing_test.py
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(deploy.routing PROPERTIES ENVIRONMENT "${MOONBOX_TEST_ENV}" TIMEOUT 300
    SKIP_RETURN_CODE 77)
  add_test(NAME deploy.manifests COMMAND ${PYTHON3_BIN} ${CMAKE_SOURCE_DIR}/spec/deploy/manifests_test.py
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(deploy.manifests PROPERTIES TIMEOUT 60)
elseif(NOT MOONBOX_SANITIZE)
  moonbox_skip("deploy.routing deploy.manifests" "needs python3")
endif()

# clients/python against a real `moonbox serve` (spec/clients/python_test.py,
# also pip install into a venv, offline); it records every response it sees,
# and clients.openapi checks docs/openapi.yaml against the server's route
# table and validates those recorded responses against its schemas.
if(PYTHON3_BIN AND NOT MOONBOX_SANITIZE)
  set(MOONBOX_CLIENT_RECORD ${CMAKE_BINARY_DIR}/clients-responses.jsonl)
  add_test(NAME clients.python COMMAND ${PYTHON3_BIN} ${CMAKE_SOURCE_DIR}/spec/clients/python_test.py
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(clients.python PROPERTIES
    ENVIRONMENT "${MOONBOX_TEST_ENV};MOONBOX_CLIENT_RECORD=${MOONBOX_CLIENT_RECORD}"
    TIMEOUT 600 FIXTURES_SETUP clients_responses)
  add_test(NAME clients.openapi COMMAND ${PYTHON3_BIN} ${CMAKE_SOURCE_DIR}/spec/clients/openapi_test.py
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(clients.openapi PROPERTIES
    ENVIRONMENT "${MOONBOX_TEST_ENV};MOONBOX_CLIENT_RECORD=${MOONBOX_CLIENT_RECORD}"
    TIMEOUT 120 FIXTURES_REQUIRED clients_responses)
  # the package's annotations hold (it ships py.typed: users' checkers trust them)
  add_test(NAME clients.python.types COMMAND ${PYTHON3_BIN} -m mypy --strict --cache-dir ${CMAKE_BINARY_DIR}/mypy-cache moonbox
    WORKING_DIRECTORY ${CMAKE_SOURCE_DIR}/clients/python)
  set_tests_properties(clients.python.types PROPERTIES TIMEOUT 300)
elseif(NOT MOONBOX_SANITIZE)
  moonbox_skip("clients.python clients.openapi clients.python.types" "needs python3")
endif()

# A fresh machine: the no-namespaces variant of a few suites inside bwrap
# over a clean minimal tree (system dirs read-only, empty /tmp, /home, /root,
# /var, /srv, /opt; no /workspace; no MOONBOX_HOME): no spec may need the
# host's directories, users or leftovers (spec/fresh-root.sh, docs/testing.md).
find_program(BWRAP_BIN bwrap)
if(SPEC_FILES AND NOT MOONBOX_SANITIZE)
  if(BWRAP_BIN)
    foreach(spec spec/session/session_spec.lua spec/files/files_spec.lua spec/process/process_spec.lua
            spec/session/spawn_builtin_spec.lua spec/contract_spec.lua spec/security/fail_closed_spec.lua)
      string(REGEX REPLACE "^spec/|_spec\\.lua$" "" name ${spec})
      string(REPLACE "/" "." name ${name})
      add_test(NAME fresh_root.${name}
        COMMAND sh ${CMAKE_SOURCE_DIR}/spec/fresh-root.sh ${CMAKE_SOURCE_DIR} ${CMAKE_BINARY_DIR} ${spec})
      set_tests_properties(fresh_root.${name} PROPERTIES TIMEOUT 600 PASS_REGULAR_EXPRESSION "fresh-root: ok")
    endforeach()
  else()
    moonbox_skip("fresh_root.*" "needs bwrap: apt-get install bubblewrap")
  endif()
endif()

# The documents' code blocks run against this build and what they print is
# compared with what the documents show (spec/doc-blocks.lua, with the
# examples' matcher): docs/tutorial.md, and docs/http-api.md against a live
# `moonbox serve` the test starts on a free port with a token file.
find_program(CURL_BIN curl)
find_program(JQ_BIN jq)
if(NOT MOONBOX_SANITIZE)
  if(CURL_BIN AND PYTHON3_BIN)
    add_test(NAME doc.tutorial
      COMMAND $<TARGET_FILE:moonbox_cli> spec/doc-blocks.lua docs/tutorial.md
      WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
    set_tests_properties(doc.tutorial PROPERTIES ENVIRONMENT "${MOONBOX_TEST_ENV}" TIMEOUT 600
      PASS_REGULAR_EXPRESSION "doc-blocks: docs/tutorial.md: ok")
  else()
    moonbox_skip("doc.tutorial" "needs curl and python3")
  endif()
  if(CURL_BIN AND JQ_BIN AND PYTHON3_BIN)
    add_test(NAME doc.http_api
      COMMAND $<TARGET_FILE:moonbox_cli> spec/doc-blocks.lua docs/http-api.md --serve
      WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
    set_tests_properties(doc.http_api PROPERTIES ENVIRONMENT "${MOONBOX_TEST_ENV}" TIMEOUT 600
      PASS_REGULAR_EXPRESSION "doc-blocks: docs/http-api.md: ok")
  else()
    moonbox_skip("doc.http_api" "needs curl, jq and python3")
  endif()
endif()

if(MOONBOX_SKIPPED_TESTS)
  string(REPLACE ";" "\n  " skipped "${MOONBOX_SKIPPED_TESTS}")
  message(STATUS "moonbox: test groups left out:\n  ${skipped}")
endif()
