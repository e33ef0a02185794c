// As root a stopped server leaves its sandboxes' disk images mounted on
// their roots (lua/moonbox/sandbox/disk.lua, kept for a restart):
// releaseMounts(dir) unmounts every mount under dir, deepest first, so the
// directory can be removed and no loop device outlives the test.
"use strict";
const { spawnSync } = require("child_process");
const fs = require("fs");

function releaseMounts(dir) {
  let points;
  try {
    points = fs.readFileSync("/proc/self/mountinfo", "utf8").split("\n")
      .map((line) => (line.split(" ")[4] || "").replace(/\\([0-7]{3})/g, (_, o) => String.fromCharCode(parseInt(o, 8))))
      .filter((p) => p.startsWith(dir + "/"));
  } catch (e) {
    return;
  }
  for (const p of points.sort((a, b) => b.length - a.length)) {
    if (spawnSync("umount", [p]).status !== 0) spawnSync("umount", ["-l", p]);
  }
}

module.exports = { releaseMounts };
