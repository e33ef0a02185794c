-- Sandbox: a directory (root, holding workspace/) with sessions and a
-- policy; under isolation = "namespaces" also its own namespaces, entered
-- through a sandbox init (sandbox/isolation.lua). Its own methods run in the default
-- session. Same id in one process -> same object.
local async = require "moonbox.async"
local errors = require "moonbox.errors"
local core = require "moonbox.core"
local policy_mod = require "moonbox.policy"
local session_mod = require "moonbox.session"
local shell_mod = require "moonbox.session.shell"
local tree = require "moonbox.process.tree"
local cgroup = require "moonbox.process.cgroup"
local util = require "moonbox.lib.util"
local limits = require "moonbox.sandbox.limits"
local V = require "moonbox.lib.validate"
local isolation_mod = require "moonbox.sandbox.isolation"
local arity = require "moonbox.lib.arity"
local fs = require "moonbox.lib.fs"
local disk = require "moonbox.sandbox.disk"
local prewarm = require "moonbox.sandbox.prewarm"
local root_mod = require "moonbox.sandbox.root"
local userns = require "moonbox.sandbox.userns"
local spawn_rules = require "moonbox.sandbox.spawn"
local compose = require "moonbox.lib.compose"
local registry_mod = require "moonbox.sandbox.registry"
local rules_mod = require "moonbox.sandbox.rules"
local image_mod = require "moonbox.sandbox.image"
local network_mod = require "moonbox.network"

local M = {}

local registry = registry_mod.live -- id -> sandbox
local dying = registry_mod.dying -- being destroyed: their processes are still ours
registry_mod.shell_pids = shell_mod.live
-- root -> disk state of a sandbox destroyed with keepFiles: its image stays
-- mounted while this runtime lives (a getSandbox of that root takes it
-- again), and is unmounted at the runtime's exit (M.shutdown)
local kept_disks = {}

-- Whether isolation = "auto" may fall back to "none" where the kernel
-- refuses user namespaces (said once on stderr). moonbox serve turns this
-- off unless started with --allow-unisolated.
M.allow_unisolated = true

local Sandbox = {}
Sandbox.__index = Sandbox

local function default_home()
  local home = os.getenv("MOONBOX_HOME")
  if home and home ~= "" then return home end
  local xdg = os.getenv("XDG_DATA_HOME")
  if xdg and xdg ~= "" then return xdg .. "/moonbox" end
  return (os.getenv("HOME") or "/root") .. "/.local/share/moonbox"
end
M.default_home = default_home

local function mkdir_p(path)
  if util.is_dir(path) then return true end
  local parent = path:match("^(.*)/[^/]+$")
  if parent and parent ~= "" then
    local ok, err, code = mkdir_p(parent)
    if not ok then return nil, err, code end
  end
  local ok, err, code = core.mkdir(path, 493)
  if not ok and code ~= "EEXIST" then return nil, err, code end
  return true
end
M.mkdir_p = mkdir_p

local normalize = util.normalize

local get_options = { root = true, isolation = true, network = true, egress = true, env = true, policy = true,
  limits = true, image = true, user = true }

-- One making or destroying of a sandbox id at a time (a FIFO lock per id,
-- dropped when nobody holds or waits for it): two first getSandbox calls
-- for one id get the one sandbox the first makes, and a getSandbox while
-- that id's sandbox is being destroyed waits for the destroy, then makes it
-- anew (the root's lock is free again by then).
local id_locks = {}
local function with_id_lock(id, fn)
  if not async.in_task() then return fn() end -- (nothing else runs meanwhile)
  local q = id_locks[id]
  if not q then
    q = require("moonbox.session.queue").new()
    id_locks[id] = q
  end
  local ok, result = pcall(q.run, q, fn)
  if id_locks[id] == q and not q.busy and #q.waiters == 0 then id_locks[id] = nil end
  if not ok then error(result, 0) end
  return result
end

local make_sandbox

function M.getSandbox(id, opts)
  V.sandbox_id(id, "id")
  -- (a live id returns its sandbox as it is, but the options are checked
  -- all the same: a mistake in them is not silently dropped)
  if registry[id] and opts == nil then return registry[id] end
  opts = V.options(opts, get_options, "getSandbox options")
  if registry[id] then return make_sandbox(id, opts) end -- (checks the options against it)
  async.check_task("moonbox.getSandbox") -- (making one waits)
  return with_id_lock(id, function() return make_sandbox(id, opts) end)
end

-- An undo list: each step of making a sandbox pushes what takes back what
-- it made; a failure runs the list in reverse, each undo on its own (one
-- that fails keeps none of the others from running).
local function undo_list()
  local list = {}
  return {
    push = function(fn) list[#list + 1] = fn end,
    run = function() for i = #list, 1, -1 do pcall(list[i]) end end,
  }
end

-- Step 1, the options: checked, the policy resolved. -> plan
local function check_options(id, opts)
  local isolation = opts.isolation or "auto"
  if isolation ~= "auto" and isolation ~= "none" and isolation ~= "namespaces" then
    V.fail("isolation", "expected \"auto\", \"namespaces\" or \"none\"")
  end
  if opts.network ~= nil and opts.network ~= "none" and opts.network ~= "host" and opts.network ~= "egress" then
    V.fail("network", "expected \"none\", \"host\" or \"egress\"")
  end
  if opts.egress ~= nil then require("moonbox.network.rules").parse(opts.egress, "egress") end
  local policy = policy_mod.resolve(opts.policy, opts.limits)
  if opts.isolation == nil and policy.isolation then isolation = policy.isolation end
  -- rules asked of this call for a network that has none are a mistake, not dropped
  if opts.egress ~= nil and (opts.network or policy.network or "none") ~= "egress" then
    V.fail("egress", ('rules apply to network = "egress", not %q'):format(opts.network or policy.network or "none"))
  end
  local env = V.env(opts.env, "env") or {}
  if opts.root ~= nil then V.path(opts.root, "root") end
  if opts.image ~= nil and (type(opts.image) ~= "string" or opts.image == "") then
    V.fail("image", "expected an image reference (a string)")
  end
  image_mod.check_user(opts.user)
  return { id = id, opts = opts, isolation = isolation, policy = policy, env = env,
    image_ref = opts.image or policy.image }
end

-- Step 2, the isolation: "auto" runs without namespaces only where the
-- kernel refuses user namespaces, never for a failure of the moment (fail
-- closed), and what only namespaces give is refused without them. Then the
-- sandbox's rules (sandbox/rules.lua), derived once.
local function choose_isolation(plan)
  local isolation, policy, opts = plan.isolation, plan.policy, plan.opts
  local unisolated
  if isolation == "auto" then
    local why, msg, code = userns.refused()
    if msg then
      errors.raise("ISOLATION_UNAVAILABLE", "cannot create the sandbox's namespaces: " .. msg,
        { isolation = isolation, errno = code })
    end
    if why and not M.allow_unisolated then
      errors.raise("ISOLATION_UNAVAILABLE", ("cannot isolate the sandbox: %s; this server creates " ..
        "no unisolated sandbox unless started with --allow-unisolated or given a policy with isolation = \"none\"")
        :format(why), { isolation = isolation })
    end
    if why then userns.warn_once(why) end
    unisolated = why
  end
  -- what only namespaces give, asked for in so many words, is refused
  -- without them, never quietly dropped: a network of its own (asked of
  -- getSandbox or by the policy, a preset's too), the policy's mounts, its
  -- hostname. (The limits are what info() says is in force.)
  if isolation == "none" or unisolated then
    local own = opts.network or policy.network
    local no_network = own == "none" or own == "egress"
    local field = (no_network and (opts.network and "network" or "policy.network"))
      or (policy.mounts and next(policy.mounts) and "policy.mounts") or (policy.hostname and "policy.hostname")
      or (plan.image_ref and "image")
    if field then
      local what = ("%s needs the sandbox's own namespaces"):format(field:find("network") and
        ('network = "%s"'):format(own) or field)
      if isolation == "none" then
        errors.raise("VALIDATION_FAILED", ("%s: %s, and isolation is \"none\""):format(field, what), { field = field })
      end
      errors.raise("ISOLATION_UNAVAILABLE", ("%s: %s, which this host cannot give (%s)")
        :format(field, what, unisolated), { isolation = isolation, field = field })
    end
  end
  plan.unisolated = unisolated
  plan.isolated = isolation ~= "none" and not unisolated
  plan.rules = rules_mod.derive(policy, { network = opts.network or policy.network or "none",
    hostname = policy.hostname or plan.id, isolated = plan.isolated })
end

-- Step 3, the root (docs/api.md "Sandbox roots"): checked, made, its disk
-- image mounted on it, locked; the workspace made and given to root
-- inside; then an image's layers (prepare_image).
local function prepare_root(plan, undo)
  local opts, policy, id = plan.opts, plan.policy, plan.id
  local home = default_home()
  local default_root = home .. "/sandboxes/" .. id
  local root = opts.root and V.path(opts.root, "root") or default_root
  local workspace = root .. "/workspace"
  -- the image, in the store (imported now when the reference names a
  -- layout or archive not yet there): before anything is made
  local image_rec = plan.image_ref and image_mod.resolve(plan.image_ref)
  local canon = root_mod.check(root, home, default_root)
  if root:sub(1, 1) ~= "/" then -- (relative to our cwd: info() says where)
    root = canon
    workspace = root .. "/workspace"
  end
  plan.root, plan.workspace, plan.canon = root, workspace, canon
  local created = {}
  local function remove_created() for i = #created, 1, -1 do core.rmdir(created[i]) end end
  undo.push(remove_created)
  local ok, err = root_mod.mkdir_p(canon, created)
  if not ok then
    errors.raise("FILESYSTEM_ERROR", "cannot create the sandbox directory: " .. tostring(err), { root = root })
  end
  -- the disk quota: the root becomes the mount point of an image of its
  -- own (sandbox/disk.lua) before anything is made in it
  local before = disk.mounted_at(canon)
  local made = false
  for _, dir in ipairs(created) do made = made or dir == canon end
  -- a spare (sandbox/prewarm.lua) is taken now: its disk, made ahead, is
  -- the root's when a new one is (an egress sandbox's and an image's are
  -- never pre-built; what of it is not used goes: prewarm.finish, drop)
  if plan.isolated and prewarm.enabled and plan.rules.network ~= "egress" and not plan.image_ref then
    local spare = prewarm.take(prewarm.key(plan.rules, policy))
    plan.spare = spare
    if spare then undo.push(function() prewarm.drop(spare) end) end
  end
  plan.disk_state, plan.disk_why = disk.attach(canon, home, policy.limits.diskBytes, made,
    plan.spare and plan.spare.disk)
  if plan.disk_state and not before then
    core.rmdir(canon .. "/lost+found") -- (mkfs's; e2fsck makes it again)
    -- a mount made here goes, and the image with it when the image is new
    -- (the root then had nothing)
    local state = plan.disk_state
    undo.push(function()
      remove_created()
      disk.detach(state, state.fresh)
      remove_created()
    end)
  end
  if root_mod.canonical(root) ~= canon then -- a ".." after a symlink, say
    V.fail("root", ("root %q leads elsewhere once made (%s)"):format(root, root_mod.canonical(root)))
  end
  local lock = root_mod.lock(id, canon)
  undo.push(function() root_mod.undo(lock, {}) end)
  plan.lock = lock
  plan.identity = root_mod.identity(canon) -- destroy removes this directory, never another one at its path
  if not plan.identity then errors.raise("FILESYSTEM_ERROR", "cannot stat the sandbox root", { root = root }) end
  local made_ws, msg = root_mod.mkdir_p(canon .. "/workspace", created)
  if not made_ws then
    errors.raise("FILESYSTEM_ERROR", "cannot create the sandbox directory: " .. tostring(msg), { root = root })
  end
  -- who root inside is on the host; the workspace is root inside's
  local idmap = plan.rules.idmap
  if idmap.count > 1 then
    local chowned, cerr, code = core.chown(workspace, idmap.uid, idmap.gid)
    if not chowned then
      if code == "EINVAL" then -- the range does not exist where the runtime runs (a user namespace of its own)
        errors.raise("ISOLATION_UNAVAILABLE", ("cannot create the sandbox's namespaces: its id range %d-%d is " ..
          "not mapped in the runtime's own user namespace (set the policy's idmap)")
          :format(idmap.uid, idmap.uid + idmap.count - 1), { isolation = plan.isolation, errno = code })
      end
      errors.raise("FILESYSTEM_ERROR", "cannot give the workspace to the sandbox's root: " .. tostring(cerr),
        { root = root })
    end
  end
  plan.image_rec = image_rec
end

-- An image's root: its layers for the sandbox's id range, and its upper
-- dir under the root (inside its disk image when it has one). A root made
-- from an image is got again from it, named or not.
local function prepare_image(plan)
  local image_rec = plan.image_rec
  local made_by = not image_rec and image_mod.made_by(plan.canon)
  if made_by then
    if not plan.isolated then
      errors.raise("ISOLATION_UNAVAILABLE", ("the sandbox's root was made from image %s, which needs the "
        .. "sandbox's own namespaces"):format(made_by), { isolation = plan.isolation })
    end
    image_rec = image_mod.resolve(made_by)
  end
  if plan.opts.user ~= nil and not image_rec then
    V.fail("user", "applies to a sandbox made from an image (its processes run as root inside otherwise)")
  end
  plan.from_image = image_rec ~= nil
  if not image_rec then return end
  plan.image_mounts, plan.image_info = image_mod.prepare(image_rec, plan.canon, plan.rules.idmap, plan.opts.user)
  -- the image's User writes the workspace (docs/images.md)
  image_mod.give(plan.workspace, plan.image_info, plan.rules.idmap)
  for name, value in pairs(plan.image_info.env) do
    if plan.env[name] == nil then plan.env[name] = value end
  end
end

local function new_sandbox(plan)
  return setmetatable({
    id = plan.id,
    image = plan.image_info, image_mounts = plan.image_mounts,
    root = plan.root,
    workspace = plan.workspace,
    fs_root = plan.root,
    home = plan.workspace,    -- a new session's cwd, as a path the shell understands
    isolation = "none",
    requested_isolation = plan.isolation,
    network = "host",
    namespaces = {},
    policy = plan.policy,
    rules = plan.rules,
    env = plan.env,
    sessions = {},
    session_seq = 0,
    processes = {},
    process_seq = 0,
    shell_seq = 0,
    cgroup_name = cgroup.fresh_name("sb-" .. plan.id),
    idmap = plan.rules.idmap,
    disk = plan.disk_state, disk_not_enforced = plan.disk_why,
    root_lock = plan.lock, root_canon = plan.canon, root_identity = plan.identity,
  }, Sandbox)
end

-- Step 4, the limits: the sandbox's cgroup, the runtime's exit guard
-- without namespaces, cgroup and rlimit limits (sandbox/limits.lua).
local function set_limits(self, plan, undo)
  undo.push(function() if self.guarded then cgroup.unguard() end end)
  undo.push(function()
    local dir = rules_mod.cgroup_dir(self.cgroup_name)
    if dir then cgroup.remove_cgroup(dir) end
  end)
  if tree.mode() == "cgroup" then errors.check("ISOLATION_UNAVAILABLE", cgroup.create(self.cgroup_name)) end
  if not plan.isolated then
    local guarded, why, code = cgroup.guard_base()
    if not guarded then
      -- (fail closed: it is what kills this sandbox's processes should the runtime die)
      errors.raise("ISOLATION_UNAVAILABLE", "cannot start the runtime's exit guard: " .. tostring(why),
        { isolation = "none", errno = code })
    end
    self.guarded = true
  end
  undo.push(function() if self.limits_state then limits.cleanup(self.limits_state, async.sleep) end end)
  self.limits_state = limits.setup(self)
end

-- A spare (sandbox/prewarm.lua) of these rules, claimed: its init and
-- shell, and its cgroup (cgroup mode), which becomes the sandbox's. -> init, namespaces | nil
local function claim_spare(self, plan, on_init_exit)
  local pre = prewarm.finish(plan.spare, plan.rules.hostname, self.workspace, on_init_exit)
  if not pre then return nil end
  self.owner_uid = pre.owner_uid
  self.prebuilt_shell = pre.shell
  if pre.cgroup_name then
    -- it brings its cgroup: the limits (never pre-built) are set up
    -- again on it, and its processes join the v1 limit directories
    core.rmdir(rules_mod.cgroup_dir(self.cgroup_name))
    self.cgroup_name = pre.cgroup_name
    limits.cleanup(self.limits_state, async.sleep)
    self.limits_state = limits.setup(self)
  end
  local adopted, why = true, nil
  if pre.cgroup_name then
    adopted, why = limits.adopt(self.limits_state, rules_mod.cgroup_dir(self.cgroup_name))
  elseif next(self.limits_state.v1_dirs) then
    adopted, why = nil, "a pre-built sandbox without a cgroup of its own cannot join its limit directories"
  end
  if not adopted then
    pcall(pre.init.close, pre.init)
    if pre.shell then pcall(pre.shell.kill, pre.shell, "SIGKILL") end
    errors.raise("ISOLATION_UNAVAILABLE", "cannot put the sandbox's limits on: " .. tostring(why),
      { isolation = plan.isolation })
  end
  return pre.init, pre.namespaces
end

-- Step 5, entering isolation: the sandbox's init (a spare's, or one
-- started now) with its namespaces, its network linked, its run directory.
local function enter_isolation(self, plan, undo)
  if plan.unisolated then self.isolation_error = plan.unisolated end
  if not plan.isolated then return end
  local policy, rules = plan.policy, plan.rules
  local network = rules.network
  local token = {}
  self.init_token = token
  local function on_init_exit() self:_init_exited(token) end
  local init, namespaces, code
  -- egress: its address is claimed first (its /etc/resolv.conf names its resolver)
  if network == "egress" then
    self.egress = network_mod.prepare(self, plan.opts.egress or policy.egress, policy.limits, policy.dns)
    undo.push(function() network_mod.detach(self.egress) end)
  end
  -- (an egress sandbox is never pre-built: its resolv.conf is its own; nor
  -- is an image's: its root is the image; a pre-built sandbox's processes
  -- join v1 limit directories only through its own cgroup: without one,
  -- it is not used)
  if plan.spare and not plan.from_image and (tree.mode() == "cgroup" or not next(self.limits_state.v1_dirs)) then
    init, namespaces = claim_spare(self, plan, on_init_exit)
  end
  prewarm.drop(plan.spare) -- (not used; once finished, the sandbox's: left alone)
  if not init then
    -- the host uid its kernel counters are charged to (isolation.lua)
    self.owner_uid = isolation_mod.owner_uid(rules.idmap)
    init, namespaces, code = isolation_mod.start(self, rules_mod.init_options(rules, self.cgroup_name, {
      resolv_conf = self.egress and network_mod.resolv_conf(self.egress),
      owner_uid = self.owner_uid,
      image = plan.image_mounts,
      on_exit = on_init_exit,
    }))
  end
  if not init then
    -- no fallback here: the kernel allows user namespaces (probed), so
    -- this is a failure of the moment (EMFILE, ENOMEM, ...) or of the policy
    errors.raise("ISOLATION_UNAVAILABLE", "cannot create the sandbox's namespaces: " ..
      userns.plain(code, namespaces), { isolation = plan.isolation, errno = code })
  end
  undo.push(function() init:close() end)
  self.init, self.isolation, self.namespaces = init, "namespaces", namespaces
  self.network = network
  self.init_network = network
  self.init_generation = 0
  self.init_pid = init:pid()
  if self.egress then network_mod.attach(self.egress, self.init_pid) end
  self.fs_root = "/proc/" .. self.init_pid .. "/root"
  -- the shells' run directory, reached only through the sandbox's root
  -- and on its own tmpfs (session/shell.lua, Shell:_open_rundir)
  image_mod.give(self.fs_root .. isolation_mod.RUN_DIR, self.image, self.idmap)
  self.run_conf, self.run_conf_error = fs.confine(self.fs_root, { isolation_mod.RUN_DIR:sub(2) },
    self:fs_creds(), "in_root")
  undo.push(function() if self.run_conf then self.run_conf:close() end end)
  self.home = self.image and self.image.workingDir or "/workspace"
  self.cap_keep = rules.cap_keep
  if self.prebuilt_shell then
    -- its start-up script can name paths inside only now
    local sh = self.prebuilt_shell
    self.prebuilt_shell = nil
    self.shell_seq = self.shell_seq + 1
    local inside = isolation_mod.RUN_DIR .. "/sh-" .. self.shell_seq
    if self.run_conf and sh:begin(self:_rundir(inside)) then self.spare = sh else sh:kill() end
    undo.push(function() if self.spare then self:_drop_spare() end end)
  end
end

-- Step 6, file confinement: the file API's root, captured now, before any
-- command of the sandbox runs, so the mounts it may reach are the ones the
-- runtime made.
local function confine_files(self)
  local conf, cmsg = self:_confine(self.run_conf)
  if conf and self.init and not self.run_conf then
    conf:close()
    conf, cmsg = nil, self.run_conf_error
  end
  if not conf then
    errors.raise("FILESYSTEM_ERROR", "cannot confine the sandbox's file API: " .. tostring(cmsg), { root = self.root })
  end
  self.fs_conf = conf
end

-- The live sandbox of id (options checked against it), or a new one.
function make_sandbox(id, opts)
  local plan = check_options(id, opts)
  local live = registry[id]
  if live then
    if opts.root ~= nil and root_mod.canonical(opts.root) ~= live.root_canon then
      V.fail("root", ("sandbox %q is live with its root at %s, not %s"):format(id, live.root, opts.root))
    end
    return live
  end
  choose_isolation(plan)
  local undo = undo_list()
  local ok, result = pcall(function()
    prepare_root(plan, undo)
    prepare_image(plan)
    local self = new_sandbox(plan)
    -- a restore's old workspace content (files/backup.lua, beside the
    -- workspace, outside the sandbox's view) that a runtime stopped before
    -- removing: removed now, on the thread pool, like the restore would have
    for _, name in ipairs(core.readdir(plan.canon) or {}) do
      if name:match("^%.moonbox%-old%-") then self:remove_later(name) end
    end
    set_limits(self, plan, undo)
    enter_isolation(self, plan, undo)
    confine_files(self)
    return self
  end)
  if not ok then
    undo.run()
    error(result, 0)
  end
  result:_hand_lock()
  registry[id] = result
  return result
end

-- The root's lock costs the runtime no fd while the sandbox has an init
-- (thousands of sandboxes per runtime): the init holds it, out of reach of
-- the sandbox's processes (its fds are not theirs to open), until destroy
-- takes it back. The init's death releases it: _take_lock takes it anew.
-- An init that cannot take it leaves it with the runtime.
function Sandbox:_hand_lock()
  local lock, init = self.root_lock, self.init
  if not (lock and lock.fd and init and not self.init_dead) then return end
  if init:hold(lock.fd) then
    core.close_fd(lock.fd)
    lock.fd = nil
  end
end

-- The root's lock back with the runtime: from the init that holds it, or
-- taken again when that init died (a rebuilt init holds none: ENOENT).
-- false when another runtime took the root meanwhile.
function Sandbox:_take_lock()
  local lock = self.root_lock
  if not lock or lock.fd then return true end
  local fd = self.init and not self.init_dead and self.init:give()
  if fd then
    lock.fd = fd
    return true
  end
  local ok, again = pcall(root_mod.lock, self.id, self.root_canon)
  if not ok then return false, again end
  lock.fd = again.fd
  return true
end

-- The file API's storage inside a namespaced sandbox: its own mounts.
M.OWN_STORAGE = { "/workspace", "/tmp", "/root" }

-- A confinement (lib/fs.lua confine) of the file API: under namespaces rooted at
-- the sandbox's root, paths resolved as its processes see them (in_root),
-- every fd on one of the sandbox's own storage mounts (the workspace, /tmp,
-- /root, the policy's mounts); without namespaces the root directory,
-- nothing resolved outside it (beneath). With sb.idmap, the sandbox root's
-- host ids do the I/O.
-- Mounts below those (a host's mount under the workspace, carried in by the
-- recursive bind) belong to the storage too: they are read from the init's
-- mountinfo now, before anything of the sandbox runs.
local function submounts(pid, dirs)
  local out = {}
  local f = io.open("/proc/" .. pid .. "/mountinfo")
  if not f then return out end
  for line in f:lines() do
    local mp = line:match("^%d+ %d+ %S+ %S+ (%S+)")
    if mp then
      mp = mp:gsub("\\(%d%d%d)", function(o) return string.char(tonumber(o, 8)) end)
      for _, dir in ipairs(dirs) do
        if mp:sub(1, #dir + 1) == dir .. "/" then out[#out + 1] = mp break end
      end
    end
  end
  f:close()
  return out
end

-- The ids the runtime's file I/O for the sandbox runs with: root inside's
-- host ids when the runtime is root and they differ (a runtime that is not
-- root maps only itself: nothing to switch).
function Sandbox:fs_creds()
  local idmap = self.idmap
  if not idmap or core.getuid() ~= 0 or (idmap.uid == 0 and idmap.gid == 0) then return nil end
  -- an image's User: the file API acts as that user (docs/images.md)
  local uid, gid = image_mod.host_ids(self.image, idmap)
  return { uid = uid, gid = gid }
end

-- root: the run directory's confinement, whose root fd (the same
-- /proc/<init>/root) this one shares: one fd per sandbox, not two.
function Sandbox:_confine(root)
  local creds = self:fs_creds()
  if not self.init then return fs.confine(self.fs_root, nil, creds, "beneath") end
  local dirs = util.copy(M.OWN_STORAGE)
  for _, m in ipairs(self.rules.mounts or {}) do
    if m.dst and normalize(m.dst) ~= "/" then dirs[#dirs + 1] = normalize(m.dst) end
  end
  local allowed = {}
  for _, dir in ipairs(dirs) do allowed[#allowed + 1] = dir:sub(2) end
  for _, mp in ipairs(submounts(self.init:pid(), dirs)) do allowed[#allowed + 1] = mp:sub(2) end
  -- an image's root is the sandbox's own storage too (its upper dir)
  if self.image then allowed[#allowed + 1] = "." end
  return fs.confine(root or self.fs_root, allowed, creds, "in_root")
end

-- The sandbox init exited. On destroy that is expected; otherwise it was
-- killed (kill -9 from the host) or crashed, and every process of the
-- sandbox died with its pid namespace. The sandbox notices here, once: the
-- generation moves on (a call that was running when it died raises
-- SANDBOX_RESTARTED), and the next call rebuilds the init (revive_init) over
-- the same root: the workspace is a directory of the host and stays; the
-- private /tmp and /root, every process, and the state of every shell go.
function Sandbox:_init_exited(token)
  if token ~= self.init_token then return end -- an init already replaced
  if self._on_init_exit then self._on_init_exit() end
  self:_init_lost()
end

function Sandbox:_init_lost()
  if self.init_dead then return end
  self.init_dead = true
  if self.destroyed or self.destroying then return end
  self.init_generation = (self.init_generation or 0) + 1
end

-- Whether the init still runs (its exit may not have been reported yet:
-- a shell killed with its pid namespace can be reported first).
function Sandbox:init_alive()
  if not self.init or self.init_dead then return false end
  -- (an init that was killed is exiting, PF_EXITING in the flags, before it
  -- is a zombie: it waits there for the rest of its pid namespace to die)
  local stat = util.read_file("/proc/" .. self.init_pid .. "/stat")
  local state, flags = (stat or ""):match("^%d+ %(.*%) (%a) %S+ %S+ %S+ %S+ %S+ (%d+)")
  if state and state ~= "Z" and state ~= "X" and math.floor(tonumber(flags) / 4) % 2 == 0 then return true end
  self:_init_lost()
  return false
end

-- Rebuild a sandbox whose init died (not by destroy): a new init with the
-- same namespaces, mounts, hostname and cgroup, then sessions restart their
-- shells on first use with their last known cwd and exported env.
function Sandbox:revive_init()
  if not self.init or self.destroyed or self.destroying then return end
  if not self.init_dead and self:init_alive() then return end
  local old = self.init
  pcall(old.close, old)
  local spare = self.spare
  self.spare = nil
  if spare and spare:alive() then spare:kill("SIGKILL") end
  local token = {}
  local init, namespaces, code = isolation_mod.start(self, rules_mod.init_options(self.rules, self.cgroup_name, {
    resolv_conf = self.egress and network_mod.resolv_conf(self.egress),
    owner_uid = self.owner_uid,
    image = self.image_mounts,
    on_exit = function() self:_init_exited(token) end,
  }))
  if not init then
    errors.raise("SANDBOX_RESTARTED", ("sandbox %q lost its init process and cannot rebuild it: %s")
      :format(self.id, tostring(namespaces)), { id = self.id, errno = code })
  end
  self.init, self.namespaces, self.init_dead, self.init_token = init, namespaces, false, token
  self.init_pid = init:pid()
  if self.egress then
    local ok, err = pcall(network_mod.attach, self.egress, self.init_pid)
    if not ok then
      pcall(init.close, init)
      self.init_dead = true
      errors.raise("SANDBOX_RESTARTED", ("sandbox %q lost its init process and cannot link the new one: %s")
        :format(self.id, tostring(err)), { id = self.id })
    end
  end
  self.fs_root = "/proc/" .. self.init_pid .. "/root"
  self.restarts = (self.restarts or 0) + 1
  -- the confinements name the old init's root and mounts: take them anew
  -- from the new one, before anything of the sandbox runs there
  for _, name in ipairs { "fs_conf", "run_conf" } do
    if self[name] then self[name]:close() self[name] = nil end
  end
  image_mod.give(self.fs_root .. isolation_mod.RUN_DIR, self.image, self.idmap)
  local run_conf, rmsg = fs.confine(self.fs_root, { isolation_mod.RUN_DIR:sub(2) }, self:fs_creds(), "in_root")
  local conf, cmsg = self:_confine(run_conf)
  if not run_conf or not conf then
    if run_conf then run_conf:close() end
    if conf then conf:close() end
    pcall(init.close, init)
    self.init_dead = true
    errors.raise("SANDBOX_RESTARTED", ("sandbox %q lost its init process and cannot confine the new one: %s")
      :format(self.id, tostring(rmsg or cmsg)), { id = self.id })
  end
  self.run_conf, self.fs_conf = run_conf, conf
  -- the dead init's lock went with it: the root must still be ours
  local locked, lerr = self:_take_lock()
  if not locked then
    pcall(init.close, init)
    self.init_dead = true
    error(lerr, 0)
  end
  self:_hand_lock()
end

-- The one spawn spec (sandbox/spawn.lua): every process of this sandbox is started
-- by core.spawn(sb:spawn_spec{...}), which adds its namespaces, cgroups,
-- rlimits, seccomp filter, capabilities and pipe ownership.
function Sandbox:spawn_spec(spec)
  if self.init then self:revive_init() end
  return spawn_rules.apply({
    init = self.init, cap_keep = self.cap_keep, idmap = self.idmap, limits = self.limits_state,
    user = self.image and { uid = self.image.uid, gid = self.image.gid, groups = self.image.groups },
    cgroup_dir = rules_mod.cgroup_dir(self.cgroup_name),
  }, spec)
end

-- Whether a directory exists in the sandbox's view (path as host_path gives).
function Sandbox:dir_exists(path)
  if not self.init then return util.is_dir(path) end
  local rel = path:gsub("^/+", "")
  if rel == "" then return true end
  local ok, st = pcall(fs.stat_beneath, self.fs_root, rel, "in_root")
  return ok and type(st) == "table" and st.type == "directory"
end

-- Map a path of the sandbox's view to the host: /workspace/... is the
-- workspace directory; a relative path is taken from base (a host path).
function Sandbox:host_path(path, base)
  if path:sub(1, 1) ~= "/" then path = (base or self.home) .. "/" .. path end
  path = normalize(path)
  if self.init then return path end -- the shell sees the sandbox's own tree
  if path == "/workspace" or path:sub(1, 11) == "/workspace/" then
    return self.workspace .. path:sub(11)
  end
  return path
end

-- The view's name for a host path (inverse of host_path where it applies).
function Sandbox:view_path(host)
  if self.init then return host end
  if host == self.workspace or host:sub(1, #self.workspace + 1) == self.workspace .. "/" then
    return "/workspace" .. host:sub(#self.workspace + 1)
  end
  return host
end

function Sandbox:check_live()
  if self.destroyed then
    errors.raise("SANDBOX_DESTROYED", ("sandbox %q was destroyed"):format(self.id), { id = self.id })
  end
  if self.init_dead then self:revive_init() end
end

-- A file call that found no way into the sandbox first asks whether the
-- sandbox's storage is still there: with its root or workspace removed
-- from the host, every path seems to lead out of it (the workspace inside
-- is a deleted directory), and PATH_OUTSIDE_SANDBOX would mislead.
function Sandbox:check_storage(path)
  if util.is_dir(self.workspace) then return end
  errors.raise("FILE_NOT_FOUND", ("%s: the sandbox's workspace %s no longer exists (removed from the host)")
    :format(tostring(path), self.workspace), { path = path, root = self.root, storageGone = true })
end

-- env for a new shell: policy defaults < sandbox env < session env
function Sandbox:_session_env(extra)
  local env = {}
  for k, v in pairs(self.policy.env) do env[k] = v or nil end -- (false: a default the policy removed)
  -- inside namespaces the host's home does not exist; /root is a private tmpfs
  env.HOME = env.HOME or (self.init and "/root") or os.getenv("HOME") or "/root"
  env.MOONBOX_SANDBOX = self.id
  for _, layer in ipairs { self.env, extra or {} } do
    for k, v in pairs(layer) do
      if v == false then env[k] = nil else env[k] = v end
    end
  end
  return env
end

-- A warm spare shell for the next createSession (see Session:_adopt). It is
-- started only once a sandbox creates sessions, outside the caller's time.
function Sandbox:take_spare(no_refill)
  local spare = self.spare
  self.spare = nil
  if spare and not spare:usable() then spare = nil end
  if not no_refill and not self.destroyed and not self.spare_pending then
    self.spare_pending = true
    local t = core.timer()
    t:start(0, 0, function()
      t:close()
      self.spare_pending = false
      if self.destroyed or self.spare then return end
      local env = self:_session_env()
      -- born in a cgroup of its own, which the session that adopts it
      -- keeps: a migration after a quiet spell costs milliseconds
      self.spare_seq = (self.spare_seq or 0) + 1
      local name = self.cgroup_name .. "/spare-" .. self.spare_seq
      local session_cgroup = cgroup.create(name)
      self.spare = self:spawn_shell {
        env = env, cwd = self.home, shell = self.policy.shell,
        cgroup = session_cgroup and cgroup.create(name .. "/cmd0"), session_cgroup = session_cgroup,
      }
    end)
  end
  return spare
end

-- A shell's run directory: its path inside, the same from the runtime, and
-- the host ids its processes run as (root inside, or the image's User:
-- who gets the entries the shell writes).
function Sandbox:_rundir(inside)
  local uid, gid = image_mod.host_ids(self.image, self.idmap)
  return { host = self.fs_root .. inside, inside = inside, uid = uid, gid = gid,
    conf = self.run_conf }
end

-- A session shell (session/shell.lua spawn) started in this sandbox; under namespaces
-- its per-command pipes are FIFOs in a directory of its own under .run.
function Sandbox:spawn_shell(opts)
  -- (a createSession that waited while the sandbox was destroyed)
  if self.destroyed then
    errors.raise("SANDBOX_DESTROYED", ("sandbox %q was destroyed"):format(self.id), { id = self.id })
  end
  if self.init then
    self.shell_seq = self.shell_seq + 1
    local name = "sh-" .. self.shell_seq
    -- a tmpfs inside, reached from here through the init's root
    opts.rundir = self:_rundir(isolation_mod.RUN_DIR .. "/" .. name)
  end
  if self.image then opts.no_builtins = true end
  opts.spawn_spec = function(spec) return self:spawn_spec(spec) end
  return shell_mod.spawn(opts)
end

function Sandbox:_drop_spare(gone)
  local spare = self.spare
  self.spare = nil
  if spare and spare:alive() then
    if not gone then spare:kill("SIGKILL") end
    spare:wait_exit()
  end
end

local session_options = { id = true, env = true, cwd = true, commandTimeoutMs = true }

function Sandbox:createSession(opts)
  self:check_live()
  local seed_options = require "moonbox.lib.seed_options"
  opts = seed_options.adapt(opts, seed_options.createSession, "createSession")
  opts = V.options(opts, session_options, "createSession options")
  local id = opts.id
  if id == nil then
    repeat
      self.session_seq = self.session_seq + 1
      id = "session-" .. self.session_seq
    until not self.sessions[id]
  end
  V.id(id, "id", "session id")
  local env = V.env(opts.env, "env")
  local commandTimeoutMs = V.timeout(opts.commandTimeoutMs, "commandTimeoutMs")
  local cwd = self.home
  if opts.cwd ~= nil then
    cwd = self:host_path(V.path(opts.cwd, "cwd"))
    if not self:dir_exists(cwd) then V.fail("cwd", ("directory %q does not exist"):format(opts.cwd)) end
  end
  if self.sessions[id] then
    errors.raise("SESSION_ALREADY_EXISTS", ("session %q already exists"):format(id), { sessionId = id })
  end
  self:_check_session_room("")
  local changed = policy_mod.call_hook(self.policy, "onCreateSession", "createSession", { sessionId = id },
    self, { id = id, env = env, cwd = cwd, commandTimeoutMs = opts.commandTimeoutMs })
  if changed ~= nil then -- rewritten options (the id stays)
    -- a replacement the call could not take is the hook's mistake, not the
    -- caller's: POLICY_ERROR naming the hook and what was wrong
    local took, err = pcall(function()
      V.options(changed, { id = true, env = true, cwd = true, commandTimeoutMs = true }, "onCreateSession's options")
      env = V.env(changed.env, "env")
      commandTimeoutMs = V.timeout(changed.commandTimeoutMs, "commandTimeoutMs")
      if changed.cwd ~= cwd and changed.cwd ~= nil then
        cwd = self:host_path(V.path(changed.cwd, "cwd"))
        if not self:dir_exists(cwd) then V.fail("cwd", ("directory %q does not exist"):format(changed.cwd)) end
      end
    end)
    if not took then
      if not (errors.is_error(err) and err.code == "VALIDATION_FAILED") then error(err, 0) end
      errors.raise("POLICY_ERROR", ("policy hook onCreateSession returned options createSession cannot take: %s")
        :format(err.message), { hook = "onCreateSession", sessionId = id, field = err.context and err.context.field })
    end
  end
  self.sessions[id] = true   -- reserved: a concurrent create of this id loses
  local ok, session = pcall(session_mod.new, self, id, {
    env = self:_session_env(env), cwd = cwd, commandTimeoutMs = commandTimeoutMs })
  if ok and self.destroyed then -- destroyed while it started: it must not outlive the sandbox
    session:tear_down()
    ok, session = false, errors.new("SANDBOX_DESTROYED", ("sandbox %q was destroyed"):format(self.id), { id = self.id })
  end
  self.sessions[id] = ok and session or nil
  -- (a deleteSession of this id that came meanwhile goes on now)
  local waiters = self.session_waiters and self.session_waiters[id]
  if waiters then
    self.session_waiters[id] = nil
    for _, w in ipairs(waiters) do w.resume() end
  end
  if not ok then error(session, 0) end
  return session
end

-- A session being made (its id reserved, createSession under way): wait
-- until it is made or has failed.
function Sandbox:_session_settled(id)
  while self.sessions[id] == true do
    async.await(function(resume)
      self.session_waiters = self.session_waiters or {}
      local list = self.session_waiters[id] or {}
      self.session_waiters[id] = list
      local w = { resume = resume }
      list[#list + 1] = w
      return function() w.resume = function() end end
    end, "session being made")
    self:check_live()
  end
end

-- POLICY_DENIED when the sandbox already has limits.maxSessions sessions
-- (the default one included); why: the message's tail.
function Sandbox:_check_session_room(why)
  local count = 0
  for _ in pairs(self.sessions) do count = count + 1 end
  if count >= self.policy.limits.maxSessions then
    errors.raise("POLICY_DENIED", ("sandbox %q already has %d sessions (limits.maxSessions)%s"):format(self.id, count,
      why), { limit = "maxSessions", maxSessions = self.policy.limits.maxSessions })
  end
end

function Sandbox:getSession(id)
  self:check_live()
  V.type(id, "string", "sessionId")
  if id == "default" then return self:_default() end -- created on first use
  local s = self.sessions[id]
  if type(s) ~= "table" then
    errors.raise("SESSION_NOT_FOUND", ("session %q does not exist"):format(id), { sessionId = id })
  end
  return s
end

function Sandbox:listSessions()
  local ids = {}
  for id, s in pairs(self.sessions) do if type(s) == "table" then ids[#ids + 1] = id end end
  table.sort(ids)
  return ids
end

function Sandbox:deleteSession(id)
  self:check_live()
  V.type(id, "string", "sessionId")
  local s
  if id == "default" then
    -- a reset: its shell and all it started die; the next call that needs
    -- the default session gets a fresh one. One still starting is awaited
    -- first (it must not outlive the reset); one never made has nothing to kill.
    if self.sessions.default == nil then
      return { success = true, sessionId = id, timestamp = util.timestamp() }
    end
    s = self:_default()
  else
    -- one still being made is deleted once made (not SESSION_NOT_FOUND)
    if self.sessions[id] == true then self:_session_settled(id) end
    s = self:getSession(id)
  end
  self.sessions[id] = nil
  -- its processes first, so they end as "killed" (ours) before the session's
  -- sweep reaches them
  compose.run(session_mod.hooks, "session_ending", self, id)
  s:tear_down()
  return { success = true, sessionId = id, timestamp = util.timestamp() }
end

-- The default session, once one that is starting has started (or failed
-- to); nil when there is none.
function Sandbox:_default_settled()
  while self.sessions.default == true do
    async.await(function(resume)
      self.default_waiters = self.default_waiters or {}
      local w = { resume = resume }
      table.insert(self.default_waiters, w)
      return function() w.resume = function() end end
    end, "default session")
    self:check_live()
  end
  return self.sessions.default or nil
end

-- The default session, made on first use. Making it may wait (it adopts the
-- warm spare shell); tasks that ask meanwhile wait for that one instead of
-- making (and leaking) shells of their own.
function Sandbox:_default()
  self:check_live()
  local existing = self:_default_settled()
  if existing then return existing end
  self:_check_session_room(", so no default session") -- it counts like any other
  self.sessions.default = true -- reserved while it starts
  local ok, s = pcall(session_mod.new, self, "default", { env = self:_session_env(), cwd = self.home })
  if ok and self.destroyed then -- destroyed while it started: it must not outlive the sandbox
    s:tear_down()
    ok, s = false, errors.new("SANDBOX_DESTROYED", ("sandbox %q was destroyed"):format(self.id), { id = self.id })
  end
  self.sessions.default = ok and s or nil
  local waiters = self.default_waiters or {}
  self.default_waiters = nil
  for _, w in ipairs(waiters) do w.resume() end
  if not ok then error(s, 0) end
  return s
end

-- Sandbox level: remembered for sessions created later, applied to the
-- default session now.
function Sandbox:setEnvVars(map)
  self:check_live()
  local env = V.env(V.type(map, "table", "envVars"), "envVars")
  -- a default session that is starting took its env before this call: wait for it
  local default = self:_default_settled()
  -- the policy sees (and may rewrite or refuse) what later sessions get too
  env = session_mod.env_hook(self, default or self, env)
  for k, v in pairs(env) do self.env[k] = v end
  if default then
    -- sandbox < session: a name the default session set itself stays
    local apply = {}
    for k, v in pairs(env) do
      if not (default.own_env and default.own_env[k]) then apply[k] = v end
    end
    return default:apply_env(apply)
  end
  return { success = true, timestamp = util.timestamp() }
end

-- What is in force: limits lists only what is enforced; enforcement says
-- how, notEnforced names limits the policy asked for that this host cannot
-- enforce.
-- The argv of the image's Entrypoint then Cmd (startProcess without a
-- command), or nil when the image has neither.
function Sandbox:image_command()
  local argv = {}
  for _, list in ipairs { self.image.entrypoint or {}, self.image.cmd or {} } do
    for _, w in ipairs(list) do argv[#argv + 1] = w end
  end
  return argv[1] and argv or nil
end

-- commit{name} -> image record (**waits**): what the sandbox changed over
-- its image, as a new layer and image in the store (images/commit.lua)
function Sandbox:commit(opts)
  if self.destroyed then
    errors.raise("SANDBOX_DESTROYED", ("sandbox %q was destroyed"):format(self.id), { id = self.id })
  end
  return require("moonbox.images.commit").commit(self, opts)
end

function Sandbox:info()
  -- a sandbox whose init died is rebuilt first, so this says what is in
  -- force now; one that cannot be rebuilt raises SANDBOX_RESTARTED (coded)
  if not self.destroyed and self.init_dead then self:revive_init() end
  local in_force = {}
  for _, k in ipairs { "commandTimeoutMs", "maxOutputBytes", "maxLogBytes", "maxSessions", "maxProcesses",
    "maxCompletedProcesses", "maxCompletedLogBytes",
    "killGraceMs", "timeoutGraceMs", "maxFileBytes" } do
    in_force[k] = self.policy.limits[k]
  end
  for k in pairs(self.limits_state.enforced) do in_force[k] = self.policy.limits[k] end
  if self.init then in_force.tmpBytes = self.policy.limits.tmpBytes end
  -- the hierarchy the sandbox's processes are tracked and killed by (the
  -- contract's "v2"|"v1"|"none"); a v1 controller a limit also uses is in
  -- enforcement ("cgroup v1 memory")
  local hierarchy = tree.mode() == "cgroup" and "v2" or "none"
  local soft, hard, open = util.fd_limits()
  return {
    -- the runtime's own fd limit (raised to the hard one by the moonbox
    -- executable at start) and use, shared by all its sandboxes
    openFiles = { soft = soft, hard = hard, open = open },
    id = self.id, root = self.root, isolation = self.isolation, requestedIsolation = self.requested_isolation,
    -- (egress: a table, the mode with its mechanism, address, rules, limits and counters)
    network = self.egress and network_mod.info(self.egress) or self.network,
    namespaces = util.copy(self.namespaces), cgroup = hierarchy,
    isolationError = self.isolation_error, initPid = self.init and not self.init_dead and self.init_pid or nil,
    restarts = self.restarts or 0,
    killMode = tree.mode(), limits = in_force,
    enforcement = util.copy(self.limits_state.enforced), notEnforced = util.copy(self.limits_state.not_enforced),
    -- (every process under namespaces gets no_new_privs, sandbox/spawn.lua;
    -- without them only with a seccomp filter)
    seccomp = self.limits_state.seccomp_profile, noNewPrivs = self.limits_state.seccomp ~= nil or self.init ~= nil,
    -- host ids of root inside (count 1: only root is mapped, to the runtime's user)
    idmap = util.copy(self.idmap),
    -- the bounding (and only) capability set of every process under
    -- namespaces; unisolated processes are the runtime's, with its own
    capabilities = self.init and isolation_mod.cap_names(self.rules.capabilities) or nil,
    -- the image the root is made of (docs/images.md), nil for the host's
    image = self.image and image_mod.info(self.image) or nil,
  }
end

-- setNetwork{egress = {allow, deny}}: an egress sandbox's rules, changed at
-- once for new connections (one nft transaction; the connections already
-- open stay). The mode itself is chosen at getSandbox: naming another one
-- here is refused. -> info().network
function Sandbox:setNetwork(opts)
  self:check_live()
  opts = V.options(opts, { network = true, egress = true }, "setNetwork options")
  local mode = self.egress and "egress" or self.network
  if opts.network ~= nil and opts.network ~= mode then
    V.fail("network", ("the sandbox's network is %q; a mode is chosen when the sandbox is made"):format(mode))
  end
  if not self.egress then
    V.fail("egress", ('rules apply to network = "egress"; this sandbox\'s network is %q'):format(mode))
  end
  if self.init_dead then self:revive_init() end
  network_mod.update(self.egress, opts.egress or {})
  return network_mod.info(self.egress)
end

-- Removal, on the thread pool, of relpath under the sandbox's root
-- directory (files the sandbox no longer sees: restoreBackup's old
-- workspace content), not waited for by the caller; destroy waits for every
-- such removal before the root is removed or released.
function Sandbox:remove_later(relpath)
  local job = { done = false, waiters = {} }
  local function finish()
    job.done = true
    self.removals[job] = nil
    for _, w in ipairs(job.waiters) do w() end
  end
  self.removals = self.removals or {}
  self.removals[job] = true
  if not core.fs_remove_tree(self.root_canon, relpath, "beneath", finish) then finish() end
end

function Sandbox:_await_removals()
  local jobs = {}
  for job in pairs(self.removals or {}) do jobs[#jobs + 1] = job end
  for _, job in ipairs(jobs) do
    if not job.done then
      async.await(function(resume) job.waiters[#job.waiters + 1] = resume end, "file removal")
    end
  end
end

-- A sandbox with a disk image: its files are the image's, so the image
-- goes (after a check that the root is still the mount it was), and the
-- empty mount point after it. -> true | nil, message, CODE
function Sandbox:_remove_disk(meanwhile)
  if meanwhile then meanwhile() end
  local now = root_mod.identity(self.root_canon)
  if now ~= self.root_identity then
    if now == nil and not util.is_dir(self.root_canon) then -- already gone (its image with it)
      disk.detach(self.disk, true)
      return true
    end
    return nil, ("%s is no longer the sandbox's root directory (it was replaced); not removed")
      :format(self.root_canon), "ESTALE"
  end
  local ok, msg = disk.detach(self.disk, true)
  if not ok then return nil, msg, "EBUSY" end
  local gone, rmsg, rcode = core.rmdir(self.root_canon)
  if not gone and util.is_dir(self.root_canon) then return nil, rmsg, rcode end
  return true
end

-- destroy{keepFiles}: kill every process of the sandbox, forget its sessions.
--
-- One kill reaches every process of the sandbox at once (sessions,
-- background processes, kernels, terminals), then one wait for all of it
-- to be gone. Under namespaces that is SIGKILL to the init, which the
-- kernel passes on to every process of its pid namespace (nothing leaves a
-- pid namespace: setsid and double forks stay in it), and the init's reap:
-- the kernel reports the init's exit only once every other process of the
-- namespace has been reaped. (A cgroup.kill takes the kernel's cgroup_mutex,
-- for which every cgroup operation on the host queues: 5 ms and more on a
-- busy host.) Without namespaces, in cgroup mode, it is cgroup.kill of the
-- sandbox's cgroup and its "populated 0" (through inotify, _tree.lua). Each
-- part then only collects its exit report and removes its cgroup, with
-- nothing left to kill or look for. Without either, each part kills its own
-- tree. The cgroups are removed while the thread pool removes the files.
function Sandbox:destroy(opts)
  opts = V.options(opts, { keepFiles = true }, "destroy options")
  V.type(opts.keepFiles, "boolean", "keepFiles", true)
  if self.destroyed then return { success = true, id = self.id } end
  self.destroyed = true
  self.destroying = true
  registry[self.id] = nil
  dying[self] = true
  -- (taken at once: nothing else of this id can hold it while it was live)
  local ok, result = pcall(with_id_lock, self.id, function() return self:_destroy_now(opts) end)
  self.destroy_ended = true -- (M.shutdown waits for it)
  if not ok then error(result, 0) end
  return result
end

function Sandbox:_destroy_now(opts)
  -- the root's lock, back from the init before it dies, when the files are
  -- to go (kept, they are released with the init); lost to another runtime
  -- (our init died, and it took the root): its files stay
  local locked, lock_err = true, nil
  if not opts.keepFiles then locked, lock_err = self:_take_lock() end
  if not locked then opts = { keepFiles = true } end
  local cg_dir = rules_mod.cgroup_dir(self.cgroup_name)
  local init = self.init
  local gone = false
  compose.run(session_mod.hooks, "sandbox_killing", self)
  if init and not self.init_dead then
    -- The sandbox's mount namespace, held across the kill: its last
    -- process would otherwise unmount the whole tree on its way out (a
    -- synchronous RCU wait or more, per namespace), before the init's exit
    -- is reported. Closed on the thread pool once the processes are gone,
    -- so the unmounting happens there. (None where /proc refuses it: the
    -- kill goes on as before.)
    local mnt = core.open_fd("/proc/" .. self.init_pid .. "/ns/mnt", "r")
    pcall(init.kill, init, "SIGKILL")
    gone = async.await(function(resume)
      local t = core.timer()
      local function stop() if not t:is_closing() then t:close() end self._on_init_exit = nil end
      self._on_init_exit = function() stop() resume(true) end
      t:start(2000, 0, function() stop() resume(false) end)
      return stop
    end, "sandbox init exit")
    -- (nothing of the sandbox runs outside its pid namespace; were it
    -- otherwise, the cgroup's kill below would reach it)
    if gone and cg_dir and cgroup.populated(cg_dir) then gone = false end
    if mnt then core.fs_close(mnt, function() end) end
  end
  if cg_dir and not gone then
    gone = cgroup.kill_cgroup(cg_dir) and cgroup.wait_empty(cg_dir, 2000, async.sleep)
    if not gone then -- (a process started into it after the kill, by a call still under way)
      cgroup.kill_cgroup(cg_dir)
      -- (the wait ends when the cgroup empties: a slow machine gets long
      -- enough; only processes that cannot die take all of it)
      gone = cgroup.wait_empty(cg_dir, 8000, async.sleep)
    end
    -- never silently: the parts below kill again, each its own, but what
    -- outlived two cgroup kills is named here
    if not gone then
      local pids = cgroup.cgroup_pids(cg_dir)
      if #pids > 0 then
        io.stderr:write(("moonbox: destroy of sandbox %s: its processes (pid %s) still run 10 s after SIGKILL\n")
          :format(self.id, table.concat(pids, ", ")))
      end
    end
  end
  -- nothing runs in the cgroups any more: the whole tree goes on the
  -- thread pool, and the parts' own cgroup removals below are its
  if gone and cg_dir then cgroup.remove_later(cg_dir) end
  compose.run(session_mod.hooks, "session_ending", self, nil, gone) -- every session's processes
  self:_drop_spare(gone)
  for id, s in pairs(self.sessions) do
    self.sessions[id] = nil
    if type(s) == "table" then s:tear_down(gone) end
  end
  compose.run(session_mod.hooks, "sandbox_end", self) -- kernels, terminals
  if not cg_dir and not gone then
    tree.kill_marked("MOONBOX_OWNER", tree.owner(self.id, ""), async.sleep, true) -- prefix: every session
  end
  dying[self] = nil
  -- the init's sockets (it is reaped on the loop, if it was not yet)
  if init then init:close() end
  -- its link, table and resolver (network/init.lua)
  if self.egress then network_mod.detach(self.egress) end
  if self.fs_conf then self.fs_conf:close() end
  if self.run_conf then self.run_conf:close() end
  self:_await_removals()
  local function remove_cgroups() if cg_dir then cgroup.remove_cgroup(cg_dir) end end
  -- the whole tree, at any depth, on the thread pool (the cgroups go
  -- meanwhile); then the root is free
  local removed, msg, code = true, nil, nil
  if not opts.keepFiles and self.disk then
    removed, msg, code = self:_remove_disk(remove_cgroups)
  elseif not opts.keepFiles then
    removed, msg, code = root_mod.remove(self.root_canon, self.root_identity, remove_cgroups)
  else
    remove_cgroups()
  end
  limits.cleanup(self.limits_state, async.sleep)
  if self.guarded then cgroup.unguard() end
  root_mod.unlock(self.root_lock)
  -- kept files stay where they were: the image stays mounted at the root
  -- (a getSandbox of that root takes it again, sandbox/disk.lua) until the
  -- runtime exits
  if opts.keepFiles and self.disk then kept_disks[self.root_canon] = self.disk end
  if not locked then error(lock_err, 0) end
  if not removed then
    errors.raise("FILESYSTEM_ERROR", "destroy could not remove the sandbox's files: " .. tostring(msg),
      { id = self.id, root = self.root, errno = code })
  end
  return { success = true, id = self.id, timestamp = util.timestamp() }
end

M.Sandbox = Sandbox

-- Sandbox's parts (lib/compose.lua), installed here and nowhere else; the
-- hooks are the one table Session's parts register on (session/init.lua).
for _, part in ipairs {
  require "moonbox.sandbox.ports", -- exposePort, unexposePort, getExposedPorts
  require "moonbox.files.backup",  -- createBackup, restoreBackup
} do
  part.install(Sandbox, session_mod.hooks, M)
end

-- The sandbox's own methods run in the default session: every public
-- Session method (its parts' included) the sandbox does not define itself
-- gets a forwarder, made here once both classes are complete. What the
-- sandbox asks of a session (Session's interface to it, docs/architecture.md)
-- is not a call of the sandbox's own.
local Session = session_mod.Session
local SESSION_ONLY = { check_ended = true, apply_env = true, tear_down = true }
M.SESSION_ONLY = SESSION_ONLY
arity.guard(Session, "Session")
arity.guard(Sandbox, "Sandbox")
for name, method in pairs(Session) do
  if type(name) == "string" and not name:match("^_") and not SESSION_ONLY[name] and type(method) == "function"
    and rawget(Sandbox, name) == nil then
    Sandbox[name] = function(self, ...) return Session[name](self:_default(), ...) end
  end
end

M.all = registry_mod.all
M.known_pids = registry_mod.known_pids

M.prewarm = prewarm.enable
prewarm.home = default_home -- (where spares' disks are made)

-- Runtime exit: every sandbox's processes die with it; files stay.

-- A destroy another task started (an idle stop, a DELETE still under way
-- at a SIGTERM) is waited for too (it was no longer in the registry: the
-- runtime exited while it waited for its processes' end). What fails is
-- said on stderr: the runtime's exit goes on.
function M.shutdown()
  prewarm.enable(false)
  local waited = {}
  for _ = 1, 3 do -- (a getSandbox waiting for a destroy may make one anew)
    local live, busy = {}, {}
    for _, sb in pairs(registry) do live[#live + 1] = sb end
    for sb in pairs(dying) do
      if not waited[sb] then busy[#busy + 1] = sb waited[sb] = true end
    end
    if #live == 0 and #busy == 0 then break end
    for _, sb in ipairs(live) do
      local ok, err = pcall(sb.destroy, sb, { keepFiles = true })
      if not ok then
        io.stderr:write("moonbox: shutdown: destroy of sandbox ", sb.id, ": ", errors.format(err), "\n")
      end
    end
    for _, sb in ipairs(busy) do
      for _ = 1, async.in_task() and 1500 or 0 do -- (15 s: its own waits are bounded)
        if sb.destroy_ended then break end
        async.sleep(10)
      end
      if not sb.destroy_ended then
        io.stderr:write("moonbox: shutdown: the destroy of sandbox ", sb.id, " under way has not ended\n")
      end
    end
  end
  -- No mount outlives the runtime: each kept image is unmounted (its files
  -- stay in it, under <home>/disks; getSandbox of the root mounts it again)
  for root, state in pairs(kept_disks) do
    kept_disks[root] = nil
    local ok, msg = disk.detach(state, false)
    if not ok then io.stderr:write("moonbox: shutdown: cannot unmount the disk image at ", root, ": ", msg, "\n") end
  end
  shell_mod.cleanup()
  cgroup.cleanup(async.sleep)
  limits.shutdown()
end

return M
