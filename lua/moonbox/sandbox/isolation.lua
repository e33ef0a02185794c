-- Namespaces for a sandbox (isolation = "namespaces"): the root filesystem
-- plan and the sandbox init that is pid 1 inside (src/nsinit.c). Every
-- process of the sandbox is started by that init, so all of them share one
-- set of namespaces; the init dies with the runtime and takes them along.
local core = require "moonbox.core"
local util = require "moonbox.lib.util"

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

-- "CAP_CHOWN", "chown" -> "chown": how a policy may spell one
local function short_name(name) return (name:lower():gsub("^cap_", "")) end
M.cap_short_name = short_name

-- The names as info() reports them: lower case, no CAP_ prefix, known ones
-- only (cap_numbers' reading of them), once each.
function M.cap_names(names)
  local out, seen = {}, {}
  for _, name in ipairs(names) do
    local short = short_name(name)
    if CAP_NUMBERS[short] and not seen[short] then
      seen[short] = true
      out[#out + 1] = short
    end
  end
  return out
end

function M.cap_numbers(names)
  local out = {}
  for _, name in ipairs(names) do
    local n = CAP_NUMBERS[short_name(name)]
    if n then out[#out + 1] = n end
  end
  return out
end

-- Who root inside is on the host (docs/isolation.md): a runtime that is
-- root maps the sandbox's ids 0..count-1 to an unprivileged range no host
-- account uses (policy `idmap`, else the subordinate ids of SUBID_USER in
-- /etc/subuid and /etc/subgid, else DEFAULT_IDMAP), so root inside has no
-- power over anything of the host's; an unprivileged runtime can only map
-- itself: root inside is the runtime's user.
M.DEFAULT_IDMAP = { uid = 2000000000, gid = 2000000000, count = 65536 }
M.SUBID_USER = "moonbox"
M.SUBUID_FILE, M.SUBGID_FILE = "/etc/subuid", "/etc/subgid"

-- The first range of user in a subordinate id file that has the ids an
-- image needs (at least 65536), as start, count.
local function subid_range(file, user)
  local f = io.open(file, "r")
  if not f then return nil end
  for line in f:lines() do
    local name, start, count = line:match("^%s*([^:#%s]+):(%d+):(%d+)%s*$")
    start, count = tonumber(start), tonumber(count)
    if name == user and start > 0 and count >= 65536 and start + count - 1 <= 4294967294 then
      f:close()
      return start, count
    end
  end
  f:close()
end

-- idmap(policy) -> {uid, gid, count}: the host uid and gid of root inside
-- and how many ids are mapped (1 when the runtime is not root).
function M.idmap(policy)
  if core.getuid() ~= 0 then return { uid = core.getuid(), gid = core.getgid(), count = 1 } end
  local p = policy.idmap or {}
  if p.uid then return { uid = p.uid, gid = p.gid or p.uid, count = p.count or M.DEFAULT_IDMAP.count } end
  local uid, ucount = subid_range(M.SUBUID_FILE, p.user or M.SUBID_USER)
  local gid, gcount = subid_range(M.SUBGID_FILE, p.user or M.SUBID_USER)
  if uid and gid then return { uid = uid, gid = gid, count = math.min(ucount, gcount, p.count or ucount) } end
  local d = M.DEFAULT_IDMAP
  return { uid = d.uid, gid = d.gid, count = p.count or d.count }
end

-- Per-user kernel counters of the sandbox's own user namespace
-- (/proc/sys/user/*), written by the init before /proc/sys turns
-- read-only; policy `userns` overrides them. The kernel charges what the
-- sandbox uses to every ancestor namespace too, up to the runtime's user on
-- the host, so these keep one sandbox from taking that user's whole quota
-- (the host's default max_inotify_instances is 128).
M.DEFAULT_USERNS = {
  max_inotify_instances = 32, max_inotify_watches = 65536,
  max_fanotify_groups = 16, max_fanotify_marks = 8192,
  max_user_namespaces = 16, max_mnt_namespaces = 64, max_pid_namespaces = 64, max_net_namespaces = 64,
  max_ipc_namespaces = 64, max_uts_namespaces = 64, max_cgroup_namespaces = 64, max_time_namespaces = 64,
}

-- Parts of procfs that reach past the sandbox's namespaces: bound over
-- themselves read-only (global sysctls, sysrq, irq affinity, bus and fs
-- tunables) or hidden behind an empty read-only file or directory (kernel
-- memory and symbols, the keyring list, timers and scheduler internals,
-- hardware). Missing ones are skipped. docs/isolation.md gives the reasons.
M.PROC_READONLY = { "sys", "sysrq-trigger", "irq", "bus", "fs" }
M.PROC_MASKED = { "kcore", "keys", "timer_list", "sched_debug", "kallsyms", "latency_stats", "timer_stats",
  "acpi", "asound", "scsi" }

local function proc_protection(dst)
  local m = {}
  for _, name in ipairs(M.PROC_READONLY) do
    m[#m + 1] = { type = "readonly", dst = dst .. "/" .. name, optional = true }
  end
  for _, name in ipairs(M.PROC_MASKED) do m[#m + 1] = { type = "mask", dst = dst .. "/" .. name, optional = true } end
  return m
end

local function userns_sysctls(values)
  local names = {}
  for name in pairs(values) do names[#names + 1] = name end
  table.sort(names)
  local m = {}
  for _, name in ipairs(names) do
    m[#m + 1] = { type = "sysctl", dst = "/proc/sys/user/" .. name, data = tostring(math.floor(values[name])),
      optional = true }
  end
  return m
end

local function exists(path)
  local f = io.open(path, "r")
  if f then f:close() return true end
  return util.is_dir(path)
end

-- An image's root (docs/images.md): its layer directories and the
-- sandbox's upper dir bound into the root under construction, then an
-- overlayfs of them becomes the root (src/nsinit.c mount_overlay_root);
-- the host's name resolution files go over the image's, as Docker does.
local function image_root(m, image, opts)
  local lowers = {}
  for i, dir in ipairs(image.lowers) do -- bottom first
    m[#m + 1] = { type = "ro_bind", src = dir, dst = "/.mb-layers/" .. i }
    table.insert(lowers, 1, ".mb-layers/" .. i) -- overlayfs lists the top first
  end
  m[#m + 1] = { type = "bind", src = image.upper, dst = "/.mb-upper" }
  m[#m + 1] = { type = "overlay", dst = "/", data = ("lowerdir=%s,upperdir=.mb-upper/upper,workdir=.mb-upper/work,"
    .. "userxattr"):format(table.concat(lowers, ":")) }
  for _, name in ipairs { "resolv.conf", "hosts" } do
    local path = "/etc/" .. name
    if opts.resolv_conf and name == "resolv.conf" then -- (an egress sandbox's, as below)
      m[#m + 1] = { type = "file", dst = path, data = opts.resolv_conf }
    elseif exists(path) then
      m[#m + 1] = { type = "ro_bind", src = path, dst = path, optional = true }
    end
  end
end

-- The default root: the host's system directories read-only (symlinks such
-- as /bin -> usr/bin recreated as symlinks), the needed /etc files, a fresh
-- /proc, a minimal /dev, tmpfs /tmp and /root, the workspace and run dirs.
-- With opts.image the image's layers are the root instead (image_root).
local function host_system(m, opts)
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
    -- (an egress sandbox's resolver is its own: network/resolver.lua)
    if opts.resolv_conf and name == "resolv.conf" then
      m[#m + 1] = { type = "file", dst = path, data = opts.resolv_conf }
    elseif exists(path) then
      m[#m + 1] = { type = "ro_bind", src = path, dst = path, optional = true }
    end
  end
end

function M.mounts(sb, opts)
  local m = {}
  if opts.image then image_root(m, opts.image, opts) else host_system(m, opts) end
  m[#m + 1] = { type = "file", dst = "/etc/hostname", data = opts.hostname .. "\n" }
  m[#m + 1] = { type = "proc", dst = "/proc" }
  local userns = {}
  for k, v in pairs(M.DEFAULT_USERNS) do userns[k] = v end
  for k, v in pairs(opts.userns or {}) do userns[k] = v end
  for _, s in ipairs(userns_sysctls(userns)) do m[#m + 1] = s end
  m[#m + 1] = { type = "dev", dst = "/dev", size = opts.tmpBytes } -- the size of its /dev/shm
  m[#m + 1] = { type = "tmpfs", dst = "/tmp", size = opts.tmpBytes }
  -- (an image's /root is its own, in the sandbox's upper dir)
  if not opts.image then m[#m + 1] = { type = "tmpfs", dst = "/root", size = opts.tmpBytes } end
  -- a pre-built root (deferred) gets its workspace when a sandbox claims it
  if not opts.deferred then m[#m + 1] = { type = "bind", src = sb.workspace, dst = "/workspace" } end
  m[#m + 1] = { type = "tmpfs", dst = M.RUN_DIR, size = opts.tmpBytes }
  if opts.kernels then m[#m + 1] = { type = "ro_bind", src = opts.kernels, dst = M.KERNEL_DIR } end
  for _, extra in ipairs(opts.extra or {}) do
    m[#m + 1] = { type = extra.type, src = extra.src, dst = extra.dst, size = extra.size or
      ((extra.type == "tmpfs" or extra.type == "dev") and opts.tmpBytes or nil) }
  end
  -- last, so nothing mounted later uncovers them; every procfs gets them
  local procs = {}
  for _, e in ipairs(m) do if e.type == "proc" then procs[#procs + 1] = e.dst end end
  for _, dst in ipairs(procs) do
    for _, e in ipairs(proc_protection(dst == "/" and "" or dst)) do m[#m + 1] = e end
  end
  return m
end

-- The host uid that owns a sandbox's user namespace when the runtime is
-- root: the kernel charges the sandbox's per-user counters (inotify
-- instances and watches above all) to that owner as well, so each sandbox
-- gets an owner of its own, drawn at random from OWNER_IDS (ids no host
-- account has, apart from the sandbox's mapped range): one tenant's use
-- never counts against host root's or another tenant's. Up to four
-- sandboxes sharing an owner would still fit in its 128 (host default)
-- with their 32 each, so a rare collision starves nobody.
M.OWNER_IDS = { first = 2100000000, count = 16777216 }

local function random_u32()
  local f = io.open("/dev/urandom", "rb")
  local b = f and f:read(4)
  if f then f:close() end
  if not b or #b ~= 4 then return math.random(0, 2 ^ 31 - 1) end
  local b1, b2, b3, b4 = b:byte(1, 4)
  return ((b1 * 256 + b2) * 256 + b3) * 256 + b4
end

function M.owner_uid(idmap)
  if core.getuid() ~= 0 then return nil end
  local r = M.OWNER_IDS
  for _ = 1, 8 do
    local uid = r.first + random_u32() % r.count
    if uid < idmap.uid or uid >= idmap.uid + idmap.count then return uid end
  end
  return nil -- a policy mapped over the whole range: root owns it, as before
end

-- start(sb, opts) -> init, namespaces | nil, message, code
-- opts: network ("none" | "host" | "egress"), resolv_conf (its /etc/resolv.conf's
-- text), hostname, tmpBytes (each writable tmpfs),
-- kernels, extra (policy mounts), idmap (M.idmap), owner_uid (M.owner_uid),
-- userns (policy userns),
-- cgroups (dirs the init joins), on_exit, deferred (build the root without
-- the workspace and stay outside it: sandbox/prewarm.lua).
function M.start(sb, opts)
  local idmap = opts.idmap
  local uid_map = ("0 %d %d\n"):format(idmap.uid, idmap.count)
  local gid_map = ("0 %d %d\n"):format(idmap.gid, idmap.count)
  local namespaces = { "user", "mnt", "pid", "ipc", "uts" }
  -- "egress": a namespace of its own too, its link to the host added by
  -- the runtime once the init runs (network/init.lua)
  local own_net = opts.network == "none" or opts.network == "egress"
  if own_net then namespaces[#namespaces + 1] = "net" end
  local init, err, code = core.sandbox_init {
    namespaces = namespaces,
    hostname = opts.hostname,
    loopback = own_net,
    mounts = M.mounts(sb, opts),
    cgroups = opts.cgroups,
    on_exit = opts.on_exit,
    defer_pivot = opts.deferred,
    uid_map = uid_map, gid_map = gid_map,
    owner_uid = opts.owner_uid,
    -- an unprivileged runtime must deny setgroups to map a gid; root keeps
    -- it, and the init drops the groups it inherited
    setgroups = core.getuid() == 0 and "allow" or "deny",
  }
  if not init then return nil, err, code end
  return init, namespaces
end

return M
