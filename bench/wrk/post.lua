-- wrk script for bench/run.py: POST a constant JSON body, optionally with an Idempotency-Key.
--
--   wrk ... URL -- <body> none
--   wrk ... URL -- <body> fixed <key>                 every request sends the same key
--   wrk ... URL -- <body> unique <prefix> <args_hash>  key <prefix>t<thread>n<count>:1:<hash>
--
-- done() prints one line, "WRK_RESULT {json}", with the counts and latency percentiles (us).

local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end

function init(args)
  body, mode, key, args_hash = args[1], args[2], args[3], args[4]
  headers = { ["Content-Type"] = "application/json" }
  counter = 0
  if mode == "fixed" then
    headers["Idempotency-Key"] = key
  end
  if mode ~= "unique" then
    prebuilt = wrk.format("POST", nil, headers, body)
  end
end

function request()
  if prebuilt then
    return prebuilt
  end
  counter = counter + 1
  headers["Idempotency-Key"] = string.format("%st%dn%d:1:%s", key, tid, counter, args_hash)
  return wrk.format("POST", nil, headers, body)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_RESULT {"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,'
      .. '"status_errors":%d,"socket_errors":%d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.status, e.connect + e.read + e.write + e.timeout))
end
