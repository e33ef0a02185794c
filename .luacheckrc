std = "luajit"
max_line_length = 120
files["spec"] = { std = "+busted", globals = { "run_task", "helper" } }
files["spec/helper.lua"] = { globals = { "run_task", "helper" } }
files["examples"] = { globals = { "arg" } }
files["bench"] = { globals = { "arg" } }
