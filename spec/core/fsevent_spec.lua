-- moonbox.core fs_event (src/fsevent.c): inotify watches on one handle,
-- confined placement with (dirfd, relpath), events in the kernel's order.
local core = require "moonbox.core"
local async = require "moonbox.async"
local fs = require "moonbox.lib.fs"

local mkdtemp = helper.mkdtemp

-- Collect events until pred(name, ev) holds.
local function wait_for(events, pred)
  return async.await(function(resume)
    events.check = function()
      for _, e in ipairs(events) do
        if pred(e.name, e.ev) then events.check = nil resume(e) return end
      end
    end
    events.check()
  end)
end

describe("core.fs_event", function()
  it("fails for a missing path and refuses a path that escapes its dirfd", function()
    run_task(function()
      local dir = mkdtemp()
      local h = core.fs_event()
      local wd, msg, code = h:start(dir .. "/missing", function() end)
      assert.is_nil(wd)
      assert.equal("ENOENT", code)
      assert.matches("^ENOENT: ", msg)
      local root = assert(fs.open_dir(dir))
      os.execute("ln -s /etc " .. dir .. "/out")
      for _, rel in ipairs { "..", "out", "../etc" } do
        wd, msg, code = h:add(root, rel)
        assert.is_nil(wd)
        assert.equal("EXDEV", code, rel)
        assert.matches("outside the root", msg)
      end
      fs.close_dir(root)
      h:close()
      os.execute("rm -rf " .. dir)
    end)
  end)

  it("reports create, modify, moves with a shared cookie and delete, for several directories", function()
    run_task(function()
      local dir = mkdtemp()
      os.execute("mkdir " .. dir .. "/a " .. dir .. "/b")
      local root = assert(fs.open_dir(dir))
      local events = {}
      local h = core.fs_event()
      local wd_a = h:start(root, "a", function(err, name, ev)
        assert.is_nil(err)
        events[#events + 1] = { name = name, ev = ev }
        if events.check then events.check() end
      end)
      local wd_b = h:add(root, "b")
      fs.close_dir(root)
      assert.is_number(wd_a)
      assert.is_true(wd_a ~= wd_b)
      assert.is_true(h:is_active())
      os.execute(("cd %s && echo x > a/f && mv a/f b/g && mkdir a/d && rm b/g"):format(dir))
      wait_for(events, function(name, ev) return name == "g" and ev.delete end)
      local seen = {}
      for _, e in ipairs(events) do
        local flags = {}
        for _, k in ipairs { "create", "modify", "moved_from", "moved_to", "delete", "isdir" } do
          if e.ev[k] then flags[#flags + 1] = k end
        end
        seen[#seen + 1] = (e.ev.wd == wd_a and "a/" or "b/") .. e.name .. ":" .. table.concat(flags, "+")
      end
      assert.same({ "a/f:create", "a/f:modify", "a/f:moved_from", "b/g:moved_to", "a/d:create+isdir", "b/g:delete" },
        seen)
      assert.equal(events[3].ev.cookie, events[4].ev.cookie)
      assert.is_true(h:remove(wd_b))
      h:close()
      os.execute("rm -rf " .. dir)
    end)
  end)
end)
