-- Egress benchmark (issue #31): TCP throughput and connect latency from a
-- network = "egress" sandbox (veth, NAT, its nftables table) against the
-- same from the host, to the same server, in one run. The server is nginx
-- in a network namespace routed like the internet (spec/network/internet.sh
-- builds it; nginx-light serves a sparse file from the page cache).
-- Then the same from a sandbox of an unprivileged runtime (pasta+nftables:
-- the script again as nobody, "--sandbox-only", printing its numbers).
-- Run as root: ./build/moonbox bench/egress.lua [rounds] [connects]
local moonbox = require "moonbox"
local core = require "moonbox.core"

local ROUNDS = tonumber(arg and arg[1]) or 5
local CONNECTS = tonumber(arg and arg[2]) or 200
local SANDBOX_ONLY = arg and arg[3] == "--sandbox-only"
local SIZE_MB = 512
assert(SANDBOX_ONLY or core.getuid() == 0, "the bench's internet needs root")

local function sh(cmd)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  return out
end
local function median(t)
  table.sort(t)
  return t[math.floor((#t + 1) / 2)]
end

local function throughput_cmd()
  return "curl -s -o /dev/null -w '%{speed_download}' http://203.0.113.10:8080/big"
end
local function connects_cmd()
  return ("for i in $(seq 1 %d); do curl -s -o /dev/null -w '%%{time_connect}\\n' " ..
    "http://203.0.113.10:8080/small; done"):format(CONNECTS)
end
local function connect_ms(text)
  local t = {}
  for v in text:gmatch("[%d.]+") do t[#t + 1] = tonumber(v) * 1000 end
  return median(t)
end

-- one sandbox of this runtime: {throughput = {B/s...}, connect = ms}
local function measure_sandbox()
  local sb = moonbox.getSandbox("bench-egress-" .. core.getpid(), { network = "egress" })
  local tp = {}
  for _ = 1, ROUNDS do tp[#tp + 1] = tonumber(sb:exec(throughput_cmd()).stdout) end
  local c = connect_ms(sb:exec(connects_cmd()).stdout)
  local mechanism = sb:info().network.mechanism
  sb:destroy()
  return { throughput = tp, connect = c, mechanism = mechanism }
end

if SANDBOX_ONLY then
  local r = measure_sandbox()
  print(("%s %s %s"):format(r.mechanism, median(r.throughput), r.connect))
  return
end

local state = sh("mktemp -d"):gsub("%s+$", "")
local tag = tostring(core.getpid() % 100000)
local script = "spec/network/internet.sh"
assert(os.execute(("sh %s up %s %s %d %d"):format(script, state, tag, 30000 + core.getpid() % 20000,
  30001 + core.getpid() % 20000)) == 0)
local ok, err = pcall(function()
  sh(("truncate -s %dM %s/www/big && printf x > %s/www/small"):format(SIZE_MB, state, state))
  local conf = state .. "/nginx.conf"
  local f = assert(io.open(conf, "w"))
  f:write(([[
user root; daemon off; worker_processes 1; pid %s/nginx.pid; error_log %s/nginx.err;
events { worker_connections 1024; }
http { access_log off; sendfile on; tcp_nopush on; keepalive_timeout 0;
  server { listen 203.0.113.10:8080; root %s/www; } }
]]):format(state, state, state))
  f:close()
  os.execute(("setsid ip netns exec mbt-inet-%s nginx -c %s > /dev/null 2>&1 < /dev/null & echo $! > %s/nginx.pid.sh")
    :format(tag, conf, state))
  for _ = 1, 50 do
    if sh("curl -s -m 1 http://203.0.113.10:8080/small") == "x" then break end
    os.execute("sleep 0.1")
  end
  local host_tp = {}
  for _ = 1, ROUNDS do host_tp[#host_tp + 1] = tonumber(sh(throughput_cmd())) end
  local host_c = connect_ms(sh(connects_cmd()))
  local r = measure_sandbox()
  local ht, st, sb_c = median(host_tp), median(r.throughput), r.connect
  print(("throughput (median of %d, %d MiB over one TCP connection): host %.0f MB/s, sandbox (%s) %.0f MB/s, " ..
    "ratio %.2fx"):format(ROUNDS, SIZE_MB, ht / 1e6, r.mechanism, st / 1e6, st / ht))
  print(("connect latency (median of %d): host %.3f ms, sandbox (%s) %.3f ms, ratio %.2fx")
    :format(CONNECTS, host_c, r.mechanism, sb_c, sb_c / host_c))
  -- unprivileged: the same as nobody (pasta opens /dev/net/tun: udev's
  -- 0666 for the run, its mode put back after)
  local tun_mode = sh("stat -c %a /dev/net/tun 2>/dev/null"):gsub("%s+$", "")
  if tun_mode ~= "" and tun_mode ~= "666" then os.execute("chmod 666 /dev/net/tun") end
  local home = sh("mktemp -d"):gsub("%s+$", "")
  os.execute("chown nobody " .. home)
  local out = sh(("runuser -u nobody -- env HOME=/tmp MOONBOX_HOME=%s %s %s %d %d --sandbox-only 2>&1")
    :format(home, sh("readlink -f /proc/" .. core.getpid() .. "/exe"):gsub("%s+$", ""), arg[0], ROUNDS, CONNECTS))
  os.execute("rm -rf " .. home)
  if tun_mode ~= "" and tun_mode ~= "666" then os.execute("chmod " .. tun_mode .. " /dev/net/tun") end
  local mech, utp, uc = out:match("(%S+) ([%d.e+]+) ([%d.e+]+)%s*$")
  if mech then
    print(("unprivileged: throughput sandbox (%s) %.0f MB/s, ratio %.2fx; connect %.3f ms, ratio %.2fx")
      :format(mech, tonumber(utp) / 1e6, tonumber(utp) / ht, tonumber(uc), tonumber(uc) / host_c))
  else
    print("unprivileged: " .. out)
  end
end)
os.execute(("kill $(cat %s/nginx.pid 2>/dev/null) 2>/dev/null; sh %s down %s; rm -rf %s")
  :format(state, script, state, state))
if not ok then error(err, 0) end
