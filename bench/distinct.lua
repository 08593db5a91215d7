-- wrk script for bench/hit_path.sh (memory section): every request asks for a new key.
--
-- Each thread walks its own block of ids, /items/<first + index*100000000 + n>, so no id
-- repeats in the whole run. A thread stops once it has received its share of responses,
-- so the run ends after <total> requests; give wrk a -d long enough (it is only the upper
-- bound) and check the "distinct:" line that done() prints.
--
-- wrk's main thread sleeps for the whole -d even after every thread has stopped, so each
-- thread also creates <done_dir>/thread-<index>.done when it stops; the caller waits for
-- all of them and then sends wrk SIGINT, which ends the run at once (done() still runs).
--
-- usage: wrk -t T -c C -d 180s -s bench/distinct.lua URL -- <total> <T> <done_dir> [first_id]

local threads = {}
local next_index = 0

-- main state: called once per thread, before that thread's init()
function setup(thread)
   thread:set("index", next_index)
   next_index = next_index + 1
   table.insert(threads, thread)
end

-- thread state from here on: `index` was set by setup()
counter = 0
received = 0
bad = 0
quota = 0
offset = 0
done_dir = nil
stopped = false

function init(args)
   local total = tonumber(args[1] or "1000000")
   local nthreads = tonumber(args[2] or "1")
   done_dir = args[3]
   local first = tonumber(args[4] or "1")
   -- split total over threads; the first (total % nthreads) threads take one more
   quota = math.floor(total / nthreads)
   if index < total % nthreads then
      quota = quota + 1
   end
   offset = first + index * 100000000
end

function request()
   local id = offset + counter
   counter = counter + 1
   return wrk.format("GET", "/items/" .. id)
end

function response(status, headers, body)
   received = received + 1
   if status ~= 200 then
      bad = bad + 1
   end
   if received >= quota and not stopped then
      stopped = true
      if done_dir then
         local f = io.open(done_dir .. "/thread-" .. index .. ".done", "w")
         if f then f:close() end
      end
      wrk.thread:stop()
   end
end

-- main state again, after every thread has finished
function done(summary, latency, requests)
   local sent, got, non200, q = 0, 0, 0, 0
   for _, t in ipairs(threads) do
      sent = sent + t:get("counter")
      got = got + t:get("received")
      non200 = non200 + t:get("bad")
      q = q + t:get("quota")
   end
   io.write(string.format(
      "distinct: threads=%d quota=%d sent=%d received=%d non200=%d completed=%d " ..
      "errors_connect=%d errors_read=%d errors_write=%d errors_timeout=%d duration_s=%.2f\n",
      #threads, q, sent, got, non200, summary.requests,
      summary.errors.connect, summary.errors.read, summary.errors.write,
      summary.errors.timeout, summary.duration / 1e6))
end
