-- wrk script for bench/fleet_cost.sh (section f): every request a POST of one JSON body of
-- exactly 1024 bytes, {"payload":"xx…x"}: the body `loadgen rate --post-bytes 1024` sends.
--
-- As bench/post.lua: only wrk.method, wrk.body and wrk.headers are set, and no request()
-- function, so wrk builds the request once and sends it as it sends a plain GET.
--
-- usage: wrk -t2 -c64 -d10s -s bench/post_body.lua http://127.0.0.1:PORT/items/1

local bytes = 1024
local head, tail = '{"payload":"', '"}'

wrk.method = "POST"
wrk.body = head .. string.rep("x", bytes - #head - #tail) .. tail
wrk.headers["Content-Type"] = "application/json"
