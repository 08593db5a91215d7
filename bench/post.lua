-- wrk script for bench/flash_sale.sh: every request a POST with a small JSON body (a buy).
--
-- Only wrk.method, wrk.body and wrk.headers are set, and no request() function: wrk
-- builds the request once and sends it as it sends a plain GET, so a run with this script
-- and one without it measure the target, not the script.
--
-- usage: wrk -t2 -c64 -d10s -s bench/post.lua http://127.0.0.1:PORT/trains/t/seats/a/orders

wrk.method = "POST"
wrk.body = '{"units":1}'
wrk.headers["Content-Type"] = "application/json"
