#!/bin/sh
# Install the Debian 12 packages moonbox needs. Non-interactive, and a no-op
# when everything is already present.
#   install-deps.sh        build and run (what scripts/quickstart.sh uses)
#   install-deps.sh test   that, plus what the tests need (scripts/test.sh):
#                          linters, the browser, nginx, the fuzz toolchain,
#                          the packaging checks, and the page test's npm cache
set -eu
mode=${1:-run}
case "$mode" in
  run | test) ;;
  *) echo "usage: install-deps.sh [test]" >&2; exit 2 ;;
esac
# build: the compiler, cmake and the libraries' headers; bash-builtins for
# the session shells' spawn builtin
PACKAGES="build-essential cmake pkg-config
libluajit-5.1-dev luajit libuv1-dev lua-cjson libseccomp-dev libmagic-dev
libwslay-dev bash-builtins"
# run: the disk quota (sandbox/disk.lua): mkfs.ext4; mount, umount, fallocate;
# python3 for the code interpreter's default language, git for gitCheckout
PACKAGES="$PACKAGES e2fsprogs util-linux mount procps python3 git"
# run: network = "egress" (lua/moonbox/network/): veth pairs (ip), one
# nftables table per sandbox (nft; the resolver is the runtime's own);
# nsenter is util-linux's; an unprivileged runtime's way out is pasta (passt)
PACKAGES="$PACKAGES iproute2 nftables passt"
# build and run: images (src/image_unpack.c, lua/moonbox/images/): libarchive
# reads layers, nettle hashes blobs, curl fetches from registries
PACKAGES="$PACKAGES libarchive-dev nettle-dev curl"
if [ "$mode" = test ]; then
  # the specs and linters
  PACKAGES="$PACKAGES lua-busted lua-check python3-yaml python3-ipython python3-matplotlib
curl jq nginx-light bubblewrap squashfs-tools node-typescript shellcheck clang-format"
  # the Python client's tests (spec/clients/): pip install into a venv,
  # offline (setuptools and wheel build it without build isolation), and the
  # OpenAPI description's schemas checked with jsonschema; types with mypy
  PACKAGES="$PACKAGES python3-venv python3-pip python3-setuptools python3-wheel python3-jsonschema python3-mypy"
  # the page's browser test: chromium (driven by playwright-core from npm)
  PACKAGES="$PACKAGES chromium"
  # the fuzz build (cmake/fuzz.cmake): clang, and libclang-rt-14-dev for the libFuzzer runtime
  PACKAGES="$PACKAGES clang libclang-rt-14-dev"
  # the packaging checks (spec/package-test.sh, docs/packaging.md): lintian;
  # systemd-analyze verify of the unit; the bash completion (spec/completion-test.sh)
  PACKAGES="$PACKAGES lintian systemd bash-completion"
  # the container image without a registry (spec/image-test.sh): a base made
  # by mmdebstrap, deploy/Dockerfile built with buildah
  PACKAGES="$PACKAGES mmdebstrap buildah"
  # the image specs (spec/images/): a busybox rootfs, file capabilities
  # (setcap), and the archives and layouts skopeo writes
  PACKAGES="$PACKAGES busybox-static libcap2-bin skopeo"
  # a real registry for the pull specs (spec/images/docker_registry_spec.lua):
  # docker-registry (distribution) on the loopback, htpasswd for its bcrypt users,
  # openssl for the key and certificate its token service signs with
  PACKAGES="$PACKAGES docker-registry apache2-utils openssl"
  # node and npm (the page's browser test, the compat client): Debian's unless present
  command -v npm >/dev/null 2>&1 || PACKAGES="$PACKAGES nodejs npm"
fi
missing=""
for p in $PACKAGES; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "install-deps: installing$missing" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  # Acquire::Retries: a mirror address that times out is tried again, then another
  $SUDO apt-get -o Acquire::Retries=5 update -qq
  # shellcheck disable=SC2086
  $SUDO apt-get -o Acquire::Retries=5 install -y -qq --no-install-recommends $missing >/dev/null
  # docker-registry's package starts its own service on :5000 (every address,
  # no auth) under systemd; the specs start theirs on the loopback, so it goes
  case " $missing " in
    *" docker-registry "*) [ ! -d /run/systemd/system ] || $SUDO systemctl disable --now docker-registry.service ;;
  esac
fi
[ "$mode" = test ] || exit 0

# The page's npm packages (playwright-core for its browser test; @xterm/xterm,
# which page.vendor compares with share/page/vendor/), pinned by
# share/page/package-lock.json, into a cache in the source tree (the build
# itself never reaches the network). MOONBOX_PAGE_DEPS overrides the cache's
# place (pass the same directory to cmake as -DMOONBOX_PAGE_DEPS=DIR).
root="$(cd "$(dirname "$0")/.." && pwd)"
cache="${MOONBOX_PAGE_DEPS:-$root/.deps/page}"
if ! cmp -s "$root/share/page/package-lock.json" "$cache/package-lock.json" ||
   [ ! -e "$cache/node_modules/playwright-core/package.json" ]; then
  echo "install-deps: npm ci into $cache" >&2
  mkdir -p "$cache"
  cp "$root/share/page/package.json" "$root/share/page/package-lock.json" "$cache/"
  # without it everything builds and works; CTest leaves the page's browser test out
  if ! command -v npm >/dev/null 2>&1 || ! npm ci --no-audit --no-fund --loglevel=error --prefix "$cache"; then
    echo "install-deps: could not fetch the page's npm packages: CTest leaves page.* out" >&2
  fi
fi
