-- A bounded log: keeps the newest `limit` bytes of one stream as a list of
-- chunks, and remembers whether anything was dropped (and how many bytes in
-- all, so a reader can tell how far the text it saw has shifted).
local LogBuf = {}
LogBuf.__index = LogBuf

local M = {}

function M.new(limit)
  return setmetatable({ chunks = {}, first = 1, last = 0, size = 0, limit = limit, truncated = false, dropped = 0 },
    LogBuf)
end

function LogBuf:append(data)
  if #data >= self.limit then
    -- the chunk alone fills the buffer: keep its tail
    self.chunks, self.first, self.last = { data:sub(-self.limit) }, 1, 1
    self.truncated = self.truncated or #data > self.limit or self.size > 0
    self.dropped = self.dropped + self.size + #data - self.limit
    self.size = self.limit
    return
  end
  self.last = self.last + 1
  self.chunks[self.last] = data
  self.size = self.size + #data
  while self.size > self.limit do
    local head = self.chunks[self.first]
    local excess = self.size - self.limit
    self.truncated = true
    if #head <= excess then
      self.chunks[self.first] = nil
      self.first = self.first + 1
      self.size = self.size - #head
      self.dropped = self.dropped + #head
    else
      self.chunks[self.first] = head:sub(excess + 1)
      self.size = self.size - excess
      self.dropped = self.dropped + excess
    end
  end
end

function LogBuf:text()
  local t = table.concat(self.chunks, "", self.first, self.last)
  if self.last > self.first then
    -- compact, so repeated reads are cheap
    self.chunks, self.first, self.last = { t }, 1, 1
  end
  return t
end

return M
