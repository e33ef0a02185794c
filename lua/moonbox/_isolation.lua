-- Namespaces for a sandbox (isolation = "namespaces"): the root filesystem
-- plan and the sandbox init that is pid 1 inside (src/nsinit.c). Every
-- process of the sandbox is started by that init, so all of them share one
-- set of namespaces; the init dies with the runtime and takes them along.
local core = require "moonbox.core"
local util = require "moonbox._util"

local M = {}

-- Where the runtime's per-shell pipes live inside (a tmpfs the runtime
-- reaches as /proc/<init>/root/run/moonbox).
M.RUN_DIR = "/run/moonbox"
-- Where the code-interpreter kernels are visible inside.
M.KERNEL_DIR = "/opt/moonbox/kernels"

local SYSTEM_DIRS = { "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32" }
-- The /etc a program needs to run (users, name resolution, the loader,
-- certificates, locale and interpreter config); nothing else of the host's.
local ETC_FILES = { "passwd", "group", "hosts", "resolv.conf", "nsswitch.conf", "host.conf", "ld.so.cache",
  "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "timezone", "ssl", "ca-certificates",
  "ca-certificates.conf", "os-release", "debian_version", "mime.types", "magic", "protocols", "services",
  "inputrc", "terminfo", "bash.bashrc", "profile", "environment", "python3", "python3.11", "gitconfig",
  "login.defs", "shells", "matplotlibrc", "fonts", "gai.conf", "mailcap", "xdg" }

-- Capabilities root inside the sandbox keeps by default (Docker's default
-- set): enough to own files and switch users inside, nothing that reaches
-- the kernel or other namespaces.
M.DEFAULT_CAPABILITIES = { "chown", "dac_override", "fowner", "fsetid", "kill", "setgid", "setuid",
  "setpcap", "net_bind_service", "net_raw", "sys_chroot", "mknod", "audit_write", "setfcap" }
local CAP_NUMBERS = { chown = 0, dac_override = 1, dac_read_search = 2, fowner = 3, fsetid = 4, kill = 5,
  setgid = 6, setuid = 7, setpcap = 8, linux_immutable = 9, net_bind_service = 10, net_broadcast = 11,
  net_admin = 12, net_raw = 13, ipc_lock = 14, ipc_owner = 15, sys_module = 16, sys_rawio = 17,
  sys_chroot = 18, sys_ptrace = 19, sys_pacct = 20, sys_admin = 21, sys_boot = 22, sys_nice = 23,
  sys_resource = 24, sys_time = 25, sys_tty_config = 26, mknod = 27, lease = 28, audit_write = 29,
  audit_control = 30, setfcap = 31, mac_override = 32, mac_admin = 33, syslog = 34, wake_alarm = 35,
  block_suspend = 36, audit_read = 37, perfmon = 38, bpf = 39, checkpoint_restore = 40 }
M.CAP_NUMBERS = CAP_NUMBERS

function M.cap_numbers(names)
  local out = {}
  for _, name in ipairs(names) do
    local n = CAP_NUMBERS[(name:lower():gsub("^cap_", ""))]
    if n then out[#out + 1] = n end
  end
  return out
end

local function exists(path)
  local f = io.open(path, "r")
  if f then f:close() return true end
  return util.is_dir(path)
end

-- The default root: the host's system directories read-only (symlinks such
-- as /bin -> usr/bin recreated as symlinks), the needed /etc files, a fresh
-- /proc, a minimal /dev, tmpfs /tmp and /root, the workspace and run dirs.
function M.mounts(sb, opts)
  local m = {}
  for _, dir in ipairs(SYSTEM_DIRS) do
    local target = core.readlink(dir)
    if target then
      m[#m + 1] = { type = "symlink", src = target, dst = dir }
    elseif util.is_dir(dir) then
      m[#m + 1] = { type = "ro_bind", src = dir, dst = dir }
    end
  end
  for _, name in ipairs(ETC_FILES) do
    local path = "/etc/" .. name
    if exists(path) then m[#m + 1] = { type = "ro_bind", src = path, dst = path, optional = true } end
  end
  m[#m + 1] = { type = "file", dst = "/etc/hostname", data = opts.hostname .. "\n" }
  m[#m + 1] = { type = "proc", dst = "/proc" }
  m[#m + 1] = { type = "dev", dst = "/dev" }
  m[#m + 1] = { type = "tmpfs", dst = "/tmp", size = opts.tmpBytes }
  m[#m + 1] = { type = "tmpfs", dst = "/root", size = opts.tmpBytes }
  -- a pre-built root (deferred) gets its workspace when a sandbox claims it
  if not opts.deferred then m[#m + 1] = { type = "bind", src = sb.workspace, dst = "/workspace" } end
  m[#m + 1] = { type = "tmpfs", dst = M.RUN_DIR }
  if opts.kernels then m[#m + 1] = { type = "ro_bind", src = opts.kernels, dst = M.KERNEL_DIR } end
  for _, extra in ipairs(opts.extra or {}) do
    m[#m + 1] = { type = extra.type, src = extra.src, dst = extra.dst, size = extra.size }
  end
  return m
end

-- start(sb, opts) -> init, namespaces | nil, message, code
-- opts: network ("none" | "host"), hostname, tmpBytes, kernels, extra
-- (policy mounts), cgroups (dirs the init joins), on_exit, deferred (build
-- the root without the workspace and stay outside it: _prewarm).
function M.start(sb, opts)
  local namespaces = { "user", "mnt", "pid", "ipc", "uts" }
  if opts.network == "none" then namespaces[#namespaces + 1] = "net" end
  local init, err, code = core.sandbox_init {
    namespaces = namespaces,
    hostname = opts.hostname,
    loopback = opts.network == "none",
    mounts = M.mounts(sb, opts),
    cgroups = opts.cgroups,
    on_exit = opts.on_exit,
    defer_pivot = opts.deferred,
  }
  if not init then return nil, err, code end
  return init, namespaces
end

return M
