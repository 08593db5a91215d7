// Scores a run of the suite's command-line client exactly as the suite itself does: each
// test's result goes through the suite's `determineTestResult`, which applies the test's
// kind (required, optimal, check) and its dependencies.
//
// Usage: node score.mjs PACKAGE_DIR RESULTS_JSON
//
// PACKAGE_DIR is either the npm package http-cache-tests 0.4.5 (lib/display.mjs; its client
// runs the surrogate-control suite too) or a copy of the development repository
// http-tests/cache-tests (test-engine/lib/results.mjs; its client runs tests/index.mjs only).
//
// Prints one line per test of the suite, `<id> <result>`, sorted by id, where the result is
// one of the suite's categories: pass, fail (a required test failed), optional-fail, yes and
// no (informational checks), setup-fail, harness-fail, dependency-fail, retry, untested.
// Then summary lines starting with `#`: the count of each category, `# passed N` and
// `# required-failures N`.
import fs from 'node:fs'
import path from 'node:path'
import { pathToFileURL } from 'node:url'

const [packageDir, resultsFile] = process.argv.slice(2)
if (!packageDir || !resultsFile) {
  console.error('usage: node score.mjs PACKAGE_DIR RESULTS_JSON')
  process.exit(2)
}
const load = file => import(pathToFileURL(path.join(packageDir, file)).href)
const development = fs.existsSync(path.join(packageDir, 'test-engine', 'lib', 'results.mjs'))

const suites = (await load('tests/index.mjs')).default
// The package's command-line client runs the surrogate-control suite as well (cli.mjs).
if (!development) suites.push((await load('tests/surrogate-control.mjs')).default)
const { determineTestResult } = await load(development ? 'test-engine/lib/results.mjs' : 'lib/display.mjs')
const results = JSON.parse(fs.readFileSync(resultsFile, 'utf8'))

// `determineTestResult` returns one entry of the suite's result table; its third member is
// the symbol the suite prints for it.
const categories = new Map([
  ['✅', 'pass'],
  ['⛔️', 'fail'],
  ['⚠️', 'optional-fail'],
  ['Y', 'yes'],
  ['N', 'no'],
  ['🔹', 'setup-fail'],
  ['⁉️', 'harness-fail'],
  ['⚪️', 'dependency-fail'],
  ['↻', 'retry'],
  ['-', 'untested']
])

const ids = suites.flatMap(suite => suite.tests.map(test => test.id)).sort()
const counts = new Map([...categories.values()].map(name => [name, 0]))
const lines = []
for (const id of ids) {
  const symbol = determineTestResult(suites, id, results)[2]
  const category = categories.get(symbol)
  if (category === undefined) throw new Error(`unknown result ${symbol} for ${id}`)
  counts.set(category, counts.get(category) + 1)
  lines.push(`${id} ${category}`)
}
const unknown = Object.keys(results).filter(id => !ids.includes(id))
if (unknown.length) throw new Error(`results for tests the suite does not have: ${unknown}`)

for (const [category, n] of counts) lines.push(`# ${category} ${n}`)
lines.push(`# passed ${counts.get('pass')}`)
lines.push(`# required-failures ${counts.get('fail')}`)
console.log(lines.join('\n'))
