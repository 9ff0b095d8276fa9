"""The index's server-side scripts (Lua, run by Redis in one step each), so that concurrent publishers, evictors and readers never see half an update. `store.index` loads and calls them; the keys they touch are described there."""

from __future__ import annotations

# Insert an entry once: concurrent publishers of one chunk count its bytes once. KEYS: chunk hash,
# lru, bytes, and the parent's children set for a chunk past the first; ARGV: ns, index, size,
# created, score, key, parent.
ADD = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'ns', ARGV[1], 'index', ARGV[2], 'size', ARGV[3], 'created', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[6])
redis.call('INCRBY', KEYS[3], ARGV[3])
if KEYS[4] then
  redis.call('HSET', KEYS[1], 'up', ARGV[7])
  redis.call('SADD', KEYS[4], ARGV[6])
end
return 1
"""

# Remove entries (a tail, or a chunk that is also a branch candidate, from its parent's
# tails; a chunk from its parent's children); returns the bytes freed. KEYS: lru, then chunk
# hashes; ARGV: bytes key, key prefix, key hexes.
REMOVE = """
local freed = 0
for i = 2, #KEYS do
  local h = redis.call('HMGET', KEYS[i], 'size', 'parent', 'branch', 'up')
  if h[1] then
    freed = freed + tonumber(h[1])
    redis.call('DEL', KEYS[i])
  end
  local parent = h[2] or h[3]
  if parent then redis.call('HDEL', ARGV[2] .. 'tails:' .. parent, ARGV[i + 1]) end
  if h[4] then redis.call('SREM', ARGV[2] .. 'children:' .. h[4], ARGV[i + 1]) end
  redis.call('DEL', ARGV[2] .. 'children:' .. ARGV[i + 1])
  redis.call('ZREM', KEYS[1], ARGV[i + 1])
end
if freed > 0 then redis.call('DECRBY', ARGV[1], freed) end
return freed
"""

# Keep a parent's newest ``cap`` candidates (KEYS: tails hash, lru, bytes; the new one is kept):
# a pushed-out tail is forgotten (its hex is returned: its blob is the caller's to delete); a
# pushed-out full chunk stays a chunk and only stops being a candidate.
CAP = """
local function cap_tails(tails, lru, bytes, keep, cap, prefix)
  local out = {}
  while redis.call('HLEN', tails) > cap do
    local names = redis.call('HKEYS', tails)
    local scores = redis.call('ZMSCORE', lru, unpack(names))
    local worst, worst_score = nil, nil
    for i, n in ipairs(names) do
      local sc = scores[i] and tonumber(scores[i]) or -1
      if n ~= keep and (worst_score == nil or sc < worst_score) then worst, worst_score = n, sc end
    end
    if worst == nil then break end
    redis.call('HDEL', tails, worst)
    local chunk = prefix .. 'chunk:' .. worst
    if redis.call('HEXISTS', chunk, 'branch') == 1 then
      redis.call('HDEL', chunk, 'branch')
    else
      local size = redis.call('HGET', chunk, 'size')
      if size then redis.call('DECRBY', bytes, size) end
      redis.call('DEL', chunk)
      redis.call('ZREM', lru, worst)
      out[#out + 1] = worst
    end
  end
  return out
end
"""

# Insert a tail once, then cap its parent's candidates; returns the tails pushed out, or
# false when the tail was already indexed. KEYS: chunk hash, lru, bytes, tails hash;
# ARGV: ns, index, size, created, score, key, parent, tokens, cap, key prefix.
ADD_TAIL = (
    CAP
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
redis.call('HSET', KEYS[1], 'ns', ARGV[1], 'index', ARGV[2], 'size', ARGV[3], 'created', ARGV[4], 'parent', ARGV[7])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[6])
redis.call('INCRBY', KEYS[3], ARGV[3])
redis.call('HSET', KEYS[4], ARGV[6], ARGV[8])
return cap_tails(KEYS[4], KEYS[2], KEYS[3], ARGV[6], tonumber(ARGV[9]), ARGV[10])
"""
)

# Make an indexed full chunk a candidate of its parent too, like a tail (see `add_branch`);
# returns the tails pushed out. KEYS: chunk hash, lru, bytes, tails hash; ARGV: key, parent,
# tokens, cap, key prefix.
ADD_BRANCH = (
    CAP
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
redis.call('HSET', KEYS[1], 'branch', ARGV[2])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[3])
return cap_tails(KEYS[4], KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[4]), ARGV[5])
"""
)

# How many leading chunks are indexed, and the tails of the deepest one (or of the
# namespace, at depth 0). KEYS: lru; ARGV: key prefix, namespace hex, chain key hexes.
LOOKUP = """
local depth = 0
for i = 3, #ARGV do
  if not redis.call('ZSCORE', KEYS[1], ARGV[i]) then break end
  depth = depth + 1
end
return {depth, redis.call('HGETALL', ARGV[1] .. 'tails:' .. ARGV[2 + depth])}
"""

# Pin indexed entries until a time (never shortening a pin): KEYS: lru, then chunk hashes;
# ARGV: the time, then each entry's key hex and score.
PIN = """
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    if tonumber(redis.call('HGET', KEYS[i], 'pinned') or '0') < tonumber(ARGV[1]) then
      redis.call('HSET', KEYS[i], 'pinned', ARGV[1])
    end
    redis.call('ZADD', KEYS[1], 'XX', 'GT', ARGV[2 * i - 1], ARGV[2 * i - 2])
  end
end
return 0
"""
