/**
 * `npm test`: builds the tiny model of the Python server tests, starts two `kiln serve` on it (one open,
 * one with two API keys; each persists to its own snapshot directory), runs the test files with node's test runner against them (they find the servers
 * in KILN_TEST_SERVERS), and stops the servers whatever happens. Arguments pick test files by name
 * (`npm test -- auth cancel`); none runs them all.
 */
import { spawn } from "node:child_process";
import { once } from "node:events";
import { mkdtempSync, readdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import { KilnServe, type SharedServers, tinyModel } from "./helpers.js";

const TESTS = dirname(fileURLToPath(import.meta.url));
const API_KEYS = ["key-a", "key-b"];

function testFiles(names: string[]): string[] {
  const files = readdirSync(TESTS).filter((file) => /\.test\.c?js$/.test(file));
  const picked = names.length === 0 ? files : files.filter((file) => names.some((name) => file.includes(name)));
  return picked.sort().map((file) => join(TESTS, file));
}

async function main(): Promise<number> {
  const files = testFiles(process.argv.slice(2));
  const scratch = mkdtempSync(join(tmpdir(), "kiln-ts-sdk-"));
  const servers: KilnServe[] = [];
  const stopAll = (): Promise<unknown> => Promise.all(servers.map((server) => server.stop()));
  for (const signal of ["SIGINT", "SIGTERM"] as const) {
    process.once(signal, () => void stopAll().finally(() => process.exit(130)));
  }
  try {
    const started = performance.now();
    const model = tinyModel(scratch);
    const cache = join(scratch, "cache");
    const persist = (name: string): string[] => ["--snapshot-dir", join(scratch, `snapshots-${name}`)];
    const starts = await Promise.allSettled([KilnServe.start(model, cache, [], persist("open")),
      KilnServe.start(model, cache, API_KEYS, persist("keyed"))]);
    for (const start of starts) if (start.status === "fulfilled") servers.push(start.value); // stopped below
    for (const start of starts) if (start.status === "rejected") throw start.reason;
    const [open, keyed] = servers;
    console.log(`# kiln serve x2 ready in ${((performance.now() - started) / 1000).toFixed(1)} s`);
    const shared: SharedServers = { open: open!, keyed: keyed! };
    const env = { ...process.env, KILN_TEST_SERVERS: JSON.stringify(shared, ["open", "keyed", "grpcAddress", "httpUrl", "apiKeys"]),
      KILN_TEST_MODEL: model, KILN_TEST_CACHE: cache }; // for a test file that starts a server of its own (ownServer)
    const runner = spawn(process.execPath, ["--test", ...files], { env, stdio: "inherit" });
    const [code] = (await once(runner, "exit")) as [number | null];
    return code ?? 1;
  } finally {
    await stopAll();
    rmSync(scratch, { recursive: true, force: true });
  }
}

process.exitCode = await main();
