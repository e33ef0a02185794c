-- Public name kept (examples/exposed-port.lua): the module is lua/moonbox/sandbox/ports.lua.
return require "moonbox.sandbox.ports"
