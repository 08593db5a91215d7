-- wrk script for bench/fleet_cost.sh (section i): GET /items/<id> for an id drawn at random
-- from 1 .. <keys>, every request.
--
-- The request is built in request() for every target alike, and each thread draws from its
-- own generator seeded with its index, so every target gets the same sequence of ids. No
-- response() callback (with one, wrk parses every header of every answer): the caller counts
-- the misses at the origin instead.
--
-- usage: wrk -t T -c C -d 10s -s bench/random_keys.lua URL -- <keys>

local next_index = 0

-- main state: called once per thread, before that thread's init()
function setup(thread)
   thread:set("index", next_index)
   next_index = next_index + 1
end

-- thread state from here on: `index` was set by setup()
local keys = 1

function init(args)
   keys = tonumber(args[1] or "") or error("random_keys.lua: missing <keys> argument")
   math.randomseed(index + 1)
end

function request()
   return wrk.format("GET", "/items/" .. math.random(1, keys))
end
