// The suite's own origin server (server/server.mjs of the npm package http-cache-tests,
// test-engine/server/server.mjs of the development repository http-tests/cache-tests),
// listening on 127.0.0.1 only: the server calls `listen(port)`, which would take every
// interface.
//
// Usage: node origin.mjs PACKAGE_DIR PORT
import fs from 'node:fs'
import http from 'node:http'
import os from 'node:os'
import path from 'node:path'
import { pathToFileURL } from 'node:url'

const [packageDir, port] = process.argv.slice(2)
if (!packageDir || !port) {
  console.error('usage: node origin.mjs PACKAGE_DIR PORT')
  process.exit(2)
}

const listen = http.Server.prototype.listen
http.Server.prototype.listen = function (listenPort) {
  return listen.call(this, listenPort, '127.0.0.1')
}

// The server reads its settings from the variables `npm run server` would set.
process.env.npm_config_protocol = 'http'
process.env.npm_config_port = port
process.env.npm_config_pidfile = os.devNull

const development = path.join(packageDir, 'test-engine', 'server', 'server.mjs')
const server = fs.existsSync(development) ? development : path.join(packageDir, 'server', 'server.mjs')
await import(pathToFileURL(server).href)
