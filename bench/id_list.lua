-- wrk script for bench/penetration.sh: GET /items/<id> for the ids of a file, over and over.
--
-- Thread i (of T) takes lines i+1, i+1+T, i+1+2T, ... of the file and cycles through them;
-- the requests are built once in init(), so request() only hands out a prepared string and
-- the client does the same work per request whatever the ids are (a hit run on a few
-- cached ids and a rejection run on many absent ids cost wrk the same).
--
-- No response() callback on purpose: with one, wrk parses every header of every answer.
-- The caller checks the answers through wrk's own "Non-2xx or 3xx responses" line and the
-- origin's request counter instead.
--
-- usage: wrk -t T -c C -d 10s -s bench/id_list.lua URL -- <ids_file> <T> [path_prefix]
--        (path_prefix defaults to /items/)

local next_index = 0

-- main state: called once per thread, before that thread's init()
function setup(thread)
   thread:set("index", next_index)
   next_index = next_index + 1
end

-- thread state from here on: `index` was set by setup()
local reqs = {}
local n = 0
local i = 0

function init(args)
   local file = args[1] or error("id_list.lua: missing <ids_file> argument")
   local nthreads = tonumber(args[2] or "1")
   local prefix = args[3] or "/items/"
   local f = io.open(file, "r") or error("id_list.lua: cannot open " .. file)
   local line_no = 0
   for line in f:lines() do
      local id = line:match("^%s*(%S+)%s*$")
      if id then
         if line_no % nthreads == index then
            n = n + 1
            reqs[n] = wrk.format("GET", prefix .. id)
         end
         line_no = line_no + 1
      end
   end
   f:close()
   if n == 0 then
      error("id_list.lua: thread " .. index .. " got no ids from " .. file)
   end
end

function request()
   i = i + 1
   if i > n then
      i = 1
   end
   return reqs[i]
end
