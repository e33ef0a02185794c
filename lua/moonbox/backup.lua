-- Public name kept (docs/api.md): the module is lua/moonbox/files/backup.lua.
return require "moonbox.files.backup"
