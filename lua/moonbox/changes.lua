-- Public name kept (docs/api.md): the module is lua/moonbox/files/changes.lua.
return require "moonbox.files.changes"
