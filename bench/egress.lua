-- Egress benchmark (issue #31): TCP throughput and connect latency from a
-- network = "egress" sandbox (veth, NAT, its nftables table) against the
-- same from the host, to the same server, in one run. The server is nginx
-- in a network namespace routed like the internet (spec/network/internet.sh
-- builds it; nginx-light serves a sparse file from the page cache).
-- Then the same from a sandbox of an unprivileged runtime (pasta+nftables:
-- the script again as nobody, "--sandbox-only", printing its numbers).
-- Host and sandbox downloads alternate round by round (the load of a
-- shared machine changes within a run), after one download that reads the
-- file into the page cache.
-- The "internet" link is a veth: its receiving end queues each packet on
-- the backlog of the CPU that sent it, and nginx sends from both CPUs (its
-- own write, and the ACKs' softirq on the client's CPU), so one TCP flow
-- arrived reordered: thousands of spurious fast retransmissions per
-- download, more on the sandbox's path (a second veth, a second reordering).
-- A NIC delivers a flow on one queue, in order: internet.sh gives the
-- link's receive queues RPS over every CPU (a flow's packets on one CPU, in
-- order), for every path alike; the bench prints the server's
-- retransmissions per path.
-- Run as root: ./build/moonbox bench/egress.lua [rounds] [connects]
local moonbox = require "moonbox"
local core = require "moonbox.core"

local ROUNDS = tonumber(arg and arg[1]) or 9
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

-- (a download that stalls fails after a minute instead of holding the run)
local function throughput_cmd()
  return "curl -sf -m 60 -o /dev/null -w '%{speed_download}' http://203.0.113.10:8080/big"
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

local function open_sandbox()
  return moonbox.getSandbox("bench-egress-" .. core.getpid(), { network = "egress" })
end
local function sandbox_download(sb)
  local r = sb:exec(throughput_cmd())
  assert(r.exitCode == 0, ("the sandbox's download failed (curl exit %s)"):format(tostring(r.exitCode)))
  return tonumber(r.stdout)
end

if SANDBOX_ONLY then
  local sb = open_sandbox()
  local tp = {}
  sandbox_download(sb) -- (the first: the sandbox's curl read from its disk)
  for _ = 1, ROUNDS do tp[#tp + 1] = sandbox_download(sb) end
  local c = connect_ms(sb:exec(connects_cmd()).stdout)
  print(("%s %s %s"):format(sb:info().network.mechanism, median(tp), c))
  sb:destroy()
  return
end

local state = sh("mktemp -d"):gsub("%s+$", "")
local tag = tostring(core.getpid() % 100000)
local script = "spec/network/internet.sh"
assert(os.execute(("sh %s up %s %s %d %d"):format(script, state, tag, 30000 + core.getpid() % 20000,
  30001 + core.getpid() % 20000)) == 0)
-- TCP segments the server sent again (its namespace's RetransSegs, since the last call)
local retrans_seen = 0
local function server_retransmits()
  local snmp = sh(("ip netns exec mbt-inet-%s cat /proc/net/snmp"):format(tag))
  local names, values = snmp:match("\nTcp: ([^\n]+)\nTcp: ([^\n]+)")
  local keys, total = {}, 0
  for k in (names or ""):gmatch("%S+") do keys[#keys + 1] = k end
  local i = 0
  for v in (values or ""):gmatch("%S+") do
    i = i + 1
    if keys[i] == "RetransSegs" then total = tonumber(v) end
  end
  local new = total - retrans_seen
  retrans_seen = total
  return new
end
local ok, err = pcall(function()
  sh(("truncate -s %dM %s/www/big && printf x > %s/www/small && cat %s/www/big > /dev/null")
    :format(SIZE_MB, state, state, state))
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
  local sb = open_sandbox()
  local mechanism = sb:info().network.mechanism
  sandbox_download(sb)
  server_retransmits()
  local host_tp, sb_tp, host_rt, sb_rt = {}, {}, 0, 0
  for i = 1, ROUNDS do
    host_tp[i] = assert(tonumber(sh(throughput_cmd())), "the host's download failed")
    host_rt = host_rt + server_retransmits()
    sb_tp[i] = sandbox_download(sb)
    sb_rt = sb_rt + server_retransmits()
    print(("round %d: host %.0f MB/s, sandbox %.0f MB/s, ratio %.2fx"):format(i, host_tp[i] / 1e6, sb_tp[i] / 1e6,
      sb_tp[i] / host_tp[i]))
  end
  local host_c = connect_ms(sh(connects_cmd()))
  local sb_c = connect_ms(sb:exec(connects_cmd()).stdout)
  sb:destroy()
  local ht, st = median(host_tp), median(sb_tp)
  print(("throughput (median of %d, %d MiB over one TCP connection, alternated): host %.0f MB/s, " ..
    "sandbox (%s) %.0f MB/s, ratio %.2fx"):format(ROUNDS, SIZE_MB, ht / 1e6, mechanism, st / 1e6, st / ht))
  print(("server retransmissions (segments, all rounds): host %d, sandbox %d"):format(host_rt, sb_rt))
  print(("connect latency (median of %d): host %.3f ms, sandbox (%s) %.3f ms, ratio %.2fx")
    :format(CONNECTS, host_c, mechanism, sb_c, sb_c / host_c))
  -- unprivileged: the same as nobody (pasta opens /dev/net/tun: udev's
  -- 0666 for the run, its mode put back after), on the same link; the
  -- host measured again next to it (the load moves within a run)
  local host_plain = {}
  for i = 1, ROUNDS do host_plain[i] = assert(tonumber(sh(throughput_cmd())), "the host's download failed") end
  local hp = median(host_plain)
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
    print(("unprivileged: throughput host %.0f MB/s, sandbox (%s) %.0f MB/s, ratio %.2fx; " ..
      "connect %.3f ms, ratio %.2fx"):format(hp / 1e6, mech, tonumber(utp) / 1e6, tonumber(utp) / hp, tonumber(uc),
      tonumber(uc) / host_c))
  else
    print("unprivileged: " .. out)
  end
end)
os.execute(("kill $(cat %s/nginx.pid 2>/dev/null) 2>/dev/null; sh %s down %s; rm -rf %s")
  :format(state, script, state, state))
if not ok then error(err, 0) end
